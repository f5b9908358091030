"""sglang.moe-backend-qwen3: flashinfer_cutlass as the MoE runner of the Qwen3 MoE family on
SM120 for a checkpoint whose config says NVFP4 (site D, as for GLM-4 MoE)."""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import moe
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Result, Status
from sm120patch.patchkit.moe import (
    FLAG_NOTE,
    IN_METHOD,
    IN_METHOD_UNSET,
    IN_MODEL_OVERRIDES,
    IN_OVERRIDES,
    derived_branch,
)

MODEL = "Qwen3MoeForCausalLM"
OVERRIDES_FUNC = "_qwen3_moe_family_overrides"


def transform(module: cst.Module) -> Result:
    return moe.add_sm120_choice(module, MODEL, OVERRIDES_FUNC, BRANCHES)


SERVER_ARGS = "sglang/srt/server_args.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
QWEN3_MOE = "sglang/srt/arg_groups/model_overrides/qwen3_moe.py"
HANDLER = "ServerArgs._handle_model_specific_adjustments"
FACTS = (
    Fact(releases="<0.5.6", status=Status.NOT_APPLICABLE,
         shape="no Qwen3MoeForCausalLM MoE branch"),
    Fact(releases=">=0.5.6,<0.5.8", status=Status.APPLIED,
         shape='`elif model_arch in ["Qwen3MoeForCausalLM", '
         '"Qwen3VLMoeForConditionalGeneration"]:` `if is_sm100_supported():` derives the '
         'quantization, then `self.quantization in ("fp8", "modelopt_fp4")` ... '
         "flashinfer_trtllm", file=SERVER_ARGS, function=HANDLER, form="utils"),
    Fact(releases=">=0.5.8,<0.5.13", status=Status.APPLIED,
         shape='same, `(self.quantization in ("fp8", '
         '"modelopt_fp4") or self.quantization is None)`; from 0.5.10 more Qwen3 architectures '
         "in the list", file=SERVER_ARGS, function=HANDLER, form="utils"),
    Fact(releases=">=0.5.13,<0.5.15", status=Status.APPLIED,
         shape="same; upstream picks flashinfer_cutlass on SM120 "
         "for --quantization modelopt_fp4", file=SERVER_ARGS, function=HANDLER, form="utils",
         user_note=FLAG_NOTE),
    Fact(releases=">=0.5.15,<0.5.19", status=Status.APPLIED,
         shape=f"{OVERRIDES_FUNC}: `if is_sm100_supported():` "
         '... overrides["moe_runner_backend"] = "flashinfer_trtllm"', file=OVERRIDES,
         function=OVERRIDES_FUNC, form="utils",
         note="server_args.py keeps an empty branch pointing at overrides.py", user_note=FLAG_NOTE),
    Fact(releases="==0.5.19", status=Status.APPLIED, shape="`if get_platform().is_sm100:`",
         file=QWEN3_MOE, function=OVERRIDES_FUNC, form="platform", user_note=FLAG_NOTE),
    Fact(releases=">=0.5.20,<0.5.24", status=Status.APPLIED,
         shape="`if get_platform().is_sm100:` ... `if "
         "has_w4a16_moe_layers:` (marlin) `elif ...:` flashinfer_trtllm; the W4A16 branch is "
         "left out of the SM120 one", file=QWEN3_MOE, function=OVERRIDES_FUNC, form="platform",
         user_note=FLAG_NOTE),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right after the model's unchanged SM100 branch, an SM120 branch setting the MoE runner
    backend to flashinfer_cutlass for modelopt_fp4 on `auto` alone, logged, writing no
    quantization field (`sitecheck.moe_choice`)."""
    return sc.moe_choice(before, after, fact, MODEL)


PATCH = Patch(
    id="sglang.moe-backend-qwen3",
    check=check,
    target="sglang",
    title="Choose flashinfer_cutlass as the MoE runner for Qwen3 MoE NVFP4 on SM120",
    why=(
        "For the Qwen3 MoE family (Qwen3MoeForCausalLM and the other architectures of "
        "upstream's list: Qwen3-VL MoE, Qwen3-Next, Qwen3.5 MoE...) SGLang picks a MoE runner "
        "backend only on SM100 (flashinfer_trtllm, whose TRT-LLM-gen kernels do not run on "
        "SM120); on SM120 the backend stays 'auto'. From 0.5.13 upstream picks "
        "flashinfer_cutlass on SM120 for modelopt_fp4 given with --quantization, but not "
        "for a checkpoint whose config says NVFP4. The patch adds an SM120 branch right after "
        "the SM100 one, written for it as sglang.moe-backend's is for GLM-4 MoE: the "
        "quantization read from the checkpoint's config into a local, then flashinfer_cutlass "
        "for modelopt_fp4 with moe_a2a_backend 'none' and moe_runner_backend 'auto', logged "
        "in upstream's words. fp8, bf16 and the W4A16 mixed-precision layers (0.5.20 on, "
        "marlin on SM100) keep upstream's choice."
    ),
    marker=MODEL,
    facts=FACTS,
    transform=transform,
)


# The SM120 branch put right after each form of upstream's SM100 branch (`moe.Branch`), named
# by the releases that ship that form, which is known by its fingerprint (`moe.fingerprint`):
# the family's template (`moe.derived_branch`) in that release's spelling.
BRANCHES = (
    derived_branch("SGLang 0.5.6 to 0.5.7", ("41a77b5c9634ce00",), IN_METHOD, helper=False,
                   model=None),
    derived_branch("SGLang 0.5.8 to 0.5.10", ("7100423ed54e467a",), IN_METHOD, helper=True,
                   model=None),
    derived_branch("SGLang 0.5.11 to 0.5.14", ("ac933d1eb12b7261",), IN_METHOD_UNSET,
                   helper=True, model=None),
    derived_branch("SGLang 0.5.15 to 0.5.18", ("03caaf01bda6cc40",), IN_OVERRIDES, helper=True,
                   model=None),
    derived_branch("SGLang 0.5.19 to 0.5.23", ("f14de353ba54b03e", "fd2f13194c8e1d5c"),
                   IN_MODEL_OVERRIDES, helper=True, model=None),
)
