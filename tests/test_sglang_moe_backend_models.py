# ruff: noqa: E501  (the fixtures keep upstream's long log lines at upstream's indentation)
"""sglang.moe-backend-qwen3 and sglang.moe-backend-minimax on small fixtures in each upstream
shape of their sites, each around upstream's SM100 branch as a release ships it: a literal
SM120 branch as for GLM-4 MoE (patchkit/moe.py), for the Qwen3 MoE family's choice among other
quantizations' and for MiniMax-M2's choice in one `if`."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

QWEN3 = load_patch("sglang.moe-backend-qwen3")
MINIMAX = load_patch("sglang.moe-backend-minimax")

# server_args.py, 0.5.8 to 0.5.14: the family's branch; fp8, fp4 or unquantized on SM100.
QWEN3_SERVER_ARGS = '''
from sglang.srt.utils import is_sm100_supported, is_sm120_supported


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if model_arch in ["Glm4MoeForCausalLM"]:
            pass
        elif model_arch in [
            "Qwen3MoeForCausalLM",
            "Qwen3VLMoeForConditionalGeneration",
        ]:
            if is_sm100_supported():
                quant_method = get_quantization_config(hf_config)
                if self.quantization is None and quant_method is not None:
                    self.quantization = quant_method
                if (
                    (
                        self.quantization in ("fp8", "modelopt_fp4")
                        or self.quantization is None
                    )
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_trtllm"
                    logger.info(
                        "Use flashinfer_trtllm as MoE runner backend on sm100 for "
                        f"{model_arch}"
                    )

            if model_arch in ["Qwen3NextForCausalLM"]:
                self.attention_backend = "triton"
'''

QWEN3_SERVER_ARGS_AFTER = '''
from sglang.srt.utils import is_sm100_supported, is_sm120_supported


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if model_arch in ["Glm4MoeForCausalLM"]:
            pass
        elif model_arch in [
            "Qwen3MoeForCausalLM",
            "Qwen3VLMoeForConditionalGeneration",
        ]:
            if is_sm100_supported():
                quant_method = get_quantization_config(hf_config)
                if self.quantization is None and quant_method is not None:
                    self.quantization = quant_method
                if (
                    (
                        self.quantization in ("fp8", "modelopt_fp4")
                        or self.quantization is None
                    )
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_trtllm"
                    logger.info(
                        "Use flashinfer_trtllm as MoE runner backend on sm100 for "
                        f"{model_arch}"
                    )
            elif is_sm120_supported():
                quantization = self.quantization
                quant_method = get_quantization_config(hf_config)
                if quantization is None and quant_method is not None:
                    quantization = quant_method
                if (
                    quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_cutlass"
                    logger.info(
                        "Use flashinfer_cutlass as MoE runner backend on sm120 for "
                        f"{model_arch}"
                    )

            if model_arch in ["Qwen3NextForCausalLM"]:
                self.attention_backend = "triton"
'''

# model_overrides/qwen3_moe.py, 0.5.20's SM100 branch as it ships: another quantization's
# choice (W4A16, marlin) comes first in the chain, with locals only its branch reads.
QWEN3_CHAIN = '''
from sglang.srt.runtime_context import get_platform


def _qwen3_moe_family_overrides(server_args, hf_config):
    cfg = resolving_view(server_args)
    overrides = {}
    if get_platform().is_sm100:
        quant_method = get_quantization_config(hf_config)
        quantization = cfg.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            overrides["quantization"] = quant_method
            quantization = quant_method
        has_w4a16_moe_layers = (
            quantization == "modelopt_mixed"
            and "W4A16_NVFP4" in _mixed_precision_moe_quant_algos(hf_config)
        )
        if has_w4a16_moe_layers:
            # trtllm-gen only has the W4A4 NVFP4 MoE path.
            # CuTe DSL v2 also supports W4A16 with BF16 activations when opted in.
            use_cutedsl_w4a16 = (
                cfg.moe_runner_backend == "flashinfer_cutedsl"
                and cfg.moe_a2a_backend in ("none", "flashinfer")
                and envs.SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16.get()
            )
            if (
                cfg.moe_runner_backend not in ("auto", "marlin")
                and not use_cutedsl_w4a16
            ):
                raise ValueError(
                    "W4A16_NVFP4 MoE layers require --moe-runner-backend=marlin, "
                    "or flashinfer_cutedsl with --moe-a2a-backend=none/flashinfer "
                    "and SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16=1."
                )
            if cfg.moe_runner_backend == "auto":
                overrides["moe_runner_backend"] = "marlin"
                logger.info(
                    "Use marlin as MoE runner backend for "
                    f"{hf_config.architectures[0]} with W4A16_NVFP4 MoE layers"
                )
        elif (
            (
                quantization in ("fp8", "modelopt_fp4", "modelopt_mixed")
                or quantization is None
            )
            and cfg.moe_a2a_backend == "none"
            and cfg.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
            logger.info(
                "Use flashinfer_trtllm as MoE runner backend on sm100 for "
                f"{hf_config.architectures[0]}"
            )
    return overrides
'''

QWEN3_CHAIN_AFTER = '''
from sglang.srt.runtime_context import get_platform


def _qwen3_moe_family_overrides(server_args, hf_config):
    cfg = resolving_view(server_args)
    overrides = {}
    if get_platform().is_sm100:
        quant_method = get_quantization_config(hf_config)
        quantization = cfg.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            overrides["quantization"] = quant_method
            quantization = quant_method
        has_w4a16_moe_layers = (
            quantization == "modelopt_mixed"
            and "W4A16_NVFP4" in _mixed_precision_moe_quant_algos(hf_config)
        )
        if has_w4a16_moe_layers:
            # trtllm-gen only has the W4A4 NVFP4 MoE path.
            # CuTe DSL v2 also supports W4A16 with BF16 activations when opted in.
            use_cutedsl_w4a16 = (
                cfg.moe_runner_backend == "flashinfer_cutedsl"
                and cfg.moe_a2a_backend in ("none", "flashinfer")
                and envs.SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16.get()
            )
            if (
                cfg.moe_runner_backend not in ("auto", "marlin")
                and not use_cutedsl_w4a16
            ):
                raise ValueError(
                    "W4A16_NVFP4 MoE layers require --moe-runner-backend=marlin, "
                    "or flashinfer_cutedsl with --moe-a2a-backend=none/flashinfer "
                    "and SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16=1."
                )
            if cfg.moe_runner_backend == "auto":
                overrides["moe_runner_backend"] = "marlin"
                logger.info(
                    "Use marlin as MoE runner backend for "
                    f"{hf_config.architectures[0]} with W4A16_NVFP4 MoE layers"
                )
        elif (
            (
                quantization in ("fp8", "modelopt_fp4", "modelopt_mixed")
                or quantization is None
            )
            and cfg.moe_a2a_backend == "none"
            and cfg.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
            logger.info(
                "Use flashinfer_trtllm as MoE runner backend on sm100 for "
                f"{hf_config.architectures[0]}"
            )
    elif get_platform().is_sm120:
        quant_method = get_quantization_config(hf_config)
        quantization = cfg.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            quantization = quant_method
        if (
            quantization == "modelopt_fp4"
            and cfg.moe_a2a_backend == "none"
            and cfg.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_cutlass"
            logger.info(
                "Use flashinfer_cutlass as MoE runner backend on sm120 for "
                f"{hf_config.architectures[0]}"
            )
    return overrides
'''

# arg_groups/overrides.py, 0.5.18: the choice is one `if`, led by the arch check; is_sm120_supported
# is not imported in this fixture.
MINIMAX_UTILS = '''
from sglang.srt.utils.common import (
    is_sm90_supported,
    is_sm100_supported,
)


def _minimax_m2_overrides(server_args, hf_config):
    overrides = {"enable_tf32_matmul": True}
    if (
        is_sm100_supported()
        and server_args.moe_runner_backend == "auto"
        and server_args.get_model_config().quantization == "modelopt_fp4"
    ):
        overrides["moe_runner_backend"] = "flashinfer_trtllm_routed"
        logger.info(
            "Use flashinfer_trtllm_routed as MoE runner backend on SM10X "
            "for MiniMaxM2ForCausalLM with modelopt_fp4."
        )
    return overrides
'''

MINIMAX_UTILS_AFTER = '''
from sglang.srt.utils.common import (
    is_sm90_supported,
    is_sm100_supported,
    is_sm120_supported,
)


def _minimax_m2_overrides(server_args, hf_config):
    overrides = {"enable_tf32_matmul": True}
    if (
        is_sm100_supported()
        and server_args.moe_runner_backend == "auto"
        and server_args.get_model_config().quantization == "modelopt_fp4"
    ):
        overrides["moe_runner_backend"] = "flashinfer_trtllm_routed"
        logger.info(
            "Use flashinfer_trtllm_routed as MoE runner backend on SM10X "
            "for MiniMaxM2ForCausalLM with modelopt_fp4."
        )
    elif (
        is_sm120_supported()
        and server_args.moe_runner_backend == "auto"
        and server_args.get_model_config().quantization == "modelopt_fp4"
    ):
        overrides["moe_runner_backend"] = "flashinfer_cutlass"
        logger.info(
            "Use flashinfer_cutlass as MoE runner backend on SM120 "
            "for MiniMaxM2ForCausalLM with modelopt_fp4."
        )
    return overrides
'''

# model_overrides/minimax_m2.py, 0.5.19's SM100 branch as it ships: the get_platform() form.
MINIMAX_PLATFORM = '''
def _minimax_m2_overrides(server_args, hf_config):
    cfg = resolving_view(server_args)
    overrides = {"enable_tf32_matmul": True}
    if (
        get_platform().is_sm100
        and cfg.moe_runner_backend == "auto"
        and model_config_of(server_args).quantization == "modelopt_fp4"
    ):
        overrides["moe_runner_backend"] = "flashinfer_trtllm_routed"
        logger.info(
            "Use flashinfer_trtllm_routed as MoE runner backend on SM10X "
            "for MiniMaxM2ForCausalLM with modelopt_fp4."
        )
    return overrides
'''

MINIMAX_PLATFORM_AFTER = '''
def _minimax_m2_overrides(server_args, hf_config):
    cfg = resolving_view(server_args)
    overrides = {"enable_tf32_matmul": True}
    if (
        get_platform().is_sm100
        and cfg.moe_runner_backend == "auto"
        and model_config_of(server_args).quantization == "modelopt_fp4"
    ):
        overrides["moe_runner_backend"] = "flashinfer_trtllm_routed"
        logger.info(
            "Use flashinfer_trtllm_routed as MoE runner backend on SM10X "
            "for MiniMaxM2ForCausalLM with modelopt_fp4."
        )
    elif (
        get_platform().is_sm120
        and cfg.moe_runner_backend == "auto"
        and model_config_of(server_args).quantization == "modelopt_fp4"
    ):
        overrides["moe_runner_backend"] = "flashinfer_cutlass"
        logger.info(
            "Use flashinfer_cutlass as MoE runner backend on SM120 "
            "for MiniMaxM2ForCausalLM with modelopt_fp4."
        )
    return overrides
'''

PAIRS = {
    "qwen3-server-args": (QWEN3, QWEN3_SERVER_ARGS, QWEN3_SERVER_ARGS_AFTER),
    "qwen3-chain": (QWEN3, QWEN3_CHAIN, QWEN3_CHAIN_AFTER),
    "minimax-utils-import": (MINIMAX, MINIMAX_UTILS, MINIMAX_UTILS_AFTER),
    "minimax-platform": (MINIMAX, MINIMAX_PLATFORM, MINIMAX_PLATFORM_AFTER),
}


def outcome(res):
    [one] = res.outcomes
    return one


@pytest.mark.parametrize("name", PAIRS)
def test_applies_exactly_then_is_already_applied(run_patch, name):
    patch, before, after = PAIRS[name]
    res = run_patch(patch, before)
    assert outcome(res).status is Status.APPLIED, outcome(res).reason
    assert res.after == textwrap.dedent(after)
    again = run_patch(patch, res.after)
    assert outcome(again).status is Status.ALREADY_APPLIED, outcome(again).reason
    assert not again.changed


def test_shapes_name_the_branch(run_patch):
    chain = outcome(run_patch(QWEN3, QWEN3_CHAIN))
    assert chain.site == "_qwen3_moe_family_overrides"
    assert chain.shape.endswith("(the SM120 branch for SGLang 0.5.19 to 0.5.23)")
    branch = outcome(run_patch(QWEN3, QWEN3_SERVER_ARGS))
    assert branch.site == "_handle_model_specific_adjustments[Qwen3MoeForCausalLM]"
    utils = outcome(run_patch(MINIMAX, MINIMAX_UTILS))
    assert utils.shape == (
        "`elif is_sm120_supported():` after `if is_sm100_supported():` "
        "(the SM120 branch for SGLang 0.5.18); is_sm120_supported imported"
    )


def test_a_site_choosing_nothing_by_arch_is_not_applicable(run_patch):
    # arg_groups/overrides.py, 0.5.15 to 0.5.17: MiniMax-M2's override only enables TF32.
    src = '''
    def _minimax_m2_overrides(server_args, hf_config):
        logger.info("Enable TF32 matmul for MiniMaxM2ForCausalLM model.")
        return {"enable_tf32_matmul": True}
    '''
    res = run_patch(MINIMAX, src)
    assert outcome(res).status is Status.NOT_APPLICABLE and not res.changed
    assert "picks no MoE runner backend" in outcome(res).reason
    # The same function testing an arch it does not choose by is a shape to refuse.
    other = src.replace("    return", "    if get_platform().is_sm90:\n            pass\n        return")
    assert outcome(run_patch(MINIMAX, other)).status is Status.REFUSED
    # And GLM-4 MoE's site without an SM100 branch stays refused (its facts want one).
    glm = load_patch("sglang.moe-backend")
    assert outcome(run_patch(glm, src.replace("_minimax_m2", "_glm4_moe"))).status is Status.REFUSED


def refusal(run_patch, patch, src):
    res = run_patch(patch, src)
    assert outcome(res).status is Status.REFUSED, outcome(res).reason
    assert not res.changed
    return outcome(res).reason


def test_refuses_a_local_the_choice_reads_or_a_field_written(run_patch):
    # The local the W4A16 branch reads, read by the choice too, or written to a field: the SM100
    # branch the literal SM120 branch was written beside is no longer there.
    src = QWEN3_CHAIN.replace(
        'and cfg.moe_a2a_backend == "none"\n', 'and cfg.moe_a2a_backend == "none"\n            and not has_w4a16_moe_layers\n'
    )
    field = QWEN3_CHAIN.replace("        has_w4a16_moe_layers = ", "        self.has_w4a16_moe_layers = ")
    for changed in (src, field):
        assert changed != QWEN3_CHAIN
        reason = refusal(run_patch, QWEN3, changed)
        assert "found `if get_platform().is_sm100:` in another form (fingerprint " in reason


def test_refuses_an_inline_choice_with_another_condition(run_patch):
    src = MINIMAX_PLATFORM.replace(' and cfg.moe_runner_backend == "auto"', ' and cfg.tp_size == 1')
    reason = refusal(run_patch, MINIMAX, src)
    assert "found `if ( get_platform().is_sm100 and cfg.tp_size == 1 and" in reason
    assert "in another form (fingerprint " in reason


def test_refuses_another_sm120_choice(run_patch):
    src = MINIMAX_PLATFORM_AFTER.replace('"flashinfer_cutlass"', '"triton"')
    assert "an SM120 branch in another form" in refusal(run_patch, MINIMAX, src)


def test_refuses_an_sm120_choice_without_its_import(run_patch):
    done = textwrap.dedent(MINIMAX_UTILS_AFTER).replace("    is_sm120_supported,\n", "")
    assert "no such import" in refusal(run_patch, MINIMAX, done)
