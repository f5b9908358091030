"""vLLM's own selection code, pristine and patched (every vLLM profile), on every pinned
release, under simulated SM120, SM100 and SM90 (vllm_behave.py says what each case asks,
vllm_probe.py what is simulated and how)."""

from __future__ import annotations

import pytest
from vllm_behave import ARCHS, RELEASES, SIDES, Case, VllmBehaviour, vllm_profiles
from vllm_checks import (
    MARLIN,
    allreduce_problems,
    fusion_problems,
    fusion_table_problems,
    linear_problems,
    moe_problems,
    platform_problems,
    same_problems,
)

pytestmark = pytest.mark.behaviour


def get(b: VllmBehaviour, version: str, side: str, arch: str) -> dict:
    return b.result(Case(version, side, arch))


def test_the_vllm_profiles_are_the_four_under_test() -> None:
    assert vllm_profiles() == ["vllm-moe", "vllm-fp4-gemm", "vllm-pcie-allreduce",
                               "vllm-allreduce-fusion"]


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("arch", ARCHS)
def test_simulated_gpu_is_what_vllm_sees(vllm_behaviour: VllmBehaviour, version: str,
                                         arch: str) -> None:
    for side in SIDES:
        result = get(vllm_behaviour, version, side, arch)
        assert result["vllm"]["version"] == version
        assert platform_problems(result, arch) == [], side


@pytest.mark.parametrize("version", RELEASES)
def test_every_check_answers(vllm_behaviour: VllmBehaviour, version: str) -> None:
    """No check raised, on any side or GPU: an answer that is an error compares equal on both
    sides and would hide what the patch does."""
    for side in SIDES:
        for arch in ARCHS:
            result = get(vllm_behaviour, version, side, arch)
            for check in ("moe", "linear", "fusion", "fusion_tables", "allreduce"):
                for name, answer in result[check].items():
                    assert "error" not in answer, (side, arch, check, name, answer)


@pytest.mark.parametrize("version", RELEASES)
def test_moe_sm120_w4a16_picks_b12x_patched(vllm_behaviour: VllmBehaviour,
                                            version: str) -> None:
    """vllm.moe-b12x: W4A16 NVFP4 MoE on SM120 picks MARLIN pristine; patched, B12X with the
    b12x package and FLASHINFER_B12X without it (upstream's availability check falls
    through); neither with expert parallelism or an explicit --moe-backend."""
    pristine = get(vllm_behaviour, version, "pristine", "sm120")
    patched = get(vllm_behaviour, version, "patched", "sm120")
    assert moe_problems(pristine, patched) == []


@pytest.mark.parametrize("version", RELEASES)
def test_linear_sm120_w4a4_picks_b12x_patched(vllm_behaviour: VllmBehaviour,
                                              version: str) -> None:
    """vllm.fp4-gemm-b12x: a W4A4 NVFP4 linear layer on SM120 takes FlashInfer CUTLASS
    pristine; patched, B12xNvFp4LinearKernel with the b12x package and FlashInfer CUTLASS
    without it (upstream's availability check falls through); neither an explicit
    --linear-backend nor a W4A16 layer changes."""
    pristine = get(vllm_behaviour, version, "pristine", "sm120")
    patched = get(vllm_behaviour, version, "patched", "sm120")
    assert linear_problems(pristine, patched) == []


@pytest.mark.parametrize("version", RELEASES)
def test_fusion_sm120_tp2_on_patched(vllm_behaviour: VllmBehaviour, version: str) -> None:
    """vllm.allreduce-fusion-gate: vLLM's default for the all-reduce + RMSNorm fusion at TP 2
    is off on SM120 pristine, on patched."""
    pristine = get(vllm_behaviour, version, "pristine", "sm120")
    patched = get(vllm_behaviour, version, "patched", "sm120")
    assert fusion_problems(pristine, patched) == []


@pytest.mark.parametrize("version", RELEASES)
def test_fusion_size_tables_sm120_patched(vllm_behaviour: VllmBehaviour, version: str) -> None:
    """vllm.allreduce-fusion-size and -oneshot: on SM120 the pass gets a largest size at TP 2
    (none pristine: it turns itself off), still none at TP 4, and a 40 MiB tensor takes the
    two-shot kernel (one-shot pristine)."""
    pristine = get(vllm_behaviour, version, "pristine", "sm120")
    patched = get(vllm_behaviour, version, "patched", "sm120")
    assert fusion_table_problems(pristine, patched) == []


@pytest.mark.parametrize("version", RELEASES)
def test_custom_allreduce_on_four_pcie_gpus_patched(vllm_behaviour: VllmBehaviour,
                                                    version: str) -> None:
    """vllm.pcie-allreduce: on four PCIe-only SM120 GPUs pristine CustomAllreduce stops at its
    PCIe gate, patched goes on to the P2P check (and stops at the gate again with the off
    switch)."""
    pristine = get(vllm_behaviour, version, "pristine", "sm120")
    patched = get(vllm_behaviour, version, "patched", "sm120")
    assert allreduce_problems(pristine, patched) == []


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_patched_decides_as_pristine_off_sm120(vllm_behaviour: VllmBehaviour, version: str,
                                               arch: str) -> None:
    pristine = get(vllm_behaviour, version, "pristine", arch)
    patched = get(vllm_behaviour, version, "patched", arch)
    assert same_problems(pristine, patched) == []


@pytest.mark.parametrize("version", RELEASES)
def test_controls_off_sm120(vllm_behaviour: VllmBehaviour, version: str) -> None:
    """What upstream decides where the patches change nothing, so that "unchanged" above is
    about real answers: W4A16 NVFP4 MoE is MARLIN on SM100 and SM90 too, with the b12x package
    or without it (the FlashInfer backends there want NVFP4 activations), a W4A4 NVFP4 linear
    layer takes FlashInfer's CuTe-DSL kernel on SM100 and Marlin on SM90 with the b12x package
    stood in (B12X's own check takes the 12.x family only), the fusion is on at TP 2 (SM100 and SM90 are in
    vLLM's own gate), and NVLink-connected GPUs pass the PCIe gate."""
    for arch in ("sm100", "sm90"):
        result = get(vllm_behaviour, version, "pristine", arch)
        assert result["moe"]["w4a16"]["backend"] == MARLIN, arch
        assert result["moe"]["w4a16-b12x"]["backend"] == MARLIN, arch
        assert result["linear"]["w4a4-b12x"]["kernel"] == (
            "FlashInferCuteDslNvFp4LinearKernel" if arch == "sm100" else "MarlinNvFp4LinearKernel"
        ), arch
        assert result["fusion"]["tp2"]["enabled"] is True, arch
        assert result["allreduce"]["world4"]["reaches_p2p_check"] is True, arch
