"""vllm.fp4-gemm-b12x on a fixture in the shape of vLLM 0.30 to 0.34's NVFP4 linear selection
(written by us): the exact insertion and its second run, the refusals, the check, and the patched
walk run with a stand-in `current_platform`: B12X right before FlashInfer CUTLASS on exactly 12.0
with `--linear-backend auto`, FlashInfer CUTLASS where B12X says no (no b12x package), nothing
changed on 12.1, 10.0 or with an explicit backend."""

from __future__ import annotations

import ast
import sys
import types

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("vllm.fp4-gemm-b12x")

BEFORE = '''\
from vllm.platforms import PlatformEnum, current_platform

from .nvfp4 import (
    B12xNvFp4LinearKernel,
    EmulationNvFp4LinearKernel,
    FlashInferCutlassNvFp4LinearKernel,
    MarlinNvFp4LinearKernel,
)

# tried in this order
_POSSIBLE_NVFP4_KERNELS: dict[PlatformEnum, list[type]] = {
    PlatformEnum.CUDA: [
        FlashInferCutlassNvFp4LinearKernel,
        MarlinNvFp4LinearKernel,
        B12xNvFp4LinearKernel,
        EmulationNvFp4LinearKernel,
    ],
    PlatformEnum.ROCM: [EmulationNvFp4LinearKernel],
}


def _get_linear_backend(*, quantization):
    return BACKEND[0]


def init_nvfp4_linear_kernel(use_a16: bool = False):
    """Pick the NVFP4 linear kernel."""
    quantization = "nvfp4_w4a16" if use_a16 else "nvfp4_w4a4"
    linear_backend = _get_linear_backend(quantization=quantization)
    platform = current_platform._enum
    possible = list(_POSSIBLE_NVFP4_KERNELS.get(platform, []))
    if linear_backend != "auto":
        possible = [k for k in possible if k.backend == linear_backend] or possible
    for kernel in possible:
        if kernel.is_supported():
            return kernel
    raise ValueError("no NVFP4 kernel")
'''

INSERTED = '''\
    # sm120patch vllm.fp4-gemm-b12x: on SM120 (exactly 12.0) with --linear-backend auto, try
    # the native B12X dense GEMM (the b12x package; its own check says no where it is not
    # installed) right before FlashInfer's CUTLASS kernel.
    if (
        current_platform.is_device_capability(120)
        and linear_backend == "auto"
        and B12xNvFp4LinearKernel in possible
        and FlashInferCutlassNvFp4LinearKernel in possible
    ):
        possible.remove(B12xNvFp4LinearKernel)
        possible.insert(
            possible.index(FlashInferCutlassNvFp4LinearKernel), B12xNvFp4LinearKernel
        )
'''
ANCHOR = "    possible = list(_POSSIBLE_NVFP4_KERNELS.get(platform, []))\n"
AFTER = BEFORE.replace(ANCHOR, ANCHOR + INSERTED)


def one(res):
    [outcome] = res.outcomes
    return outcome


def test_exact_diff_and_already_applied(run_patch) -> None:
    res = run_patch(PATCH, BEFORE)
    assert one(res).status is Status.APPLIED, one(res).reason
    assert one(res).site == "init_nvfp4_linear_kernel"
    assert res.after == AFTER
    again = run_patch(PATCH, res.after)
    assert one(again).status is Status.ALREADY_APPLIED and again.after == res.after


def test_crlf_kept(run_patch) -> None:
    res = run_patch(PATCH, BEFORE.replace("\n", "\r\n"))
    assert one(res).status is Status.APPLIED
    assert res.after.count("\n") == res.after.count("\r\n")


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        (lambda s: s.replace(ANCHOR, "    possible = []\n"), Status.NOT_APPLICABLE,
         "no `possible = list("),
        (lambda s: s.replace("        B12xNvFp4LinearKernel,\n        Emulation",
                             "        Emulation"), Status.REFUSED, "listing"),
        (lambda s: s.replace("    linear_backend = _get_linear_backend(quantization=quantization)\n",
                             ""), Status.REFUSED, "no `linear_backend` assigned"),
        (lambda s: s.replace("PlatformEnum, current_platform", "PlatformEnum"), Status.REFUSED,
         "no import of current_platform"),
        (lambda s: s.replace("        FlashInferCutlassNvFp4LinearKernel,\n        Marlin",
                             "        B12xNvFp4LinearKernel,\n        FlashInferCutlassNvFp4Linear"
                             "Kernel,\n        Marlin").replace(
            "        B12xNvFp4LinearKernel,\n        Emulation", "        Emulation"),
         Status.UPSTREAM, "already lists B12xNvFp4LinearKernel before"),
    ],
    ids=["no-anchor", "b12x-not-listed", "no-linear-backend", "no-current-platform",
         "upstream-order"],
)
def test_outcomes_off_the_known_shape(run_patch, edit, status, found) -> None:
    res = run_patch(PATCH, edit(BEFORE))
    assert one(res).status is status and found in one(res).reason, one(res).describe()
    assert res.after == res.before


def test_a_hand_edited_insertion_refuses(run_patch) -> None:
    edited = AFTER.replace("is_device_capability(120)", "is_device_capability_family(120)")
    res = run_patch(PATCH, edited)
    assert one(res).status is Status.REFUSED and "edited" in one(res).reason, one(res).describe()


def test_the_check_accepts_the_patch_and_nothing_else() -> None:
    [fact] = PATCH.facts
    assert PATCH.check is not None
    PATCH.check(ast.parse(BEFORE), ast.parse(AFTER), fact)
    widened = AFTER.replace("is_device_capability(120)", "has_device_capability(120)")
    with pytest.raises(AssertionError):
        PATCH.check(ast.parse(BEFORE), ast.parse(widened), fact)
    reordered = AFTER.replace("        FlashInferCutlassNvFp4LinearKernel,\n        Marlin",
                              "        MarlinNvFp4LinearKernel,\n        FlashInferCutlass"
                              "NvFp4LinearKernel,\n        Marlin", 1)
    with pytest.raises(AssertionError):
        PATCH.check(ast.parse(BEFORE), ast.parse(reordered), fact)


def _walk(text: str, capability: int, *, backend: str = "auto", b12x: bool = True) -> str:
    """The fixture's selection run with a stand-in platform and kernels: the name of the kernel
    it takes. `b12x` False: B12X's own check says no, as without the b12x package."""

    def kernel(name: str, supported: bool, backend_name: str) -> type:
        return type(name, (), {"is_supported": staticmethod(lambda: supported),
                               "backend": backend_name})

    nvfp4 = types.ModuleType("fixture_pkg.nvfp4")
    nvfp4.B12xNvFp4LinearKernel = kernel("B12xNvFp4LinearKernel", b12x, "b12x")  # type: ignore[attr-defined]
    nvfp4.FlashInferCutlassNvFp4LinearKernel = kernel(  # type: ignore[attr-defined]
        "FlashInferCutlassNvFp4LinearKernel", True, "flashinfer_cutlass")
    nvfp4.MarlinNvFp4LinearKernel = kernel("MarlinNvFp4LinearKernel", True, "marlin")  # type: ignore[attr-defined]
    nvfp4.EmulationNvFp4LinearKernel = kernel("EmulationNvFp4LinearKernel", True, "emulation")  # type: ignore[attr-defined]
    platforms = types.ModuleType("vllm.platforms")
    platforms.PlatformEnum = types.SimpleNamespace(CUDA="cuda", ROCM="rocm")  # type: ignore[attr-defined]
    platforms.current_platform = types.SimpleNamespace(  # type: ignore[attr-defined]
        _enum="cuda", is_device_capability=lambda c: c == capability)
    saved = {n: sys.modules.get(n) for n in ("vllm", "vllm.platforms", "fixture_pkg",
                                             "fixture_pkg.nvfp4")}
    sys.modules.update({"vllm": types.ModuleType("vllm"), "vllm.platforms": platforms,
                        "fixture_pkg": types.ModuleType("fixture_pkg"),
                        "fixture_pkg.nvfp4": nvfp4})
    try:
        namespace: dict = {"__name__": "fixture_pkg.linear", "__package__": "fixture_pkg",
                           "BACKEND": [backend]}
        exec(compile(text, "<fixture>", "exec"), namespace)
        return str(namespace["init_nvfp4_linear_kernel"]().__name__)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_the_patched_walk() -> None:
    assert _walk(BEFORE, 120) == "FlashInferCutlassNvFp4LinearKernel"
    assert _walk(AFTER, 120) == "B12xNvFp4LinearKernel"
    # B12X's own check says no (no b12x package): FlashInfer CUTLASS, as released
    assert _walk(AFTER, 120, b12x=False) == "FlashInferCutlassNvFp4LinearKernel"
    for capability in (121, 100, 90):
        assert _walk(AFTER, capability) == _walk(BEFORE, capability)
    for backend in ("marlin", "flashinfer_cutlass"):
        assert _walk(AFTER, 120, backend=backend) == _walk(BEFORE, 120, backend=backend)


def test_facts_cover_the_pins_and_wiring_reads_the_log_line() -> None:
    from sm120patch.plan import catalog

    profile = catalog.load().profile("vllm-fp4-gemm")
    assert profile.patches == ("vllm.fp4-gemm-b12x",) and profile.status == "experimental"
    assert profile.flag == "--linear-backend b12x"
    for version in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"):
        assert len(PATCH.facts_at(version)) == 1, version
    assert PATCH.wiring is not None
    assert PATCH.wiring.read("INFO Using B12xNvFp4LinearKernel for NVFP4 GEMM").seen.value == "ran"
    skipped = "INFO Using FlashInferCutlassNvFp4LinearKernel for NVFP4 GEMM"
    assert PATCH.wiring.read(skipped).seen.value == "skipped"
    assert PATCH.wiring.read("nothing here").seen.value == "not-seen"
