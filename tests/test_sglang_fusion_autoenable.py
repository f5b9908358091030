from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("sglang.fusion-autoenable")

# 0.5.8 to 0.5.13: one unified block in ServerArgs; a neighbouring SM100-only `if` stays.
UNIFIED = '''
from sglang.srt.utils import (
    is_sm90_supported,
    is_sm100_supported,
    is_sm120_supported,
)


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if is_sm100_supported():
            self.attention_backend = "trtllm_mla"
        if (
            not self.enable_flashinfer_allreduce_fusion
            and model_arch in ["DeepseekV3ForCausalLM"]
            and (is_sm90_supported() or is_sm100_supported())
            and self.nnodes == 1
        ):
            self.enable_flashinfer_allreduce_fusion = True
'''
UNIFIED_AFTER = UNIFIED.replace(
    "and (is_sm90_supported() or is_sm100_supported())",
    "and (is_sm90_supported() or is_sm100_supported() or (is_sm120_supported() and "
    "self.tp_size == 2))",
)

# 0.5.14: sets the backend to "auto"; the multi-node clause mentions SM100 too.
BACKEND_AUTO = '''
from sglang.srt.utils import is_sm90_supported, is_sm100_supported, is_sm120_supported


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if (
            self.flashinfer_allreduce_fusion_backend is None
            and (is_sm90_supported() or is_sm100_supported())
            and (self.nnodes == 1 or is_sm100_supported())
        ):
            self.flashinfer_allreduce_fusion_backend = "auto"
        if self.enforce_disable_flashinfer_allreduce_fusion:
            self.flashinfer_allreduce_fusion_backend = None
'''
BACKEND_AUTO_AFTER = BACKEND_AUTO.replace(
    "and (is_sm90_supported() or is_sm100_supported())\n",
    "and (is_sm90_supported() or is_sm100_supported() or (is_sm120_supported() and "
    "self.tp_size == 2))\n",
)

# 0.5.15 to 0.5.18: arg_groups/overrides.py returns the override.
OVERRIDES = '''
from sglang.srt.utils.common import (
    is_sm90_supported,
    is_sm100_supported,
    is_sm120_supported,
)


def _flashinfer_allreduce_fusion_auto_enable(view):
    if (
        view.flashinfer_allreduce_fusion_backend is None
        and (is_sm90_supported() or is_sm100_supported())
        and view.tp_size > 1
    ):
        return {"flashinfer_allreduce_fusion_backend": "auto"}
    return {}
'''
OVERRIDES_AFTER = OVERRIDES.replace(
    "(is_sm90_supported() or is_sm100_supported())",
    "(is_sm90_supported() or is_sm100_supported() or (is_sm120_supported() and "
    "view.tp_size == 2))",
)

# 0.5.19 to 0.5.23: get_platform() form; an early return turns fusion off, not on.
PLATFORM = '''
from sglang.srt.runtime_context import get_platform


def _flashinfer_allreduce_fusion_auto_enable(view):
    if envs.CUTEDSL.get():
        return {"flashinfer_allreduce_fusion_backend": None}
    if (
        view.flashinfer_allreduce_fusion_backend is None
        and (get_platform().is_sm90 or get_platform().is_sm100)
        and (view.nnodes == 1 or get_platform().is_sm100)
    ):
        backend = "auto"
        return {"flashinfer_allreduce_fusion_backend": backend}
    return {}
'''
PLATFORM_AFTER = PLATFORM.replace(
    "(get_platform().is_sm90 or get_platform().is_sm100)\n",
    "(get_platform().is_sm90 or get_platform().is_sm100 or (get_platform().is_sm120 and "
    "view.tp_size == 2))\n",
)

# 0.5.4: per-model blocks. DeepseekV3's also picks SM100-only kernels; GptOss's gates
# only the fusion.
PER_MODEL = '''
from sglang.srt.utils import is_cuda, is_sm90_supported, is_sm100_supported, is_sm120_supported


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if model_arch in ["DeepseekV3ForCausalLM"]:
            if is_cuda() and is_sm100_supported():
                self.attention_backend = "trtllm_mla"
                if not self.enable_dp_attention:
                    self.enable_flashinfer_allreduce_fusion = True
        elif model_arch in ["GptOssForCausalLM"]:
            if is_sm100_supported():
                if not self.enable_dp_attention:
                    self.enable_flashinfer_allreduce_fusion = True
                    logger.info("Enable FlashInfer AllReduce Fusion on sm100")
'''
PER_MODEL_AFTER = PER_MODEL.replace(
    "            if is_sm100_supported():\n",
    "            if is_sm100_supported() or (is_sm120_supported() and self.tp_size == 2):\n",
)

APPLIED = {
    "unified": (UNIFIED, UNIFIED_AFTER),
    "backend-auto": (BACKEND_AUTO, BACKEND_AUTO_AFTER),
    "overrides": (OVERRIDES, OVERRIDES_AFTER),
    "platform": (PLATFORM, PLATFORM_AFTER),
    "per-model": (PER_MODEL, PER_MODEL_AFTER),
}


def _one(res):
    assert len(res.outcomes) == 1
    return res.outcomes[0]


@pytest.mark.parametrize("shape", APPLIED)
def test_applies(run_patch, shape):
    before, after = APPLIED[shape]
    res = run_patch(PATCH, before)
    assert _one(res).status is Status.APPLIED, _one(res).reason
    assert res.after == textwrap.dedent(after)
    assert after != before


@pytest.mark.parametrize("shape", APPLIED)
def test_second_run_is_already_applied(run_patch, shape):
    first = run_patch(PATCH, APPLIED[shape][0])
    second = run_patch(PATCH, first.after)
    assert _one(second).status is Status.ALREADY_APPLIED, _one(second).reason
    assert second.after == first.after


def test_multi_node_clause_is_left_alone(run_patch):
    res = run_patch(PATCH, BACKEND_AUTO)
    assert "and (self.nnodes == 1 or is_sm100_supported())\n" in res.after


def test_per_model_keeps_sm100_only_block(run_patch):
    res = run_patch(PATCH, PER_MODEL)
    assert "if is_cuda() and is_sm100_supported():\n" in res.after
    assert "left as is" in _one(res).reason


def test_adds_missing_import(run_patch):
    before = UNIFIED.replace("    is_sm120_supported,\n", "")
    res = run_patch(PATCH, before)
    assert _one(res).status is Status.APPLIED
    assert res.after == textwrap.dedent(UNIFIED_AFTER)


def test_unified_blackwell_is_upstream(run_patch):
    src = UNIFIED.replace("is_sm100_supported())\n", "is_blackwell_supported())\n")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.UPSTREAM
    assert "is_blackwell_supported()" in _one(res).reason
    assert not res.changed


def test_per_model_blackwell_is_upstream(run_patch):
    src = PER_MODEL.replace("    if is_sm100_supported():", "    if is_blackwell_supported():")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.UPSTREAM
    assert not res.changed


def test_platform_blackwell_is_upstream(run_patch):
    src = PLATFORM.replace(
        "(get_platform().is_sm90 or get_platform().is_sm100)\n",
        "(get_platform().is_sm90 or get_platform().is_blackwell)\n",
    )
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.UPSTREAM


def test_no_site_is_not_applicable(run_patch):
    res = run_patch(PATCH, "class ServerArgs:\n    def __post_init__(self):\n        pass\n")
    assert _one(res).status is Status.NOT_APPLICABLE
    assert not res.changed


def test_prefers_overrides_file():
    files = {
        "sglang/srt/arg_groups/overrides.py": OVERRIDES,
        "sglang/srt/server_args.py": UNIFIED,
    }
    assert PATCH.pick_file(files.get) == "sglang/srt/arg_groups/overrides.py"
    del files["sglang/srt/arg_groups/overrides.py"]
    assert PATCH.pick_file(files.get) == "sglang/srt/server_args.py"


def test_refuses_per_model_without_sm120_helper(run_patch):
    # 0.5.2 and 0.5.3: sglang.srt.utils has no is_sm120_supported to import.
    src = PER_MODEL.replace(", is_sm120_supported\n", "\n")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "predates SM120" in _one(res).reason
    assert not res.changed


def test_refuses_function_twice(run_patch):
    res = run_patch(PATCH, OVERRIDES + OVERRIDES.split("\n\n\n")[1])
    assert _one(res).status is Status.REFUSED
    assert "2 definitions" in _one(res).reason
    assert "_flashinfer_allreduce_fusion_auto_enable" in _one(res).site


def test_refuses_unknown_form(run_patch):
    src = OVERRIDES.replace(
        "(is_sm90_supported() or is_sm100_supported())",
        "(is_sm90_supported() and is_sm100_supported())",
    )
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "is_sm90_supported() and is_sm100_supported()" in _one(res).reason
    assert not res.changed


def test_refuses_other_archs(run_patch):
    src = OVERRIDES.replace("is_sm90_supported() or is_sm100_supported()", "is_sm90_supported()")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED


def test_refuses_mixed_forms(run_patch):
    src = PLATFORM.replace("get_platform().is_sm90 or", "is_sm90_supported() or")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED


def test_refuses_several_conditions(run_patch):
    # The function's `if` block twice in a row.
    block = OVERRIDES.split("    return {}\n")[0].split("(view):\n")[1]
    src = OVERRIDES.replace("    return {}\n", block + "    return {}\n")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "several" in _one(res).reason
    assert not res.changed


def test_refuses_without_enabling_statement(run_patch):
    src = OVERRIDES.replace('"flashinfer_allreduce_fusion_backend": "auto"', '"other": "auto"')
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "no statement turning allreduce fusion on" in _one(res).reason


def test_refuses_ungated_enabling(run_patch):
    always_on = '    return {"flashinfer_allreduce_fusion_backend": "auto"}\n'
    src = OVERRIDES.replace("    return {}\n", always_on)
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "under no GPU-arch check" in _one(res).reason


def test_refuses_when_only_sm100_kernel_block_is_left(run_patch):
    src = PER_MODEL.split("        elif")[0] + "\n"
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "only SM100 blocks" in _one(res).reason


def test_refuses_sm120_used_but_not_imported(run_patch):
    src = UNIFIED_AFTER.replace("    is_sm120_supported,\n", "")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "imported" in _one(res).reason


# Formatting variants of the anchor: each is patched to the expected text.
TP2 = "(is_sm120_supported() and view.tp_size == 2)"
VARIANTS = {
    "one line": (
        "(is_sm90_supported() or is_sm100_supported())",
        f"(is_sm90_supported() or is_sm100_supported() or {TP2})",
    ),
    "reversed": (
        "(is_sm100_supported() or is_sm90_supported())",
        f"(is_sm100_supported() or is_sm90_supported() or {TP2})",
    ),
    "inner parentheses": (
        "((is_sm90_supported()) or (is_sm100_supported()))",
        f"((is_sm90_supported()) or (is_sm100_supported()) or {TP2})",
    ),
    "broken over lines": (
        "(\n            is_sm90_supported()\n            or is_sm100_supported()\n        )",
        "(\n            is_sm90_supported()\n            or is_sm100_supported()\n"
        f"            or {TP2}\n        )",
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_formatting_variants(run_patch, variant):
    old, new = VARIANTS[variant]
    anchor = "(is_sm90_supported() or is_sm100_supported())"
    res = run_patch(PATCH, OVERRIDES.replace(anchor, old))
    assert _one(res).status is Status.APPLIED, _one(res).reason
    assert res.after == textwrap.dedent(OVERRIDES.replace(anchor, new))
    again = run_patch(PATCH, res.after)
    assert _one(again).status is Status.ALREADY_APPLIED


def test_sm120_at_every_tp_size_is_upstream(run_patch):
    # A release (or an sm120patch before TP2-only) whose group already tests SM120 alone: the
    # release decides at every TP size, and the patch never narrows what is there.
    src = OVERRIDES.replace(
        "(is_sm90_supported() or is_sm100_supported())",
        "(is_sm90_supported() or is_sm100_supported() or is_sm120_supported())",
    )
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.UPSTREAM, _one(res).reason
    assert "every TP size" in _one(res).reason
    assert not res.changed


@pytest.mark.parametrize("size", ["view.tp_size == 4", "view.tp_size > 1", "view.nnodes == 2"])
def test_another_sm120_guard_is_refused(run_patch, size):
    # Only the patch's own `== 2` counts as applied; anything else beside SM120 is not ours.
    src = OVERRIDES_AFTER.replace("view.tp_size == 2", size)
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED, _one(res).reason
    assert not res.changed


def test_receiver_is_the_first_parameter(run_patch):
    src = OVERRIDES.replace("(view)", "(args)").replace("view.", "args.")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.APPLIED, _one(res).reason
    assert "(is_sm120_supported() and args.tp_size == 2)" in res.after
