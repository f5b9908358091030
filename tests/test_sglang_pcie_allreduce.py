"""sglang.pcie-allreduce on fixtures in the shapes of the releases (before/after),
and the escape hatch: the patched gate run with and without SM120PATCH_PCIE_ALLREDUCE=0."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("sglang.pcie-allreduce")

# 0.5.10 to 0.5.23: custom_all_reduce_utils.py
FUNCTION = '''
import logging
import os

logger = logging.getLogger(__name__)


def can_use_custom_all_reduce_with_nvlink(group, world_size, cls_name):
    full_nvlink = is_full_nvlink(physical_device_ids, world_size)

    # test nvlink first, this will filter out most of the cases
    # where custom allreduce is not supported
    # this checks hardware and driver support for NVLink
    if world_size > 2 and not full_nvlink:
        logger.warning(
            f"{cls_name} is disabled because it's not supported on"
            " more than two PCIe-only GPUs."
        )
        return

    if not can_p2p(world_size):
        return
    return full_nvlink
'''

FUNCTION_AFTER = '''
import logging
import os

logger = logging.getLogger(__name__)


def can_use_custom_all_reduce_with_nvlink(group, world_size, cls_name):
    full_nvlink = is_full_nvlink(physical_device_ids, world_size)

    # test nvlink first, this will filter out most of the cases
    # where custom allreduce is not supported
    # this checks hardware and driver support for NVLink
    # sm120patch pcie-allreduce: PCIe-only GPUs keep the custom allreduce (as if fully
    # connected); SM120PATCH_PCIE_ALLREDUCE=0 restores upstream (NCCL). Trial only.
    if (
        world_size > 2
        and not full_nvlink
        and os.environ.get("SM120PATCH_PCIE_ALLREDUCE") != "0"
    ):
        full_nvlink = True
    if world_size > 2 and not full_nvlink:
        logger.warning(
            f"{cls_name} is disabled because it's not supported on"
            " more than two PCIe-only GPUs."
        )
        return

    if not can_p2p(world_size):
        return
    return full_nvlink
'''

# 0.4.6 to 0.5.9: custom_all_reduce.py, inside CustomAllreduce.__init__
METHOD = '''
import os


class CustomAllreduce:
    def __init__(self, group, device, max_size=8192 * 1024):
        world_size = dist.get_world_size(group=self.group)
        if _is_cuda or _is_hip:
            full_nvlink = is_full_nvlink(physical_device_ids, world_size)

        if world_size > 2 and not full_nvlink:
            logger.warning("Custom allreduce is disabled")
            return
        self.full_nvlink = full_nvlink
'''


def one(res):
    [outcome] = res.outcomes
    return outcome


def test_function_form_exact_diff(run_patch):
    res = run_patch(PATCH, FUNCTION)
    assert one(res).status is Status.APPLIED, one(res).reason
    assert one(res).site == "can_use_custom_all_reduce_with_nvlink"
    assert res.after == textwrap.dedent(FUNCTION_AFTER)
    again = run_patch(PATCH, res.after)
    assert one(again).status is Status.ALREADY_APPLIED and again.after == res.after


def test_method_form(run_patch):
    res = run_patch(PATCH, METHOD)
    assert one(res).status is Status.APPLIED, one(res).reason
    assert one(res).site == "CustomAllreduce.__init__"
    lines = res.after.splitlines()
    gate = lines.index("        if world_size > 2 and not full_nvlink:")
    assert lines[gate - 2:gate] == ["        ):", "            full_nvlink = True"]


def test_crlf_kept(run_patch):
    res = run_patch(PATCH, textwrap.dedent(FUNCTION).replace("\n", "\r\n"))
    assert one(res).status is Status.APPLIED
    assert res.after.count("\n") == res.after.count("\r\n")


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        (lambda s: s.replace("import os\n", ""), Status.REFUSED, "`import os` at module level"),
        (lambda s: s.replace("import os\n", "import os as _os\n"), Status.REFUSED, "import os"),
        (lambda s: s + "\n\ndef again(world_size):\n    if world_size > 2 and not full_nvlink:\n"
                       "        return\n", Status.REFUSED, "2 such statements"),
        (lambda s: s.replace("        return\n\n", "        pass\n\n"), Status.REFUSED,
         "ending in `return`"),
        (lambda s: s.replace("world_size > 2 and", "world_size > 4 and"), Status.NOT_APPLICABLE,
         "no `if world_size > 2 and not full_nvlink:`"),
        (lambda s: s.replace("if world_size > 2 and not full_nvlink:",
                             "if world_size > 2 and not full_nvlink and not "
                             "os.environ.get('SM120PATCH_PCIE_ALLREDUCE'):"),
         Status.NOT_APPLICABLE, "no `if"),
    ],
    ids=["no-os", "aliased-os", "two-gates", "no-return", "other-size", "hand-edited-gate"],
)
def test_refusals(run_patch, edit, status, found):
    res = run_patch(PATCH, edit(textwrap.dedent(FUNCTION)))
    assert one(res).status is status and found in one(res).reason, one(res).describe()
    assert res.after == res.before


def test_override_moved_away_from_the_gate_refuses(run_patch):
    applied = run_patch(PATCH, FUNCTION).after
    moved = applied.replace("    if world_size > 2 and not full_nvlink:\n",
                            "    x = 1\n    if world_size > 2 and not full_nvlink:\n")
    assert one(run_patch(PATCH, moved)).status is Status.REFUSED


@pytest.mark.parametrize(
    ("world_size", "nvlink", "env", "enabled"),
    [
        (4, False, None, True),  # the point of the patch: PCIe, 4 GPUs, custom allreduce on
        (4, False, "1", True),
        (4, False, "0", False),  # the escape hatch: upstream behaviour, NCCL
        (2, False, None, False),  # 2 GPUs: the gate never fired; p2p decides (stubbed: False)
        (8, True, "0", True),  # NVLink: as upstream
    ],
)
def test_escape_hatch_at_run_time(run_patch, monkeypatch, world_size, nvlink, env, enabled):
    """The patched function itself, executed: SM120PATCH_PCIE_ALLREDUCE=0 gives upstream."""
    patched = run_patch(PATCH, FUNCTION).after
    warnings: list[str] = []
    namespace = {
        "is_full_nvlink": lambda ids, n: nvlink,
        "physical_device_ids": list(range(world_size)),
        "can_p2p": lambda n: n > 2,  # P2P works on the multi-GPU box of this test
    }
    exec(compile(patched, "custom_all_reduce_utils.py", "exec"), namespace)
    namespace["logger"].warning = warnings.append
    if env is None:
        monkeypatch.delenv("SM120PATCH_PCIE_ALLREDUCE", raising=False)
    else:
        monkeypatch.setenv("SM120PATCH_PCIE_ALLREDUCE", env)
    result = namespace["can_use_custom_all_reduce_with_nvlink"](None, world_size, "CustomAllreduce")
    assert (result is not None) is enabled
    assert bool(warnings) is (world_size > 2 and not nvlink and env == "0")


def test_profile_is_trial_only_and_never_in_all():
    from sm120patch.plan import catalog

    cat = catalog.load()
    prof = cat.profile("pcie-allreduce")
    assert prof.status == "experimental" and prof.patches == ("sglang.pcie-allreduce",)
    assert all("sglang.pcie-allreduce" not in p.patches for n, p in cat.profiles.items()
               if n != "pcie-allreduce")
    assert "Trial only" in prof.known and "SM120PATCH_PCIE_ALLREDUCE=0" in prof.known
    assert "No public measurement" in prof.known and "hung" in prof.known
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in prof.known  # steps aside for upstream, 0.5.21 on
