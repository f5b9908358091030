"""Each vLLM behaviour check fails on a tree made wrong on purpose: a patched side that changes
nothing fails every SM120 check, and a patch that widens its SM120 test to SM100 fails the
off-SM120 control."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm_behave import RELEASES, Case, VllmBehaviour
from vllm_checks import (
    allreduce_problems,
    fusion_problems,
    fusion_table_problems,
    linear_problems,
    moe_problems,
    same_problems,
)

from sm120patch.maintain import sources

pytestmark = pytest.mark.behaviour

VERSION = RELEASES[-1]  # the newest pinned release: every patch has its site there
MOE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"


def test_a_patch_that_does_nothing_fails_every_sm120_check(vllm_behaviour: VllmBehaviour,
                                                           tmp_path: Path) -> None:
    pristine = vllm_behaviour.result(Case(VERSION, "pristine", "sm120"))
    patched = vllm_behaviour.result(Case(VERSION, "patched", "sm120"))
    assert moe_problems(pristine, patched) == []
    assert linear_problems(pristine, patched) == []
    # The patched side's overlay with every file's pristine text: it "applies" and changes
    # nothing.
    overlay = vllm_behaviour.overlay(VERSION)
    tree = sources.tree("vllm", VERSION)
    noop = {}
    for module in overlay:
        rel = Path(*module.split(".")).with_suffix(".py")
        if not (tree / rel).is_file():  # a package: kernels/linear/__init__.py
            rel = Path(*module.split("."), "__init__.py")
        copy = tmp_path / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes((tree / rel).read_bytes())
        noop[module] = str(copy)
    assert len(noop) >= 4  # nvfp4.py, kernels/linear, vllm.py, custom_all_reduce.py at least
    result = vllm_behaviour.run(Case(VERSION, "patched", "sm120"), overlay=noop)
    moe = moe_problems(pristine, result)
    assert any("patched SM120 w4a16:" in p and "MARLIN" in p for p in moe), moe
    assert any("patched SM120 w4a16-b12x:" in p and "MARLIN" in p for p in moe), moe
    linear = linear_problems(pristine, result)
    assert linear == [f"patched SM120 linear w4a4-b12x: {result['linear']['w4a4-b12x']}, "
                      "expected B12xNvFp4LinearKernel"], linear
    fusion = fusion_problems(pristine, result)
    assert any("patched SM120 fusion" in p for p in fusion), fusion
    tables = fusion_table_problems(pristine, result)
    assert any("patched SM120 fusion size at TP2" in p for p in tables), tables
    assert any("patched SM120 one-shot at 40 MiB" in p for p in tables), tables
    allreduce = allreduce_problems(pristine, result)
    assert any("patched SM120 custom allreduce on 4 GPUs" in p for p in allreduce), allreduce


def test_a_moe_patch_that_drops_marlin_for_sm100_fails_the_control(
        vllm_behaviour: VllmBehaviour, tmp_path: Path) -> None:
    pristine = vllm_behaviour.result(Case(VERSION, "pristine", "sm100"))
    patched = vllm_behaviour.result(Case(VERSION, "patched", "sm100"))
    assert same_problems(pristine, patched) == []
    # The MoE patch gone wrong twice: its test widened to "SM100 or newer", and B12X put in
    # MARLIN's place instead of before it. SM100 cannot run B12X (its own support check takes
    # the 12.x family only), so SM100 loses MARLIN: no backend left for W4A16 (0.34.0).
    overlay = dict(vllm_behaviour.overlay(VERSION))
    text = Path(overlay[MOE]).read_text(encoding="utf-8")
    text, widened = re.subn(r"current_platform\.is_device_capability\(120\)",
                            "current_platform.has_device_capability(100)", text)
    text, replaced = re.subn(
        r"AVAILABLE_BACKENDS\.insert\(\s*AVAILABLE_BACKENDS\.index\(NvFp4MoeBackend\.MARLIN\),"
        r"\s*NvFp4MoeBackend\.FLASHINFER_B12X,?\s*\)",
        "AVAILABLE_BACKENDS[AVAILABLE_BACKENDS.index(NvFp4MoeBackend.MARLIN)] = "
        "NvFp4MoeBackend.FLASHINFER_B12X", text)
    assert (widened, replaced) == (1, 1)
    wrong = tmp_path / "nvfp4.py"
    wrong.write_text(text, encoding="utf-8")
    overlay[MOE] = str(wrong)
    result = vllm_behaviour.run(Case(VERSION, "patched", "sm100"), overlay=overlay)
    assert result["moe"]["w4a16"].get("backend") != "MARLIN", result["moe"]
    problems = same_problems(pristine, result)
    assert any(p.startswith("moe:") for p in problems), problems


def test_a_moe_patch_without_b12x_fails_the_b12x_check(vllm_behaviour: VllmBehaviour,
                                                        tmp_path: Path) -> None:
    """The patch's previous form (FLASHINFER_B12X alone, no native B12X) on the newest release:
    with the b12x package installed it still picks FLASHINFER_B12X, and the check says so."""
    pristine = vllm_behaviour.result(Case(VERSION, "pristine", "sm120"))
    overlay = dict(vllm_behaviour.overlay(VERSION))
    text = Path(overlay[MOE]).read_text(encoding="utf-8")
    text, dropped = re.subn(
        r"AVAILABLE_BACKENDS\.insert\(\s*AVAILABLE_BACKENDS\.index\(NvFp4MoeBackend\.MARLIN\),"
        r"\s*NvFp4MoeBackend\.B12X,?\s*\)\n", "", text)
    assert dropped == 1
    wrong = tmp_path / "nvfp4.py"
    wrong.write_text(text, encoding="utf-8")
    overlay[MOE] = str(wrong)
    result = vllm_behaviour.run(Case(VERSION, "patched", "sm120"), overlay=overlay)
    problems = moe_problems(pristine, result)
    assert problems == [f"patched SM120 w4a16-b12x: {result['moe']['w4a16-b12x']}, "
                        "expected B12X"], problems
