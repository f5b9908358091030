"""sglang.pcie-ipc on a fixture in the shape of 0.5.21 to 0.5.23's pcie_ipc_ar.py (before/after),
and the patched `eligible_group` run: on by default only for an unset variable on SM120 without
full NVLink; an explicit 0 or 1 kept."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("sglang.pcie-ipc")

# Written for this test in the released layout: the module's imports, the group-name set and
# `eligible_group` with its test over several lines, then the next function.
SOURCE = '''
import functools
import logging

import torch

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

_ELIGIBLE_GROUP_NAMES = frozenset({"tp"})


def eligible_group(
    *, group_name, world_size, deterministic
):
    """Whether to build the backend."""
    if not (
        envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get()
        and world_size > 1
        and group_name in _ELIGIBLE_GROUP_NAMES
    ):
        return False
    if deterministic:
        return False
    return True


def after():
    return None
'''

SWITCH = '''    """Whether to build the backend."""
    # sm120patch pcie-ipc: unset, the PCIe-IPC allreduce is on for SM120 GPUs without full
    # NVLink; an explicit SGLANG_ENABLE_PCIE_IPC_ALLREDUCE (0 or 1) is kept. Trial only.
    if (
        not envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.is_set()
        and world_size > 1
        and group_name in _ELIGIBLE_GROUP_NAMES
        and _sm120patch_pcie_only()
    ):
        envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.set(True)
    if not (
'''


def one(res):
    [outcome] = res.outcomes
    return outcome


def test_applies_once_with_switch_and_helper(run_patch):
    res = run_patch(PATCH, SOURCE)
    assert one(res).status is Status.APPLIED, one(res).reason
    assert one(res).site == "eligible_group"
    assert SWITCH in res.after
    # the helper right after eligible_group, two blank lines around it, the rest untouched
    head, _, rest = res.after.partition("    return True\n\n\ndef _sm120patch_pcie_only() -> bool:\n")
    assert rest and rest.endswith("\n\n\ndef after():\n    return None\n")
    assert head.replace(SWITCH, '    """Whether to build the backend."""\n    if not (\n') == (
        textwrap.dedent(SOURCE).partition("    return True\n")[0]
    )
    again = run_patch(PATCH, res.after)
    assert one(again).status is Status.ALREADY_APPLIED and again.after == res.after


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        (lambda s: s.replace("world_size > 1\n", "world_size > 2\n"), Status.NOT_APPLICABLE,
         "no `if not (envs"),
        (lambda s: s.replace("def eligible_group", "def other_name"), Status.NOT_APPLICABLE,
         "no `def eligible_group`"),
        (lambda s: s.replace("        return False\n    if deterministic", "        pass\n    if "
                             "deterministic"), Status.REFUSED, "ending in `return`"),
    ],
    ids=["other-test", "no-function", "no-return"],
)
def test_other_shapes(run_patch, edit, status, found):
    res = run_patch(PATCH, edit(textwrap.dedent(SOURCE)))
    assert one(res).status is status
    assert found in one(res).reason


class _EnvBool:
    """The few methods of SGLang's env field the patched code calls, over os.environ."""

    name = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"

    def __init__(self, environ):
        self.environ = environ

    def is_set(self):
        return self.name in self.environ

    def get(self):
        return self.environ.get(self.name, "false").lower() in ("1", "true")

    def set(self, value):
        self.environ[self.name] = str(value)


@pytest.fixture
def patched(run_patch, monkeypatch):
    """The patched fixture's eligible_group, with SGLang's is_sm120/is_full_nvlink and torch's
    device count stubbed: call it as `decide(env, arch, full_nvlink)`."""
    res = run_patch(PATCH, SOURCE)
    box = {"arch": (12, 0), "full": False, "asked": []}
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_sm120 = lambda: box["arch"] == (12, 0)
    car = types.ModuleType("sglang.srt.distributed.device_communicators.custom_all_reduce_utils")

    def is_full_nvlink(ids, world_size):
        box["asked"].append((ids, world_size))
        return box["full"]

    car.is_full_nvlink = is_full_nvlink
    environ_mod = types.ModuleType("sglang.srt.environ")
    for name, mod in [("sglang.srt.utils", utils), (car.__name__, car),
                      ("sglang.srt.environ", environ_mod)]:
        monkeypatch.setitem(sys.modules, name, mod)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device_count=lambda: 4))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def decide(env, arch=(12, 0), full=False, group="tp", world_size=4):
        environ = dict(env)
        environ_mod.envs = types.SimpleNamespace(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=_EnvBool(environ))
        box.update(arch=arch, full=full)
        namespace: dict[str, object] = {"__name__": "pcie_ipc_ar_under_test"}
        exec(compile(res.after, "pcie_ipc_ar.py", "exec"), namespace)
        got = namespace["eligible_group"](group_name=group, world_size=world_size,
                                          deterministic=False)
        return got, environ

    decide.box = box
    return decide


def test_unset_on_pcie_only_sm120_turns_it_on(patched):
    got, environ = patched({})
    assert got is True and environ == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "True"}
    assert patched.box["asked"] == [([0, 1, 2, 3], 4)]


@pytest.mark.parametrize("value", ["0", "false", "1"])
def test_explicit_setting_kept(patched, value):
    got, environ = patched({"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": value})
    assert got is (value == "1")
    assert environ == {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": value}
    assert patched.box["asked"] == []


@pytest.mark.parametrize(
    ("arch", "full", "group", "world_size"),
    [((10, 0), False, "tp", 4), ((9, 0), False, "tp", 4), ((12, 1), False, "tp", 4),
     ((12, 0), True, "tp", 8), ((12, 0), False, "moe_tp", 4), ((12, 0), False, "tp", 1)],
    ids=["sm100", "sm90", "sm121", "full-nvlink", "other-group", "one-gpu"],
)
def test_upstream_decides_elsewhere(patched, arch, full, group, world_size):
    got, environ = patched({}, arch=arch, full=full, group=group, world_size=world_size)
    assert got is False and environ == {}


def test_visible_devices_are_nvml_ids(patched, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert patched({})[0] is True
    assert patched.box["asked"] == [([4, 5, 6, 7], 4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b,GPU-3c4d")
    assert patched({})[0] is False
