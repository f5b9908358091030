"""sglang.moe-backend-minimax: flashinfer_cutlass as the MoE runner of MiniMax-M2 on SM120 for
a checkpoint whose config says NVFP4 (site D, as for GLM-4 MoE)."""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import moe
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Result, Status
from sm120patch.patchkit.moe import (
    FLAG_NOTE,
    IN_MODEL_OVERRIDES,
    IN_OVERRIDES,
    config_branch,
)

MODEL = "MiniMaxM2ForCausalLM"
OVERRIDES_FUNC = "_minimax_m2_overrides"
ABSENT = "upstream picks no MoE runner backend for MiniMaxM2ForCausalLM on any GPU here"


def transform(module: cst.Module) -> Result:
    return moe.add_sm120_choice(module, MODEL, OVERRIDES_FUNC, BRANCHES, absent=ABSENT)


OVERRIDES = "sglang/srt/arg_groups/overrides.py"
MINIMAX_M2 = "sglang/srt/arg_groups/model_overrides/minimax_m2.py"
CHOICE = ('`if <sm100> and moe_runner_backend == "auto" and <model config>.quantization == '
          '"modelopt_fp4":` overrides["moe_runner_backend"] = "flashinfer_trtllm_routed"')
FACTS = (
    Fact(releases="<0.5.15", status=Status.NOT_APPLICABLE,
         shape="no MiniMaxM2ForCausalLM override"),
    Fact(releases=">=0.5.15,<0.5.18", status=Status.NOT_APPLICABLE,
         shape=f"{OVERRIDES_FUNC} only enables TF32 "
         "matmul", file=OVERRIDES, function=OVERRIDES_FUNC),
    Fact(releases=">=0.5.18,<0.5.19", status=Status.APPLIED,
         shape=f"{CHOICE}, `is_sm100_supported()` and "
         "`server_args.get_model_config()`", file=OVERRIDES, function=OVERRIDES_FUNC, form="utils",
         user_note=FLAG_NOTE),
    Fact(releases=">=0.5.19,<0.5.24", status=Status.APPLIED,
         shape=f"{CHOICE}, `get_platform().is_sm100` and "
         "`model_config_of(server_args)`", file=MINIMAX_M2, function=OVERRIDES_FUNC,
         form="platform", user_note=FLAG_NOTE),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right after the model's unchanged SM100 branch, an SM120 branch setting the MoE runner
    backend to flashinfer_cutlass for modelopt_fp4 on `auto` alone, logged, writing no
    quantization field (`sitecheck.moe_choice`)."""
    return sc.moe_choice(before, after, fact, MODEL)


PATCH = Patch(
    id="sglang.moe-backend-minimax",
    check=check,
    target="sglang",
    title="Choose flashinfer_cutlass as the MoE runner for MiniMax-M2 NVFP4 on SM120",
    why=(
        "For MiniMaxM2ForCausalLM with a modelopt_fp4 model config SGLang picks a MoE runner "
        "backend only on SM100 (flashinfer_trtllm_routed, whose TRT-LLM-gen kernels do not "
        "run on SM120, from 0.5.18); on SM120 the backend stays 'auto'. Upstream picks "
        "flashinfer_cutlass on SM120 for modelopt_fp4 given with --quantization, but not for "
        "a checkpoint whose config says NVFP4. The patch adds the SM120 twin of that `if` "
        "right after it, in the release's own form: the same conditions with the arch "
        "changed, flashinfer_cutlass, logged in upstream's words."
    ),
    marker=MODEL,
    facts=FACTS,
    transform=transform,
)


# The SM120 branch put right after each form of upstream's SM100 branch (`moe.Branch`), named
# by the releases that ship that form, which is known by its fingerprint (`moe.fingerprint`):
# the family's template (`moe.config_branch`) in that release's spelling.
BRANCHES = (
    config_branch("SGLang 0.5.18", ("3026fbca7db7c654",), IN_OVERRIDES, model=MODEL),
    config_branch("SGLang 0.5.19 to 0.5.23", ("6e1f2858cd5077c0",), IN_MODEL_OVERRIDES,
                  model=MODEL),
)
