"""Upstream's own code, pristine and patched, under simulated SM120, SM100 and SM90."""

from __future__ import annotations

import pytest
from behave import ARCHS, Behaviour, Case
from checks import (
    MOE_MODELS,
    args_of,
    comm_problems,
    control_problems,
    has_preflight,
    moe_launch,
    preflight_problems,
    same_problems,
    sm120_problems,
)

from sm120patch.patchkit.model import Status

pytestmark = pytest.mark.behaviour

EXPECTED = {
    "sm120": {"is_sm120_supported": True, "is_sm100_supported": False, "is_sm90_supported": False},
    "sm100": {"is_sm120_supported": False, "is_sm100_supported": True, "is_sm90_supported": False},
    "sm90": {"is_sm120_supported": False, "is_sm100_supported": False, "is_sm90_supported": True},
}


def get(b: Behaviour, version: str, side: str, arch: str, kind: str = "sglang") -> dict:
    return b.result(Case(kind, version, side, arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_simulated_gpu_is_what_upstream_sees(behaviour: Behaviour, sglang_version: str,
                                             arch: str) -> None:
    for side in ("pristine", "patched"):
        seen = get(behaviour, sglang_version, side, arch)["predicates"]
        for name, want in EXPECTED[arch].items():
            assert seen[name] is want, (side, name, seen)
            platform = f"get_platform().{name.removesuffix('_supported')}"
            if platform in seen:
                assert seen[platform] is want, (side, platform, seen)


def test_every_launch_resolves(behaviour: Behaviour, sglang_version: str) -> None:
    """The MoE launches resolve on every side and GPU (a fusion architecture that this
    release's transformers cannot read is left out of the fusion checks instead)."""
    for side in ("pristine", "patched"):
        for arch in ARCHS:
            result = get(behaviour, sglang_version, side, arch)
            for name, run in result["launches"].items():
                if name.startswith("moe-"):
                    assert "error" not in run, (side, arch, name, run)


def moe_patch_of(model: str) -> str:
    """The moe profile's patch for one of MOE_MODELS (the one whose marker is the model)."""
    from sm120patch.plan import catalog

    cat = catalog.load()
    return next(p for p in cat.profile("moe").patches if cat.patches[p].marker == model)


def moe_models(version: str) -> tuple[str, ...]:
    """The MoE models whose patch applies on `version` (its facts say so)."""
    from sm120patch.plan import catalog

    patches = catalog.load().patches
    return tuple(m for m in MOE_MODELS
                 if any(f.status is Status.APPLIED for f in patches[moe_patch_of(m)].facts_at(version)))


def test_every_moe_model_has_its_patch_in_the_profile() -> None:
    assert [moe_patch_of(m) for m in MOE_MODELS] == [
        "sglang.moe-backend", "sglang.moe-backend-qwen3", "sglang.moe-backend-minimax"]
    assert moe_models("0.5.14") == ("Glm4MoeForCausalLM", "Qwen3MoeForCausalLM")
    assert moe_models("0.5.23") == tuple(MOE_MODELS)


def test_pristine_sm120_does_not_take_the_sm120_path(behaviour: Behaviour,
                                                     sglang_version: str) -> None:
    pristine = get(behaviour, sglang_version, "pristine", "sm120")
    sm100 = get(behaviour, sglang_version, "pristine", "sm100")
    assert control_problems(pristine, sm100, moe_models(sglang_version)) == []


def test_patched_sm120_takes_the_sm120_path(behaviour: Behaviour, sglang_version: str) -> None:
    """GLM-4 MoE, the Qwen3 MoE family (Qwen3MoeForCausalLM) and MiniMax-M2 NVFP4 from the
    checkpoint's config pick flashinfer_cutlass, each where its patch applies; bf16 and FP8
    keep upstream's choice, and only the MoE runner (and fusion) fields change."""
    pristine = get(behaviour, sglang_version, "pristine", "sm120")
    patched = get(behaviour, sglang_version, "patched", "sm120")
    sm100 = get(behaviour, sglang_version, "pristine", "sm100")
    assert sm120_problems(pristine, patched, sm100, moe_models(sglang_version)) == []


def test_sm100_picks_trtllm_where_the_moe_patches_copy_it(behaviour: Behaviour,
                                                          sglang_version: str) -> None:
    """What each MoE patch twins: on SM100 upstream picks a TRT-LLM-gen backend for the model's
    NVFP4 checkpoint (flashinfer_trtllm, MiniMax-M2's flashinfer_trtllm_routed)."""
    sm100 = get(behaviour, sglang_version, "pristine", "sm100")
    for model in moe_models(sglang_version):
        args = args_of(sm100, moe_launch(model, "nvfp4-config"))
        assert args is not None and args["moe_runner_backend"].startswith("flashinfer_trtllm"), (
            model, args and args["moe_runner_backend"])


def test_patched_preflight_proceeds_without_multicast(behaviour: Behaviour,
                                                     sglang_version: str) -> None:
    """From 0.5.11 the workspace preflight asks the driver for multicast granularity: with a
    driver binding whose query fails (PCIe-only SM120), pristine skips fusion on every rank,
    patched goes on to create the workspace. Before 0.5.11 there is no preflight."""
    from packaging.version import Version

    pristine = get(behaviour, sglang_version, "pristine", "sm120")
    patched = get(behaviour, sglang_version, "patched", "sm120")
    assert has_preflight(pristine) is (Version(sglang_version) >= Version("0.5.11"))
    if not has_preflight(pristine):
        assert patched["preflight"] == pristine["preflight"]
        return
    assert preflight_problems(pristine, patched) == []


def test_preflight_checks_can_fail(behaviour: Behaviour) -> None:
    """The check fails on the pristine code taken as the patched side."""
    pristine = get(behaviour, "0.5.23", "pristine", "sm120")
    assert preflight_problems(pristine, pristine) != []


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_patched_decides_as_pristine_off_sm120(behaviour: Behaviour, sglang_version: str,
                                               arch: str) -> None:
    pristine = get(behaviour, sglang_version, "pristine", arch)
    patched = get(behaviour, sglang_version, "patched", arch)
    assert same_problems(pristine, patched) == []


def test_upstream_flag_path_is_known(behaviour: Behaviour, sglang_version: str) -> None:
    """Where pristine SM120 already picks flashinfer_cutlass for `--quantization modelopt_fp4`
    (from 0.5.13), the plan's MoE outcome says so; before, it does not pick it."""
    from packaging.version import Version

    from sm120patch.explain import explain

    for model in moe_models(sglang_version):
        pristine = get(behaviour, sglang_version, "pristine", "sm120")
        args = args_of(pristine, moe_launch(model, "nvfp4-flag"))
        upstream_picks = args is not None and args["moe_runner_backend"] == "flashinfer_cutlass"
        assert upstream_picks is (Version(sglang_version) >= Version("0.5.13")), model
        note = _moe_note(behaviour, sglang_version, moe_patch_of(model))
        assert bool(note) is upstream_picks, (model, note)
    del explain


def _moe_note(behaviour: Behaviour, version: str, patch_id: str) -> str:
    from sm120patch.plan import catalog
    from sm120patch.plan.planner import plan_target

    cat = catalog.load()
    profile = cat.profile("moe")
    planned = plan_target(profile, cat.patches_of(profile), behaviour.target("sglang", version))
    outcome = next(o for f in planned.files for o in f.outcomes if o.patch == patch_id)
    return getattr(outcome, "note", "") or ""


def test_flashinfer_comm_module_builds_for_sm120(behaviour: Behaviour,
                                                 flashinfer_version: str) -> None:
    """Before 0.6.17 the pristine module raises for an SM120-only target and the patched one
    builds for compute_120; from 0.6.17 upstream lists 12 itself and the patch changes nothing."""
    from packaging.version import Version

    pristine = get(behaviour, flashinfer_version, "pristine", "sm120", "flashinfer")
    patched = get(behaviour, flashinfer_version, "patched", "sm120", "flashinfer")
    if Version(Version(flashinfer_version).base_version) < Version("0.6.17"):
        assert comm_problems(pristine, patched) == []
    else:
        assert any(a.startswith("compute_120") for a in pristine["comm_arch"]["archs"])
        assert same_problems(pristine, patched) == []


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_flashinfer_off_sm120_unchanged(behaviour: Behaviour, flashinfer_version: str,
                                        arch: str) -> None:
    pristine = get(behaviour, flashinfer_version, "pristine", arch, "flashinfer")
    patched = get(behaviour, flashinfer_version, "patched", arch, "flashinfer")
    assert "error" not in pristine["comm_arch"], pristine["comm_arch"]
    assert same_problems(pristine, patched) == []
