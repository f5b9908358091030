# ruff: noqa: E501  (the fixtures keep upstream's long log lines at upstream's indentation)
"""sglang.moe-backend on small fixtures in each upstream shape of site D."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("sglang.moe-backend")

# server_args.py, 0.5.8's SM100 branch as it ships (the version gate); another architecture's
# SM100 branch must stay untouched.
SERVER_ARGS_GATED = '''
from sglang.srt.utils.common import (
    is_cuda,
    is_sm100_supported,
    is_sm120_supported,
)


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        hf_config = self.get_hf_config()
        model_arch = hf_config.architectures[0]
        if model_arch in ["DeepseekV3ForCausalLM"]:
            if is_sm100_supported():
                self.moe_runner_backend = "flashinfer_trtllm"
        elif model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if self.quantization is None and quant_method is not None:
                    self.quantization = quant_method
                if (
                    self.quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    # Only enable flashinfer_trtllm if flashinfer-python version is >= 0.6.2
                    if check_pkg_version_at_least("flashinfer-python", "0.6.2"):
                        self.moe_runner_backend = "flashinfer_trtllm"
                        logger.info(
                            "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
                        )

        elif model_arch in ["FalconH1ForCausalLM"]:
            pass
'''

SERVER_ARGS_GATED_AFTER = '''
from sglang.srt.utils.common import (
    is_cuda,
    is_sm100_supported,
    is_sm120_supported,
)


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        hf_config = self.get_hf_config()
        model_arch = hf_config.architectures[0]
        if model_arch in ["DeepseekV3ForCausalLM"]:
            if is_sm100_supported():
                self.moe_runner_backend = "flashinfer_trtllm"
        elif model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if self.quantization is None and quant_method is not None:
                    self.quantization = quant_method
                if (
                    self.quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    # Only enable flashinfer_trtllm if flashinfer-python version is >= 0.6.2
                    if check_pkg_version_at_least("flashinfer-python", "0.6.2"):
                        self.moe_runner_backend = "flashinfer_trtllm"
                        logger.info(
                            "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
                        )
            elif is_sm120_supported():
                quantization = self.quantization
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if quantization is None and quant_method is not None:
                    quantization = quant_method
                if (
                    quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_cutlass"
                    logger.info(
                        "Use flashinfer_cutlass as MoE runner backend on sm120 for Glm4MoeForCausalLM"
                    )

        elif model_arch in ["FalconH1ForCausalLM"]:
            pass
'''

# server_args.py, 0.5.11's SM100 branch as it ships (no gate, `_quantization_explicitly_unset`);
# here with an `else:` on the SM100 `if` and without `is_sm120_supported` imported.
SERVER_ARGS_ELSE = '''
from sglang.srt.utils import (
    is_cuda,
    is_sm100_supported,
    is_sm90_supported,
)


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if (
                    self.quantization is None
                    and not self._quantization_explicitly_unset
                    and quant_method is not None
                ):
                    self.quantization = quant_method
                if (
                    self.quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_trtllm"
                    logger.info(
                        "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
                    )
            else:
                self.enable_tf32_matmul = True
'''

SERVER_ARGS_ELSE_AFTER = '''
from sglang.srt.utils import (
    is_cuda,
    is_sm100_supported,
    is_sm120_supported,
    is_sm90_supported,
)


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if (
                    self.quantization is None
                    and not self._quantization_explicitly_unset
                    and quant_method is not None
                ):
                    self.quantization = quant_method
                if (
                    self.quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_trtllm"
                    logger.info(
                        "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
                    )
            elif is_sm120_supported():
                quantization = self.quantization
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if (
                    quantization is None
                    and not self._quantization_explicitly_unset
                    and quant_method is not None
                ):
                    quantization = quant_method
                if (
                    quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_cutlass"
                    logger.info(
                        "Use flashinfer_cutlass as MoE runner backend on sm120 for Glm4MoeForCausalLM"
                    )
            else:
                self.enable_tf32_matmul = True
'''

# arg_groups/overrides.py, 0.5.15's SM100 branch as it ships (an overrides dict,
# `quantization in {"modelopt_fp4", None}`); here with an existing `elif` after it.
OVERRIDES_ELIF = '''
from sglang.srt.utils.common import is_sm90_supported, is_sm100_supported, is_sm120_supported


def _glm4_moe_overrides(server_args, hf_config):
    overrides = {}
    if is_sm100_supported():
        quantization_config = getattr(hf_config, "quantization_config", None)
        quant_method = (
            quantization_config.get("quant_method")
            if quantization_config is not None
            else None
        )
        quantization = server_args.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            overrides["quantization"] = quant_method
            quantization = quant_method
        if (
            quantization in {"modelopt_fp4", None}
            and server_args.moe_a2a_backend == "none"
            and server_args.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
            logger.info(
                "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
            )
    elif is_sm90_supported():
        overrides["enable_tf32_matmul"] = False
    overrides["enable_tf32_matmul"] = True
    return overrides
'''

OVERRIDES_ELIF_AFTER = '''
from sglang.srt.utils.common import is_sm90_supported, is_sm100_supported, is_sm120_supported


def _glm4_moe_overrides(server_args, hf_config):
    overrides = {}
    if is_sm100_supported():
        quantization_config = getattr(hf_config, "quantization_config", None)
        quant_method = (
            quantization_config.get("quant_method")
            if quantization_config is not None
            else None
        )
        quantization = server_args.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            overrides["quantization"] = quant_method
            quantization = quant_method
        if (
            quantization in {"modelopt_fp4", None}
            and server_args.moe_a2a_backend == "none"
            and server_args.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
            logger.info(
                "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
            )
    elif is_sm120_supported():
        quantization_config = getattr(hf_config, "quantization_config", None)
        quant_method = (
            quantization_config.get("quant_method")
            if quantization_config is not None
            else None
        )
        quantization = server_args.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            quantization = quant_method
        if (
            quantization == "modelopt_fp4"
            and server_args.moe_a2a_backend == "none"
            and server_args.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_cutlass"
            logger.info(
                "Use flashinfer_cutlass as MoE runner backend on sm120 for Glm4MoeForCausalLM"
            )
    elif is_sm90_supported():
        overrides["enable_tf32_matmul"] = False
    overrides["enable_tf32_matmul"] = True
    return overrides
'''

# arg_groups/model_overrides/glm4_moe.py, 0.5.19's SM100 branch as it ships
# (`get_platform().is_sm100`); the SM120 form needs no import.
PLATFORM = '''
from sglang.srt.runtime_context import get_platform


def _glm4_moe_overrides(server_args, hf_config):
    cfg = resolving_view(server_args)
    overrides = {}
    if get_platform().is_sm100:
        quantization_config = getattr(hf_config, "quantization_config", None)
        quant_method = (
            quantization_config.get("quant_method")
            if quantization_config is not None
            else None
        )
        quantization = cfg.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            overrides["quantization"] = quant_method
            quantization = quant_method
        if (
            quantization in {"modelopt_fp4", None}
            and cfg.moe_a2a_backend == "none"
            and cfg.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
            logger.info(
                "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
            )
    return overrides
'''

PLATFORM_AFTER = '''
from sglang.srt.runtime_context import get_platform


def _glm4_moe_overrides(server_args, hf_config):
    cfg = resolving_view(server_args)
    overrides = {}
    if get_platform().is_sm100:
        quantization_config = getattr(hf_config, "quantization_config", None)
        quant_method = (
            quantization_config.get("quant_method")
            if quantization_config is not None
            else None
        )
        quantization = cfg.quantization
        if (
            quantization is None
            and not server_args._quantization_explicitly_unset
            and quant_method is not None
        ):
            overrides["quantization"] = quant_method
            quantization = quant_method
        if (
            quantization in {"modelopt_fp4", None}
            and cfg.moe_a2a_backend == "none"
            and cfg.moe_runner_backend == "auto"
        ):
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
            logger.info(
                "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
            )
    elif get_platform().is_sm120:
        quantization_config = getattr(hf_config, "quantization_config", None)
        quant_method = (
            quantization_config.get("quant_method")
            if quantization_config is not None
            else None
        )
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
                "Use flashinfer_cutlass as MoE runner backend on sm120 for Glm4MoeForCausalLM"
            )
    return overrides
'''

PAIRS = {
    "server_args_gated": (SERVER_ARGS_GATED, SERVER_ARGS_GATED_AFTER),
    "server_args_else_import": (SERVER_ARGS_ELSE, SERVER_ARGS_ELSE_AFTER),
    "overrides_elif": (OVERRIDES_ELIF, OVERRIDES_ELIF_AFTER),
    "platform": (PLATFORM, PLATFORM_AFTER),
}


def outcome(res):
    assert len(res.outcomes) == 1
    return res.outcomes[0]


@pytest.mark.parametrize("name", PAIRS)
def test_applies_exactly(run_patch, name):
    before, after = PAIRS[name]
    res = run_patch(PATCH, before)
    assert outcome(res).status is Status.APPLIED, outcome(res).reason
    assert res.after == textwrap.dedent(after)


@pytest.mark.parametrize("name", PAIRS)
def test_second_run_is_already_applied(run_patch, name):
    first = run_patch(PATCH, PAIRS[name][0])
    second = run_patch(PATCH, first.after)
    assert outcome(second).status is Status.ALREADY_APPLIED
    assert not second.changed


def test_shape_names_the_branch(run_patch):
    gated = outcome(run_patch(PATCH, SERVER_ARGS_GATED))
    assert gated.site == "_handle_model_specific_adjustments[Glm4MoeForCausalLM]"
    assert gated.shape == (
        "`elif is_sm120_supported():` after `if is_sm100_supported():` "
        "(the SM120 branch for SGLang 0.5.8 to 0.5.10)"
    )
    assert "is_sm120_supported imported" in outcome(run_patch(PATCH, SERVER_ARGS_ELSE)).shape
    platform = outcome(run_patch(PATCH, PLATFORM))
    assert platform.site == "_glm4_moe_overrides"
    assert platform.shape.endswith("(the SM120 branch for SGLang 0.5.19 to 0.5.23)")


def test_before_the_site_existed_is_not_applicable(run_patch):
    # 0.5.2-0.5.7: Glm4Moe appears only inside the fusion auto-enable condition.
    src = '''
    class ServerArgs:
        def _handle_model_specific_adjustments(self):
            if model_arch in ["DeepseekV3ForCausalLM"]:
                if is_sm100_supported():
                    self.moe_runner_backend = "flashinfer_trtllm"
            if (
                model_arch in ["GptOssForCausalLM", "Glm4MoeForCausalLM"]
                and is_sm100_supported()
            ):
                self.enable_flashinfer_allreduce_fusion = True
    '''
    res = run_patch(PATCH, src)
    assert outcome(res).status is Status.NOT_APPLICABLE
    assert not res.changed


def test_unrelated_file_is_not_applicable(run_patch):
    res = run_patch(PATCH, "def gen_trtllm_comm_module():\n    return 1\n")
    assert outcome(res).status is Status.NOT_APPLICABLE


def refusal(run_patch, src):
    res = run_patch(PATCH, src)
    assert outcome(res).status is Status.REFUSED
    assert not res.changed
    return outcome(res).reason


def test_refuses_missing_sm100_branch(run_patch):
    # The server_args stub left behind when the logic moved to the override registry.
    src = '''
    class ServerArgs:
        def _handle_model_specific_adjustments(self):
            if model_arch in ["Glm4MoeForCausalLM"]:
                # moved to _glm4_moe_overrides
                pass
    '''
    assert "found no SM100 branch" in refusal(run_patch, src)


def test_refuses_sm100_branch_twice(run_patch):
    src = PLATFORM.replace("    return overrides", "    if get_platform().is_sm100:\n        pass\n    return overrides")
    assert "found 2 such branches" in refusal(run_patch, src)


def test_refuses_site_twice(run_patch):
    assert "found 2 (_glm4_moe_overrides, _glm4_moe_overrides)" in refusal(run_patch, PLATFORM + PLATFORM)


def test_refuses_changed_sm100_test(run_patch):
    src = PLATFORM.replace("if get_platform().is_sm100:", "if get_platform().is_sm100 and cfg.tp_size == 1:")
    assert "found `if get_platform().is_sm100 and cfg.tp_size == 1:`" in refusal(run_patch, src)


# Edits of PLATFORM's SM100 branch: (old, new).
EDITS = {
    "another backend": ('"flashinfer_trtllm"', '"flashinfer_cutedsl"'),
    "a statement more": (
        "        quantization = cfg.quantization\n",
        '        quantization = cfg.quantization\n        overrides["attention_backend"] = "trtllm_mha"\n',
    ),
    "another condition": ('cfg.moe_a2a_backend == "none"', 'cfg.moe_a2a_backend == "deepep"'),
    "a comment more": ("        quantization = cfg.quantization\n", "        # TRT-LLM-gen\n        quantization = cfg.quantization\n"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_refuses_an_sm100_branch_of_another_form(run_patch, edit):
    """A literal SM120 branch goes only beside the SM100 text it was written for: any change
    there, a comment included, is refused, with the fingerprint a new branch would list."""
    import libcst as cst

    from sm120patch.patchkit import moe

    old, new = EDITS[edit]
    src = PLATFORM.replace(old, new, 1)
    assert src != PLATFORM
    reason = refusal(run_patch, src)
    assert "expected the SM100 branch of a release this patch knows (SGLang 0.5.8 to 0.5.10; " in reason
    [branch] = [s for s in cst.parse_module(src).body[-1].body.body if isinstance(s, cst.If)]
    assert f"found `if get_platform().is_sm100:` in another form (fingerprint {moe.fingerprint(branch)})" in reason


def test_refuses_sm120_branch_in_another_form(run_patch):
    src = PLATFORM_AFTER.replace('"flashinfer_cutlass"', '"triton"')
    assert "an SM120 branch in another form" in refusal(run_patch, src)
    separate = PLATFORM.replace(
        "    return overrides", "    if get_platform().is_sm120:\n        pass\n    return overrides"
    )
    assert "found `if get_platform().is_sm120:`" in refusal(run_patch, separate)


def test_refuses_when_import_cannot_be_added(run_patch):
    src = SERVER_ARGS_ELSE.replace("    is_sm100_supported,\n", "").replace(
        "class ServerArgs:", "is_sm100_supported = make_check(10)\n\n\nclass ServerArgs:"
    )
    assert "found 0 such imports" in refusal(run_patch, src)


def test_picks_the_file_holding_the_site():
    layout = {
        "sglang/srt/arg_groups/overrides.py": "def _glm4_moe_overrides(): ...  # Glm4MoeForCausalLM",
        "sglang/srt/server_args.py": 'ARCHS = ["Glm4MoeForCausalLM"]',
    }
    assert PATCH.pick_file(layout.get) == "sglang/srt/arg_groups/overrides.py"
    del layout["sglang/srt/arg_groups/overrides.py"]
    assert PATCH.pick_file(layout.get) == "sglang/srt/server_args.py"


@pytest.mark.parametrize("name", PAIRS)
def test_sm120_branch_writes_no_quantization_field(run_patch, name):
    """The SM120 branch derives the checkpoint's quantization in a local and writes only the
    MoE runner backend (upstream sets the quantization field later, from the model config)."""
    import ast

    before, _ = PAIRS[name]
    res = run_patch(PATCH, before)
    tree = ast.parse(res.after)
    branches = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "sm120" in ast.unparse(n.test)]
    assert len(branches) == 1, name
    written = {
        ast.unparse(t)
        for stmt in branches[0].body
        for node in ast.walk(stmt)
        if isinstance(node, ast.Assign)
        for t in node.targets
    }
    assert not written & {"self.quantization", "overrides['quantization']"}, written
    assert any("moe_runner_backend" in w for w in written), written


def branches():
    """(patch id, Branch) for every literal SM120 branch of the three MoE runner patches."""
    import importlib

    ids = ("sglang.moe-backend", "sglang.moe-backend-qwen3", "sglang.moe-backend-minimax")
    modules = [(pid, importlib.import_module(load_patch(pid).transform.__module__)) for pid in ids]
    return [(pid, b) for pid, module in modules for b in module.BRANCHES]


@pytest.mark.parametrize(("patch_id", "branch"), branches(), ids=lambda x: getattr(x, "name", x))
def test_every_sm120_branch_chooses_cutlass_for_modelopt_fp4_alone(patch_id, branch):
    """What the derivation's self-check once held each built branch to, held to the literal
    branches: an SM120 check leads, no TRT-LLM or SM100 word is left (strings and comments
    alike), one flashinfer_cutlass choice under a `== "modelopt_fp4"` test with its log
    line, no version gate, no fp8 or unquantized case, no quantization field written."""
    import ast

    tree = ast.parse(branch.code.removeprefix("el"))
    [top] = tree.body
    assert isinstance(top, ast.If) and top.orelse == []
    lead = top.test.values[0] if isinstance(top.test, ast.BoolOp) else top.test
    assert ast.unparse(lead) in ("is_sm120_supported()", "get_platform().is_sm120")
    lowered = branch.code.lower()
    assert not [w for w in ("trtllm", "trt-llm", "sm100", "sm10x") if w in lowered]
    assigns = [n for n in ast.walk(top) if isinstance(n, ast.Assign)]
    written = {ast.unparse(t) for a in assigns for t in a.targets}
    assert not written & {"self.quantization", "overrides['quantization']"}, written
    choices = [a for a in assigns if isinstance(a.value, ast.Constant) and a.value.value == "flashinfer_cutlass"]
    [choice] = choices
    assert ast.unparse(choice.targets[0]).endswith(("moe_runner_backend", "['moe_runner_backend']"))
    guards = [n for n in ast.walk(top) if isinstance(n, ast.If) and choice in n.body]
    assert len(guards) == 1 and "== 'modelopt_fp4'" in ast.unparse(guards[0].test)
    calls = [ast.unparse(n.func) for n in ast.walk(top) if isinstance(n, ast.Call)]
    assert calls.count("logger.info") == 1 and "check_pkg_version_at_least" not in calls
    strings = {n.value for n in ast.walk(top) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert any("flashinfer_cutlass" in s for s in strings - {"flashinfer_cutlass"})  # the log line
    assert not strings & {"fp8", "modelopt_mixed"} and "is None" not in ast.unparse(guards[0].test)


def test_a_file_indented_with_tabs_gets_the_branch_in_tabs(run_patch):
    def tabs(line):
        stripped = line.lstrip(" ")
        return "\t" * ((len(line) - len(stripped)) // 4) + stripped

    src = "\n".join(tabs(line) for line in SERVER_ARGS_GATED.split("\n"))
    res = run_patch(PATCH, src)
    assert outcome(res).status is Status.APPLIED, outcome(res).reason
    assert res.after == "\n".join(tabs(line) for line in SERVER_ARGS_GATED_AFTER.split("\n"))
    assert outcome(run_patch(PATCH, res.after)).status is Status.ALREADY_APPLIED
