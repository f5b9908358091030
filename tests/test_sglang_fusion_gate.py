from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text

PATCH = load_patch("sglang.fusion-gate")
FLAG = load_patch("sglang.sm120-flag")

# The module flags as sglang.sm120-flag leaves them; the gate needs the SM120 one.
FLAGS = """
_is_sm90_supported = _is_cuda and is_sm90_supported()
_is_sm100_supported = _is_cuda and is_sm100_supported()
_is_sm120_supported = _is_cuda and is_sm120_supported()
"""

# 0.5.2 to 0.5.7: an `if (` inside the method, SM100 first.
METHOD_BEFORE = (
    FLAGS
    + """

class CommunicateWithAllReduceAndLayerNormFn:
    @staticmethod
    def _gather_hidden_states_and_residual(hidden_states, residual, layernorm):
        if hidden_states.shape[0] == 0:
            return hidden_states, residual
        else:
            if (
                (_is_sm100_supported or _is_sm90_supported)
                and _is_flashinfer_available
                and hidden_states.shape[0] <= 4096
            ):
                return layernorm.forward_with_allreduce_fusion(hidden_states, residual)
            return layernorm(hidden_states, residual)
"""
)
METHOD_AFTER = METHOD_BEFORE.replace(
    "(_is_sm100_supported or _is_sm90_supported)",
    "(_is_sm100_supported or _is_sm90_supported or _is_sm120_supported)",
)

# 0.5.8 to 0.5.21: a function returning a conjunction, a comment before the operand.
FUNCTION_BEFORE = (
    FLAGS
    + """

def apply_flashinfer_allreduce_fusion(batch_size: int):
    return (
        # NOTE: a comment the patch keeps
        (_is_sm90_supported or _is_sm100_supported)
        and _is_flashinfer_available
        and batch_size > 0
    )


class CommunicateWithAllReduceAndLayerNormFn:
    def _gather_hidden_states_and_residual(self, batch_size):
        if apply_flashinfer_allreduce_fusion(batch_size):
            return 1
        return 0
"""
)
FUNCTION_AFTER = FUNCTION_BEFORE.replace(
    "(_is_sm90_supported or _is_sm100_supported)",
    "(_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)",
)

# 0.5.22 on: renamed.
RENAMED_BEFORE = FUNCTION_BEFORE.replace(
    "apply_flashinfer_allreduce_fusion", "flashinfer_ar_fusion_applies"
)
RENAMED_AFTER = FUNCTION_AFTER.replace(
    "apply_flashinfer_allreduce_fusion", "flashinfer_ar_fusion_applies"
)

SHAPES = [
    pytest.param(
        METHOD_BEFORE,
        METHOD_AFTER,
        "CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual",
        id="method-if",
    ),
    pytest.param(
        FUNCTION_BEFORE, FUNCTION_AFTER, "apply_flashinfer_allreduce_fusion", id="function"
    ),
    pytest.param(RENAMED_BEFORE, RENAMED_AFTER, "flashinfer_ar_fusion_applies", id="renamed"),
]


def status(res):
    return [o.status for o in res.outcomes]


@pytest.mark.parametrize(("before", "after", "site"), SHAPES)
def test_applies(run_patch, before, after, site):
    res = run_patch(PATCH, before)
    assert status(res) == [Status.APPLIED], res.outcomes[0].reason
    assert res.outcomes[0].site == site
    assert res.after == textwrap.dedent(after)


@pytest.mark.parametrize(("before", "after", "site"), SHAPES)
def test_second_run_is_already_applied(run_patch, before, after, site):
    res = run_patch(PATCH, after)
    assert status(res) == [Status.ALREADY_APPLIED]
    assert res.outcomes[0].site == site
    assert not res.changed


def test_one_line_condition_stays_on_one_line(run_patch):
    gate = (
        "def flashinfer_ar_fusion_applies(n):\n"
        "    return (_is_sm90_supported or _is_sm100_supported) and n > 0\n"
    )
    src = FLAGS + "\n" + gate
    res = run_patch(PATCH, src)
    assert res.after == textwrap.dedent(src).replace(
        "_is_sm100_supported) and", "_is_sm100_supported or _is_sm120_supported) and"
    )


def test_group_broken_over_lines_gets_its_own_line(run_patch):
    src = FUNCTION_BEFORE.replace(
        "(_is_sm90_supported or _is_sm100_supported)",
        "(\n            _is_sm90_supported\n            or _is_sm100_supported\n        )",
    )
    res = run_patch(PATCH, src)
    assert status(res) == [Status.APPLIED]
    assert res.after == textwrap.dedent(src).replace(
        "            or _is_sm100_supported\n",
        "            or _is_sm100_supported\n            or _is_sm120_supported\n",
    )


def refusal(run_patch, source: str) -> str:
    res = run_patch(PATCH, source)
    assert status(res) == [Status.REFUSED]
    assert not res.changed
    return res.outcomes[0].reason


def test_refuses_missing_gate(run_patch):
    reason = refusal(run_patch, FLAGS + "\ndef something_else():\n    return _is_sm90_supported\n")
    assert "apply_flashinfer_allreduce_fusion" in reason
    assert "found none of them" in reason


def test_refuses_gate_function_twice(run_patch):
    src = FUNCTION_BEFORE + "\n\n" + RENAMED_BEFORE.split("\n\n\n")[1]
    reason = refusal(run_patch, src)
    assert "2 definitions of flashinfer_ar_fusion_applies" in reason


def test_refuses_gate_method_twice(run_patch):
    twice = METHOD_BEFORE + METHOD_BEFORE.split("\n\n\n")[1].replace(
        "class CommunicateWithAllReduceAndLayerNormFn",
        "\n\nclass CommunicateWithAllReduceAndLayerNormFn",
    )
    reason = refusal(run_patch, twice)
    assert "2 definitions of CommunicateWithAllReduceAndLayerNormFn." in reason


@pytest.mark.parametrize(
    "changed",
    [
        "(_is_sm90_supported and _is_sm100_supported)",
        "(_is_sm90_supported or _is_sm100_supported or _is_sm110_supported)",
        "(_is_sm90_supported or is_blackwell())",
        "(_is_sm90_supported or _is_sm90_supported)",
        "_is_sm100_supported",
    ],
)
def test_refuses_operand_of_unknown_form(run_patch, changed):
    src = FUNCTION_BEFORE.replace("(_is_sm90_supported or _is_sm100_supported)", changed)
    reason = refusal(run_patch, src)
    assert f"found `{changed}`" in reason


def test_refuses_gate_not_first(run_patch):
    src = FUNCTION_BEFORE.replace(
        "(_is_sm90_supported or _is_sm100_supported)\n        and _is_flashinfer_available",
        "_is_flashinfer_available\n        and (_is_sm90_supported or _is_sm100_supported)",
    )
    assert "found `_is_flashinfer_available`" in refusal(run_patch, src)


def test_refuses_two_conditions_testing_the_flags(run_patch):
    src = FUNCTION_BEFORE.replace(
        "    return (\n", "    if _is_sm100_supported:\n        pass\n    return (\n"
    )
    assert "found 2" in refusal(run_patch, src)


def test_refuses_without_the_sm120_flag(run_patch):
    src = FUNCTION_BEFORE.replace("_is_sm120_supported = _is_cuda and is_sm120_supported()\n", "")
    assert "sglang.sm120-flag runs first" in refusal(run_patch, src)


def test_chained_after_the_flag_patch():
    # Without the flag patch the gate refuses (see above); after it, on the same parse, it applies.
    imports = "from sglang.srt.utils import (\n    is_sm90_supported,\n    is_sm100_supported,\n)\n"
    before = imports + textwrap.dedent(METHOD_BEFORE).replace(
        "_is_sm120_supported = _is_cuda and is_sm120_supported()\n", ""
    )
    res = transform_text([FLAG, PATCH], "communicator.py", before)
    assert status(res) == [Status.APPLIED, Status.APPLIED]
    expected = imports.replace(
        "is_sm100_supported,\n", "is_sm100_supported,\n    is_sm120_supported,\n"
    ) + textwrap.dedent(METHOD_AFTER)
    assert res.after == expected
    again = transform_text([FLAG, PATCH], "communicator.py", res.after)
    assert status(again) == [Status.ALREADY_APPLIED, Status.ALREADY_APPLIED]
    assert not again.changed
