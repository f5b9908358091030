"""vllm.pcie-allreduce on a fixture in the shape of vLLM 0.30.0 to 0.34.0 (before/after), its
refusals, and the escape hatch: the patched constructor and per-call gate run with and without
SM120PATCH_PCIE_ALLREDUCE=0."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("vllm.pcie-allreduce")

# custom_all_reduce.py's shape, 0.30.0 to 0.34.0: no `import os`; the init-time gate, the P2P
# check after it, and the per-call gate that reads self.fully_connected.
SOURCE = '''
import logging

logger = logging.getLogger(__name__)


class CustomAllreduce:
    def __init__(self, group, device, max_size=8192 * 1024):
        self.disabled = True
        same_node = all(in_the_same_node_as(group, source_rank=0))
        world_size = get_world_size(group)
        fully_connected = False
        if same_node:
            fully_connected = is_fully_connected(list(range(world_size)))
        if same_node and world_size > 2 and not fully_connected:
            logger.warning(
                "Custom allreduce is disabled because it's not supported on"
                " more than two PCIe-only GPUs."
            )
            return
        if same_node and not can_p2p(world_size):
            logger.warning("Custom allreduce is disabled because your platform lacks P2P")
            return
        self.disabled = False
        self.world_size = world_size
        self.max_size = max_size
        self.fully_connected = fully_connected

    def should_custom_ar(self, inp_size):
        if self.disabled or self.world_size > 8:
            return False
        # for 4 or more non NVLink-capable GPUs, custom allreduce provides
        # little performance improvement over NCCL.
        if self.world_size == 2 or self.fully_connected:
            return inp_size < self.max_size
        return False
'''

AFTER = SOURCE.replace(
    "        if same_node and world_size > 2 and not fully_connected:\n",
    "        # sm120patch pcie-allreduce: PCIe-only GPUs keep the custom allreduce (as if fully\n"
    "        # connected); SM120PATCH_PCIE_ALLREDUCE=0 restores upstream (PyNCCL). Trial only.\n"
    "        if (\n"
    "            same_node\n"
    "            and world_size > 2\n"
    "            and not fully_connected\n"
    '            and __import__("os").environ.get("SM120PATCH_PCIE_ALLREDUCE") != "0"\n'
    "        ):\n"
    "            fully_connected = True\n"
    "        if same_node and world_size > 2 and not fully_connected:\n",
)


def one(res):
    [outcome] = res.outcomes
    return outcome


def test_exact_diff_and_already_applied(run_patch):
    assert AFTER != SOURCE
    res = run_patch(PATCH, SOURCE)
    assert one(res).status is Status.APPLIED, one(res).reason
    assert one(res).site == "CustomAllreduce.__init__"
    assert res.after == textwrap.dedent(AFTER)
    again = run_patch(PATCH, res.after)
    assert one(again).status is Status.ALREADY_APPLIED and again.after == res.after


def test_crlf_kept(run_patch):
    res = run_patch(PATCH, textwrap.dedent(SOURCE).replace("\n", "\r\n"))
    assert one(res).status is Status.APPLIED
    assert res.after.count("\n") == res.after.count("\r\n")


def test_a_file_without_the_name_is_not_parsed(run_patch):
    res = run_patch(PATCH, "x = 1\n")
    assert one(res).status is Status.NOT_APPLICABLE and "fully_connected" in one(res).reason


GATE = "if same_node and world_size > 2 and not fully_connected:"


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        (lambda s: s + "\n\ndef again(same_node, world_size, fully_connected):\n"
                       f"    {GATE}\n        return\n", Status.REFUSED, "2 such statements"),
        (lambda s: s.replace("            return\n        if same_node and not",
                             "            pass\n        if same_node and not"),
         Status.REFUSED, "ending in `return`"),
        (lambda s: s.replace("world_size > 2 and not", "world_size > 4 and not"),
         Status.NOT_APPLICABLE, f"no `{GATE}`"),
        (lambda s: s.replace("same_node and world_size > 2", "world_size > 2"),
         Status.NOT_APPLICABLE, "no `if"),
        (lambda s: s.replace(GATE, "if same_node and world_size > 2 and not fully_connected "
                                   "and not __import__('os').environ.get("
                                   "'SM120PATCH_PCIE_ALLREDUCE'):"),
         Status.NOT_APPLICABLE, "no `if"),
        (lambda s: s.replace("class CustomAllreduce:", "class Other:"), Status.REFUSED,
         "in Other.__init__"),
        (lambda s: s.replace("logger = logging", "__import__ = None\nlogger = logging"),
         Status.REFUSED, "`__import__` left to the builtin"),
    ],
    ids=["two-gates", "no-return", "other-size", "no-same-node", "hand-edited-gate",
         "other-class", "import-rebound"],
)
def test_refusals(run_patch, edit, status, found):
    res = run_patch(PATCH, edit(textwrap.dedent(SOURCE)))
    assert one(res).status is status and found in one(res).reason, one(res).describe()
    assert res.after == res.before


def test_override_moved_away_from_the_gate_refuses(run_patch):
    applied = run_patch(PATCH, SOURCE).after
    moved = applied.replace(f"        {GATE}\n", f"        x = 1\n        {GATE}\n")
    res = run_patch(PATCH, moved)
    assert one(res).status is Status.REFUSED and "right before the gate" in one(res).reason


def _construct(text, monkeypatch, world_size, nvlink, p2p, env):
    warnings: list[str] = []
    namespace = {
        "in_the_same_node_as": lambda group, source_rank: [True] * world_size,
        "get_world_size": lambda group: world_size,
        "is_fully_connected": lambda ids: nvlink,
        "can_p2p": lambda n: p2p,
    }
    exec(compile(text, "custom_all_reduce.py", "exec"), namespace)
    namespace["logger"].warning = warnings.append
    if env is None:
        monkeypatch.delenv("SM120PATCH_PCIE_ALLREDUCE", raising=False)
    else:
        monkeypatch.setenv("SM120PATCH_PCIE_ALLREDUCE", env)
    return namespace["CustomAllreduce"](group=None, device=0), warnings


@pytest.mark.parametrize(
    ("world_size", "nvlink", "p2p", "env", "enabled"),
    [
        (4, False, True, None, True),  # the point of the patch: PCIe, 4 GPUs, custom allreduce on
        (4, False, True, "1", True),
        (8, False, True, None, True),
        (4, False, True, "0", False),  # the escape hatch: upstream behaviour, PyNCCL
        (4, False, False, None, False),  # the P2P check still turns it off (RTX 5090 boxes)
        (2, False, True, "0", True),  # 2 GPUs: the gate never fired, as upstream
        (8, True, True, "0", True),  # NVLink: as upstream
    ],
)
def test_escape_hatch_at_run_time(run_patch, monkeypatch, world_size, nvlink, p2p, env, enabled):
    """The patched constructor and per-call gate, executed: SM120PATCH_PCIE_ALLREDUCE=0 gives
    upstream's behaviour; anything else keeps the custom allreduce on and its messages below
    max_size taken by it, the P2P check still deciding."""
    patched = run_patch(PATCH, SOURCE).after
    ca, warnings = _construct(patched, monkeypatch, world_size, nvlink, p2p, env)
    assert ca.disabled is not enabled
    if enabled:
        assert ca.should_custom_ar(1024) and not ca.should_custom_ar(8192 * 1024)
        # what vLLM hands its kernels (ops.init_custom_ar): fully connected past two GPUs
        assert ca.fully_connected is (world_size > 2)
    pcie_warning = any("PCIe-only" in w for w in warnings)
    assert pcie_warning is (world_size > 2 and not nvlink and env == "0")
    pristine, _ = _construct(textwrap.dedent(SOURCE), monkeypatch, world_size, nvlink, p2p, env)
    if env == "0" or nvlink or world_size == 2:
        assert pristine.disabled == ca.disabled  # upstream's answer, whatever the patch
    else:
        assert pristine.disabled  # what the patch changes: upstream turns it off


def test_profile_is_trial_only_and_never_in_all():
    from sm120patch.plan import catalog

    cat = catalog.load()
    prof = cat.profile("vllm-pcie-allreduce")
    assert prof.status == "experimental" and prof.patches == ("vllm.pcie-allreduce",)
    assert str(prof.pins["vllm"]) in (">=0.30.0,<0.35", "<0.35,>=0.30.0")
    assert all("vllm.pcie-allreduce" not in p.patches for n, p in cat.profiles.items()
               if n != "vllm-pcie-allreduce")
    assert "Trial only" in prof.known and "SM120PATCH_PCIE_ALLREDUCE=0" in prof.known
    assert "https://github.com/vllm-project/vllm/issues/56128" in prof.known
    assert "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1" in prof.known


def test_wiring_reads_vllm_own_lines():
    """The lines of vLLM's logger calls (custom_all_reduce.py, cuda_communicator.py), as a
    rank prints them."""
    wiring = PATCH.wiring
    assert wiring is not None and not wiring.problems()
    kept = ("INFO 12-03 19:00:00 [cuda_communicator.py:380] Using ['CUSTOM', 'PYNCCL'] "
            "all-reduce backends (in dispatch order) for group 'tp:0' out of potential "
            "backends: ['FLASHINFER_PCIE_IPC', 'FLASHINFER', 'NCCL_SYMM_MEM', 'QUICK_REDUCE', "
            "'AITER_CUSTOM', 'CUSTOM', 'SYMM_MEM', 'PYNCCL'].")
    off = ("(Worker_TP1 pid=7) WARNING 12-03 19:00:00 [custom_all_reduce.py:268] Custom "
           "allreduce is disabled because it's not supported on more than two PCIe-only GPUs. "
           "To silence this warning, specify disable_custom_all_reduce=True explicitly.")
    pynccl = kept.replace("'CUSTOM', 'PYNCCL'] all", "'PYNCCL'] all")
    assert wiring.read(kept).seen.value == "ran"
    assert wiring.read(f"{off}\n{pynccl}").seen.value == "skipped"
    assert wiring.read(pynccl).seen.value == "not-seen"
    assert wiring.read(kept.replace("'tp:0'", "'ep:0'")).seen.value == "not-seen"


# ----------------------------------------------------------------------------- its check

CHECK_FACT = PATCH.facts[0]


def _check(after: str) -> None:
    import ast

    from sm120patch.patchkit import sitecheck

    before = textwrap.dedent(SOURCE)
    assert PATCH.check is not None
    spans = PATCH.check(ast.parse(before), ast.parse(after), CHECK_FACT)
    sitecheck.only_in(before, after, spans)


def test_the_check_passes_what_the_patch_writes():
    _check(textwrap.dedent(AFTER))


@pytest.mark.parametrize(
    ("wrong", "said"),
    [
        ('!= "0"', '== "0"'),  # the switch inverted
        ("fully_connected = True\n        if", "fully_connected = 1\n        if"),
        ("            return\n        if same_node and not",  # the gate no longer returns
         "            pass\n        if same_node and not"),
        ("max_size=8192 * 1024", "max_size=16384 * 1024"),  # a change beside the site
    ],
)
def test_the_check_fails_a_wrong_change(wrong, said):
    after = textwrap.dedent(AFTER)
    assert wrong in after
    with pytest.raises(AssertionError):
        _check(after.replace(wrong, said, 1))
