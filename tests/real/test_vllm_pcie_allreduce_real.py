"""vllm.pcie-allreduce on every pinned vLLM release, read from the release cache (the releases'
own .py files, `sources.tree`): the outcome its fact gives, the patched file compiles, the
patch's own `check` passes and bounds the diff, a second run changes nothing; and what the
profile's `known` says of these releases (no "12.0" row in either size table, the size table
read only with SymmMem on, SymmMem off without multicast, FlashInfer's PCIe-IPC allreduce tried
before the custom allreduce) still holds.

vLLM is not yet one of the kinds the generic real tier (test_sites.py) walks, hence this file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from patches_under_test import load_patch

from sm120patch.maintain import releases, sources
from sm120patch.patchkit import sitecheck
from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text

pytestmark = pytest.mark.real

PATCH = load_patch("vllm.pcie-allreduce")
PINNED = releases.DEFAULT_RELEASES["vllm"]
COMMS = "vllm/distributed/device_communicators"


@pytest.fixture(scope="module", params=PINNED)
def tree(request: pytest.FixtureRequest) -> tuple[str, Path]:
    try:
        return request.param, sources.tree("vllm", request.param)
    except Exception as exc:  # offline and not cached: say so, as the real tier does
        pytest.skip(f"vLLM {request.param} is not in the release cache ({exc})")


def test_pins_are_the_pinned_releases() -> None:
    from sm120patch.plan import catalog

    pins = catalog.load().profile("vllm-pcie-allreduce").pins["vllm"]
    assert [v for v in PINNED if pins.contains(v)] == list(PINNED)


def test_patch_on_release(tree: tuple[str, Path]) -> None:
    version, root = tree
    [fact] = PATCH.facts_at(version)
    rel = PATCH.pick_file(lambda r: (root / r).read_text("utf-8") if (root / r).is_file() else None)
    assert rel == fact.file
    before = (root / rel).read_text("utf-8")
    res = transform_text([PATCH], rel, before)
    [outcome] = res.outcomes
    assert outcome.status is fact.status is Status.APPLIED, outcome.describe()
    assert outcome.site == fact.function
    compile(res.after, rel, "exec", dont_inherit=True)
    assert PATCH.check is not None
    spans = PATCH.check(ast.parse(before), ast.parse(res.after), fact)
    sitecheck.only_in(before, res.after, spans)
    [again] = transform_text([PATCH], rel, res.after).outcomes
    assert again.status is Status.ALREADY_APPLIED, again.describe()


def test_check_fails_a_wrong_change(tree: tuple[str, Path]) -> None:
    """The check is an oracle: the patched text with the variable's test flipped fails it."""
    version, root = tree
    [fact] = PATCH.facts_at(version)
    before = (root / fact.file).read_text("utf-8")
    after = transform_text([PATCH], fact.file, before).after
    wrong = after.replace('!= "0"', '== "0"', 1)
    assert wrong != after
    assert PATCH.check is not None
    with pytest.raises(AssertionError, match="before the gate"):
        PATCH.check(ast.parse(before), ast.parse(wrong), fact)


def test_what_the_profile_says_of_the_release(tree: tuple[str, Path]) -> None:
    version, root = tree
    utils = (root / COMMS / "all_reduce_utils.py").read_text("utf-8")
    custom = (root / COMMS / "custom_all_reduce.py").read_text("utf-8")
    symm = (root / COMMS / "symm_mem.py").read_text("utf-8")
    comm = (root / COMMS / "cuda_communicator.py").read_text("utf-8")
    tables = {  # each size table's keys
        node.targets[0].id: {ast.literal_eval(k) for k in node.value.keys if k is not None}
        for node in ast.parse(utils).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.endswith("ALL_REDUCE_MAX_SIZES") and isinstance(node.value, ast.Dict)
    }  # fmt: skip
    for name in ("CUSTOM_ALL_REDUCE_MAX_SIZES", "SYMM_MEM_ALL_REDUCE_MAX_SIZES"):
        assert "9.0" in tables[name] and "12.0" not in tables[name], (version, name)
    # The custom allreduce reads its size table only with SymmMem on, a missing key left alone.
    assert "and symm_mem_enabled" in custom
    assert "device_capability_str in CUSTOM_ALL_REDUCE_MAX_SIZES" in custom
    assert "max_size=8192 * 1024," in custom
    # SymmMem turns itself off without a multicast pointer, whatever the table.
    assert "if handle.multicast_ptr == 0:" in symm
    assert "SYMM_MEM_ALL_REDUCE_MAX_SIZES[self.device_capability]" in symm
    # The per-call gate reads what the patch sets.
    assert "if self.world_size == 2 or self.fully_connected:" in custom
    assert "self.fully_connected = fully_connected" in custom
    # FlashInfer's PCIe-IPC allreduce is tried before the custom allreduce (no shadowing).
    ipc = comm.index("fi_pcie_ipc_ar_comm.should_use(input_)")
    assert ipc < comm.index("ca_comm.should_custom_ar(input_)")
    # The log lines the wiring reads.
    assert "Using %s all-reduce backends (in dispatch order) for group " in comm
    assert '"Custom allreduce is disabled because it\'s not supported on"' in custom
