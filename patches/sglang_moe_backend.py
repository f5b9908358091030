"""sglang.moe-backend: choose flashinfer_cutlass as the MoE runner of GLM-4 MoE on SM120 (site D).

The SM120 branch is literal (`BRANCHES`, one per form of the release's SM100 branch, put by
`patchkit.moe`): the kit's template of a branch deriving the quantization, in that release's
spelling of the server args (`moe.Spelling`); only the parts that are about TRT-LLM differ.
"""

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

MODEL = "Glm4MoeForCausalLM"
OVERRIDES_FUNC = "_glm4_moe_overrides"


def transform(module: cst.Module) -> Result:
    return moe.add_sm120_choice(module, MODEL, OVERRIDES_FUNC, BRANCHES)


SERVER_ARGS = "sglang/srt/server_args.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
GLM4_MOE = "sglang/srt/arg_groups/model_overrides/glm4_moe.py"
HANDLER = "ServerArgs._handle_model_specific_adjustments"
FACTS = (
    Fact(releases="<0.5.8", status=Status.NOT_APPLICABLE, shape="no Glm4MoeForCausalLM MoE branch",
         source="released files", note="no Glm4MoeForCausalLM branch before 0.5.8"),
    Fact(releases=">=0.5.8,<0.5.10", status=Status.APPLIED,
         shape='`elif model_arch in ["Glm4MoeForCausalLM"]:` '
         '`if is_sm100_supported():` ... flashinfer_trtllm under '
         '`if check_pkg_version_at_least("flashinfer-python", ...):`', file=SERVER_ARGS,
         function=HANDLER, form="utils", source="released files"),
    Fact(releases=">=0.5.10,<0.5.13", status=Status.APPLIED, shape="same, without the version gate",
         file=SERVER_ARGS, function=HANDLER, form="utils", source="released files"),
    Fact(releases=">=0.5.13,<0.5.15", status=Status.APPLIED,
         shape="same; upstream picks flashinfer_cutlass on SM120 "
         "for --quantization modelopt_fp4", file=SERVER_ARGS, function=HANDLER, form="utils",
         source="released files", user_note=FLAG_NOTE),
    Fact(releases=">=0.5.15,<0.5.19", status=Status.APPLIED, shape='`if is_sm100_supported():` ... '
         'overrides["moe_runner_backend"] = "flashinfer_trtllm"', file=OVERRIDES,
         function=OVERRIDES_FUNC, form="utils", source="released files",
         note="server_args.py keeps an empty `elif model_arch in [\"Glm4MoeForCausalLM\"]: "
         "pass` pointing at overrides.py (real files): the site is in overrides.py",
         user_note=FLAG_NOTE),
    Fact(releases=">=0.5.19,<0.5.24", status=Status.APPLIED, shape="`if get_platform().is_sm100:`",
         file=GLM4_MOE, function=OVERRIDES_FUNC, form="platform", source="released files",
         user_note=FLAG_NOTE),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right after the model's unchanged SM100 branch, an SM120 branch setting the MoE runner
    backend to flashinfer_cutlass for modelopt_fp4 on `auto` alone, logged, writing no
    quantization field (`sitecheck.moe_choice`)."""
    return sc.moe_choice(before, after, fact, MODEL)


PATCH = Patch(
    id="sglang.moe-backend",
    check=check,
    target="sglang",
    title="Choose flashinfer_cutlass as the MoE runner for GLM-4 MoE NVFP4 on SM120",
    why=(
        "For Glm4MoeForCausalLM SGLang picks a MoE runner backend only on SM100 "
        "(flashinfer_trtllm, whose TRT-LLM-gen kernels do not run on SM120); on SM120 the "
        "backend stays 'auto'. The patch adds an SM120 branch right after the SM100 one, in "
        "the release's own form (`elif is_sm120_supported():` or `elif "
        "get_platform().is_sm120:`), written for each form of the SM100 branch: the "
        "quantization read from the checkpoint's config as the SM100 branch reads it, but into "
        "a local variable (the branch writes nothing but the MoE runner backend; upstream "
        "leaves the quantization to the model config), then flashinfer_cutlass, an NVFP4 MoE "
        "runner SM120 can run (not one shown fastest there: the one public side-by-side has it "
        "behind b12x, which SGLang 0.5.23 does not ship), for modelopt_fp4 with "
        "moe_a2a_backend 'none' "
        "and moe_runner_backend 'auto', with its own log line. Where the SM100 condition also "
        "takes unquantized models (0.5.15 on), the SM120 branch keeps to modelopt_fp4: bf16 "
        "on SM120 was not measured and keeps upstream's choice. The FlashInfer version gate "
        "of 0.5.8 and 0.5.9 is not copied: its comment says it guards flashinfer_trtllm, "
        "flashinfer_cutlass does not use TRT-LLM-gen kernels (SGLang selects it elsewhere "
        "without a gate), and 0.5.8 ships FlashInfer 0.6.1, below its own 0.6.2 gate, where "
        "a copied gate would make the branch dead."
    ),
    marker=MODEL,
    facts=FACTS,
    transform=transform,
)


# The SM120 branch put right after each form of upstream's SM100 branch (`moe.Branch`), named
# by the releases that ship that form, which is known by its fingerprint (`moe.fingerprint`):
# the family's template (`moe.derived_branch`) in that release's spelling.
BRANCHES = (
    derived_branch("SGLang 0.5.8 to 0.5.10",
                   ("54c366d0db1a08f0", "1d519b0eecb26a1c", "0ecf78c76602d5ea"),
                   IN_METHOD, helper=False, model=MODEL),
    derived_branch("SGLang 0.5.11 to 0.5.14", ("b9e92e08acc620dd",), IN_METHOD_UNSET,
                   helper=False, model=MODEL),
    derived_branch("SGLang 0.5.15 to 0.5.18", ("234b4fe1363c4106",), IN_OVERRIDES,
                   helper=False, model=MODEL),
    derived_branch("SGLang 0.5.19 to 0.5.23", ("8e2625f4036ed8ab",), IN_MODEL_OVERRIDES,
                   helper=False, model=MODEL),
)
