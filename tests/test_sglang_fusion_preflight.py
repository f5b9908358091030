"""sglang.fusion-preflight on fixtures in the shape of SGLang 0.5.11 to 0.5.23 (written here,
a few lines, not upstream's file), and the wiring evidence the fusion patches declare."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Seen, Status, Wiring, wiring_evidence
from sm120patch.patchkit.runner import transform_text
from sm120patch.plan import catalog

PATCH = load_patch("sglang.fusion-preflight")

SIZES = """
def _flashinfer_trtllm_workspace_allocation_sizes(cuda_driver, prop, world_size):
    allocation_sizes = []
    for buffer_size in (1 << 21, 1 << 22):
        err, alloc_granularity = cuda_driver.cuMemGetAllocationGranularity(
            prop,
            cuda_driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
        if err != cuda_driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(
                "cuMemGetAllocationGranularity failed for FlashInfer "
                f"workspace preflight: {err}"
            )

        allocation_size = ceil_align(buffer_size + 2048, alloc_granularity)

        mc_prop = cuda_driver.CUmulticastObjectProp()
        mc_prop.numDevices = world_size
        err, mc_granularity = cuda_driver.cuMulticastGetGranularity(
            mc_prop,
            cuda_driver.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED,
        )
        if err != cuda_driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(
                "cuMulticastGetGranularity failed for FlashInfer "
                f"workspace preflight: {err}"
            )

        allocation_size = ceil_align(allocation_size, mc_granularity)
        allocation_sizes.append(allocation_size)
    return allocation_sizes
"""
RAISE = """            raise RuntimeError(
                "cuMulticastGetGranularity failed for FlashInfer "
                f"workspace preflight: {err}"
            )
"""
FALLBACK = (
    "            # sm120patch fusion: no multicast here (PCIe-only GPUs); FlashInfer allocates"
    " this\n"
    "            # workspace without multicast, so the allocation granularity alone sizes it.\n"
    "            mc_granularity = alloc_granularity\n"
)
AFTER = SIZES.replace(RAISE, FALLBACK)


def _one(res):
    assert len(res.outcomes) == 1
    return res.outcomes[0]


def test_applies_only_the_multicast_failure(run_patch):
    res = run_patch(PATCH, SIZES)
    assert _one(res).status is Status.APPLIED, _one(res).reason
    assert res.after == textwrap.dedent(AFTER)
    # The allocation-granularity check still raises, and the query is still asked.
    assert "cuMemGetAllocationGranularity failed" in res.after
    assert "cuMulticastGetGranularity(" in res.after


def test_second_run_is_already_applied(run_patch):
    first = run_patch(PATCH, SIZES)
    second = run_patch(PATCH, first.after)
    assert _one(second).status is Status.ALREADY_APPLIED
    assert second.after == first.after


def test_the_patched_function_sizes_without_multicast():
    """Run the patched text with a driver whose multicast query fails: sizes at the
    allocation granularity; with one that answers, the sizes are upstream's."""
    from sm120patch.patchkit.runner import transform_text

    patched = transform_text([PATCH], "f.py", SIZES).after

    def sizes(text, mc_ok):
        class Driver:
            class CUresult:
                CUDA_SUCCESS = 0

            class CUmemAllocationGranularity_flags:  # noqa: N801 (upstream's names)
                CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

            class CUmulticastGranularity_flags:  # noqa: N801
                CU_MULTICAST_GRANULARITY_RECOMMENDED = 1

            class CUmulticastObjectProp:
                pass

            @staticmethod
            def cuMemGetAllocationGranularity(prop, flag):  # noqa: N802
                return 0, 1 << 21

            @staticmethod
            def cuMulticastGetGranularity(prop, flag):  # noqa: N802
                return (0, 1 << 29) if mc_ok else (801, 0)

        scope = {"ceil_align": lambda x, a: (x + a - 1) // a * a}
        exec(compile(text, "f.py", "exec"), scope)
        return scope["_flashinfer_trtllm_workspace_allocation_sizes"](Driver, None, 2)

    with pytest.raises(RuntimeError, match="cuMulticastGetGranularity failed"):
        sizes(SIZES, mc_ok=False)
    assert sizes(patched, mc_ok=False) == [2 * (1 << 21), 3 * (1 << 21)]
    assert sizes(patched, mc_ok=True) == sizes(SIZES, mc_ok=True) == [1 << 29, 1 << 29]


def test_no_function_is_not_applicable(run_patch):
    text = "def _resolve_backend(backend):\n    return backend\n"
    res = run_patch(PATCH, text)
    assert _one(res).status is Status.NOT_APPLICABLE
    assert "`_flashinfer_trtllm_workspace_allocation_sizes`" in _one(res).reason  # the sieve's
    parsed = transform_text([PATCH], "fixture.py", text, sieve=False)
    assert _one(parsed).status is Status.NOT_APPLICABLE
    assert "0.5.11" in _one(parsed).reason  # the transform's own


def test_no_multicast_query_is_upstream(run_patch):
    """A release that sizes the workspace without the query (as PR 32330 did) needs nothing."""
    start = SIZES.index("        mc_prop = ")
    end = SIZES.index("        allocation_sizes.append")
    res = run_patch(PATCH, SIZES[:start] + SIZES[end:])
    assert _one(res).status is Status.UPSTREAM
    assert not res.changed


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (RAISE, "            return []\n", "`if err"),
        (
            "        if err != cuda_driver.CUresult.CUDA_SUCCESS:\n            raise RuntimeError(\n"
            '                "cuMulticast',
            '        if err:\n            raise RuntimeError(\n                "cuMulticast',
            "after the query",
        ),
        (
            "err, alloc_granularity = cuda_driver.cuMemGetAllocationGranularity(",
            "err, alloc_granularity = driver.cuMemGetAllocationGranularity(",
            "no cuMemGetAllocationGranularity before it",
        ),
    ],
)
def test_refuses_other_shapes(run_patch, old, new, why):
    src = SIZES.replace(old, new, 1)
    assert src != SIZES
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert why in _one(res).reason
    assert not res.changed


# ----------------------------------------------------------------------------- wiring

LOG_RAN = """\
[2026-11-30 10:00:01 TP0] Load weight end.
[2026-11-30 10:00:09 TP0] FlashInfer AllReduce Fusion enabled and workspace initialized: \
backend=trtllm, rank=0, world_size=2, max_token_num=2048, hidden_dim=6144
"""
LOG_SKIPPED = """\
[2026-11-30 10:00:09 TP1] FlashInfer workspace preflight probe failed \
(cuMulticastGetGranularity failed for FlashInfer workspace preflight: 801). \
Skipping allreduce fusion.
"""
LOG_OLD = "[TP0] FlashInfer workspace initialized for rank 0, world_size 2, backend trtllm\n"


def test_wiring_reads_ran_skipped_and_not_seen():
    cat = catalog.load()
    assert {p: e.seen for p, e in cat.wiring("fusion", LOG_RAN).items()} == {
        "sglang.fusion-gate": Seen.RAN,
        "sglang.fusion-preflight": Seen.RAN,
    }
    seen = cat.wiring("fusion", LOG_SKIPPED)["sglang.fusion-preflight"]
    assert seen.seen is Seen.SKIPPED and "Skipping allreduce fusion" in seen.line
    assert cat.wiring("fusion", LOG_OLD)["sglang.fusion-gate"].seen is Seen.RAN  # up to 0.5.13
    assert cat.wiring("fusion", "nothing about fusion\n")["sglang.fusion-gate"].seen is (
        Seen.NOT_SEEN
    )
    # A patch that declares no wiring says nothing; a profile without any says nothing.
    assert cat.wiring("moe", LOG_RAN) == {}
    assert cat.wiring("fusion", LOG_RAN)["sglang.fusion-gate"].to_dict()["seen"] == "ran"


def test_the_last_matching_line_decides():
    wiring = Wiring(ran=("up",), skipped=("down",))
    assert wiring.read("up\ndown\n").seen is Seen.SKIPPED
    assert wiring.read("down\nup\n").seen is Seen.RAN
    assert wiring.read("down\nup\n").line == "up"


def test_wiring_evidence_leaves_out_patches_without_wiring():
    patches = [load_patch("sglang.moe-backend"), load_patch("sglang.fusion-gate")]
    assert set(wiring_evidence(patches, LOG_RAN)) == {"sglang.fusion-gate"}


def test_a_bad_wiring_pattern_is_a_catalog_problem():
    assert Wiring(ran=("(",)).problems()[0].startswith("wiring: '(' is not a regular expression")
    assert Wiring(ran=()).problems() == ["wiring: no `ran` pattern"]
