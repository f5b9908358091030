"""vllm.pcie-allreduce on every pinned vLLM release, read from the release cache (the releases'
own .py files, `sources.tree`), beyond what test_sites.py runs on every patch (outcome, compile,
check, only-in, second run): the check fails a wrong change there, and what the profile's `known`
and the patch's `why` say of these releases (no "12.0" row in either size table, the custom
allreduce's table read only with SymmMem on, SymmMem off without multicast, the per-call gate
reading what the patch sets, FlashInfer's PCIe-IPC allreduce tried before the custom allreduce,
the log lines the wiring reads) still holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from patches_under_test import load_patch

from sm120patch.maintain import releases, sources
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
