"""The vLLM behaviour checks, as functions returning what is wrong (an empty list: all good), so
that a test can show each of them failing on a tree made wrong on purpose."""

from __future__ import annotations

import json
import re
from typing import Any

Result = dict[str, Any]

CAPABILITY = {"sm120": [12, 0], "sm100": [10, 0], "sm90": [9, 0]}
MARLIN = "MARLIN"
B12X = "B12X"
FI_B12X = "FLASHINFER_B12X"
PCIE_GATE = "not supported on more than two PCIe-only GPUs"
B12X_LINEAR = "B12xNvFp4LinearKernel"
CUTLASS_LINEAR = "FlashInferCutlassNvFp4LinearKernel"


def platform_problems(result: Result, arch: str) -> list[str]:
    """vLLM's own platform answers what was simulated: its CUDA platform (through NVML), the
    capability, and `is_device_capability` / `_family` from it."""
    p = result["platform"]
    want = CAPABILITY[arch]
    major = want[0]
    expected = {
        "class": "vllm.platforms.cuda.NvmlCudaPlatform",
        "is_cuda": True,
        "capability": want,
        "is_device_capability(120)": major == 12,
        "is_device_capability(100)": major == 10,
        "is_device_capability(90)": major == 9,
        "is_device_capability_family(120)": major == 12,
        "is_device_capability_family(100)": major == 10,
        "has_device_capability(100)": major >= 10,
    }
    return [f"platform {k}: {p.get(k)!r}, expected {v!r}" for k, v in expected.items()
            if p.get(k) != v]


def _backend(result: Result, name: str) -> str | None:
    return result["moe"].get(name, {}).get("backend")


def moe_problems(pristine: Result, patched: Result) -> list[str]:
    """SM120, W4A16 NVFP4 MoE: pristine picks MARLIN with or without the b12x package (B12X
    and FLASHINFER_B12X are only on request); patched picks B12X where the b12x package is
    installed and, without it, falls through to FLASHINFER_B12X (B12X's own availability check
    says no); with expert parallelism, or an explicit `--moe-backend`, the patched choice is
    pristine's and neither b12x backend."""
    problems = []
    for name in ("w4a16", "w4a16-b12x"):
        if _backend(pristine, name) != MARLIN:
            problems.append(f"pristine SM120 {name}: {pristine['moe'].get(name)}, "
                            f"expected {MARLIN}")
    if _backend(patched, "w4a16") != FI_B12X:
        problems.append(f"patched SM120 w4a16: {patched['moe'].get('w4a16')}, "
                        f"expected {FI_B12X} (no b12x package: B12X falls through)")
    if _backend(patched, "w4a16-b12x") != B12X:
        problems.append(f"patched SM120 w4a16-b12x: {patched['moe'].get('w4a16-b12x')}, "
                        f"expected {B12X}")
    for name in ("w4a16-ep", "w4a16-ep-b12x", "w4a16-b12x-explicit"):
        before, after = _backend(pristine, name), _backend(patched, name)
        if after is None or after in (B12X, FI_B12X) or after != before:
            problems.append(f"patched SM120 {name}: {patched['moe'].get(name)}, "
                            f"expected pristine's {before}")
    return problems


def _kernel(result: Result, name: str) -> str | None:
    return result["linear"].get(name, {}).get("kernel")


def linear_problems(pristine: Result, patched: Result) -> list[str]:
    """SM120, a W4A4 NVFP4 linear layer: pristine takes FlashInfer's CUTLASS kernel with or
    without the b12x package (B12X comes after Marlin); patched takes B12xNvFp4LinearKernel
    where the b12x package is installed and, without it, FlashInfer CUTLASS as released (B12X's
    own availability check says no); an explicit `--linear-backend` and a W4A16 layer get
    pristine's kernel, never B12X's."""
    problems = []
    for name in ("w4a4", "w4a4-b12x"):
        if _kernel(pristine, name) != CUTLASS_LINEAR:
            problems.append(f"pristine SM120 linear {name}: {pristine['linear'].get(name)}, "
                            f"expected {CUTLASS_LINEAR}")
    if _kernel(patched, "w4a4-b12x") != B12X_LINEAR:
        problems.append(f"patched SM120 linear w4a4-b12x: {patched['linear'].get('w4a4-b12x')}, "
                        f"expected {B12X_LINEAR}")
    if _kernel(patched, "w4a4") != CUTLASS_LINEAR:
        problems.append(f"patched SM120 linear w4a4: {patched['linear'].get('w4a4')}, expected "
                        f"{CUTLASS_LINEAR} (no b12x package: B12X falls through)")
    for name in ("w4a4-b12x-explicit", "w4a16-b12x"):
        before, after = _kernel(pristine, name), _kernel(patched, name)
        if after is None or after == B12X_LINEAR or after != before:
            problems.append(f"patched SM120 linear {name}: {patched['linear'].get(name)}, "
                            f"expected pristine's {before}")
    return problems


def fusion_problems(pristine: Result, patched: Result) -> list[str]:
    """SM120, TP 2: vLLM's default leaves the all-reduce + RMSNorm fusion off, patched on."""
    problems = []
    if pristine["fusion"].get("tp2", {}).get("enabled") is not False:
        problems.append(f"pristine SM120 fusion at TP2: {pristine['fusion'].get('tp2')}")
    if patched["fusion"].get("tp2", {}).get("enabled") is not True:
        problems.append(f"patched SM120 fusion at TP2: {patched['fusion'].get('tp2')}, "
                        "expected enabled")
    return problems


def fusion_table_problems(pristine: Result, patched: Result) -> list[str]:
    """SM120: vllm.allreduce-fusion-size gives the pass a largest size at TP 2 (pristine has
    none, so the pass turns itself off) and none at TP 4 (the patch adds TP 2 only);
    vllm.allreduce-fusion-oneshot sends a 40 MiB tensor at TP 2 to the two-shot kernel, which
    pristine sends one-shot (no row: one-shot at every size), and keeps 1 MiB one-shot."""
    problems = []
    before, after = pristine["fusion_tables"], patched["fusion_tables"]
    if before.get("tp2", {}).get("max_size") is not None:
        problems.append(f"pristine SM120 fusion size at TP2: {before.get('tp2')}, expected None")
    if not after.get("tp2", {}).get("max_size"):
        problems.append(f"patched SM120 fusion size at TP2: {after.get('tp2')}, expected a size")
    if after.get("tp4", {}).get("max_size") is not None:
        problems.append(f"patched SM120 fusion size at TP4: {after.get('tp4')}, expected None")
    if before.get("tp2", {}).get("oneshot_40MiB") is not True:
        problems.append(f"pristine SM120 one-shot at 40 MiB: {before.get('tp2')}, expected True")
    if after.get("tp2", {}).get("oneshot_40MiB") is not False:
        problems.append(f"patched SM120 one-shot at 40 MiB: {after.get('tp2')}, expected False")
    if after.get("tp2", {}).get("oneshot_1MiB") is not True:
        problems.append(f"patched SM120 one-shot at 1 MiB: {after.get('tp2')}, expected True")
    return problems


def _reaches(result: Result, name: str) -> bool | None:
    return result["allreduce"].get(name, {}).get("reaches_p2p_check")


def allreduce_problems(pristine: Result, patched: Result) -> list[str]:
    """SM120 (PCIe-only, no NVLink between the simulated GPUs): on 4 GPUs pristine's
    CustomAllreduce stops at the PCIe gate (its warning says so), patched goes on to the P2P
    check; on 2 GPUs both go on; SM120PATCH_PCIE_ALLREDUCE=0 gives pristine's answer back."""
    problems = []
    before = pristine["allreduce"].get("world4", {})
    if before.get("reaches_p2p_check") is not False or not any(
            PCIE_GATE in line for line in before.get("log", [])):
        problems.append(f"pristine SM120 custom allreduce on 4 GPUs: {before}")
    if _reaches(patched, "world4") is not True:
        problems.append(f"patched SM120 custom allreduce on 4 GPUs: "
                        f"{patched['allreduce'].get('world4')}, expected past the PCIe gate")
    for side, result in (("pristine", pristine), ("patched", patched)):
        if _reaches(result, "world2") is not True:
            problems.append(f"{side} SM120 custom allreduce on 2 GPUs: "
                            f"{result['allreduce'].get('world2')}")
    off = patched["allreduce"].get("world4-off", {})
    if off.get("reaches_p2p_check") is not False or not any(
            PCIE_GATE in line for line in off.get("log", [])):
        problems.append(f"patched SM120 with SM120PATCH_PCIE_ALLREDUCE=0: {off}")
    return problems


def sm120_problems(pristine: Result, patched: Result) -> list[str]:
    return (moe_problems(pristine, patched) + linear_problems(pristine, patched)
            + fusion_problems(pristine, patched)
            + fusion_table_problems(pristine, patched) + allreduce_problems(pristine, patched))


def same_problems(pristine: Result, patched: Result) -> list[str]:
    """Off SM120 the patched code decides exactly as the pristine code: every answer of every
    check, its log lines and the compiled operators it asked."""
    problems = []
    for key in ("platform", "moe", "linear", "fusion", "fusion_tables", "allreduce",
                "ops_called"):
        a, b = _unplaced(pristine.get(key)), _unplaced(patched.get(key))
        if a != b:
            problems.append(f"{key}: {pristine.get(key)} -> {patched.get(key)}")
    return problems


def _unplaced(value: Any) -> str:
    """`value` without the files its tracebacks name: an overlay's copy of a module is another
    path for the same code."""
    return re.sub(r'File \\"[^"\\]*\\", line \d+', "File <file>",
                  json.dumps(value, sort_keys=True))
