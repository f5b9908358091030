from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text

PATCH = load_patch("sglang.sm120-flag")

# 0.5.2 to 0.5.5: `is_cuda() and ...`, is_sm100_supported last in the import.
CALL_BEFORE = """
from sglang.srt.utils import (
    is_cuda,
    is_sm90_supported,
    is_sm100_supported,
)

_is_sm90_supported = is_cuda() and is_sm90_supported()
_is_sm100_supported = is_cuda() and is_sm100_supported()
_use_aiter = False
"""
CALL_AFTER = """
from sglang.srt.utils import (
    is_cuda,
    is_sm90_supported,
    is_sm100_supported,
    is_sm120_supported,
)

_is_sm90_supported = is_cuda() and is_sm90_supported()
_is_sm100_supported = is_cuda() and is_sm100_supported()
_is_sm120_supported = is_cuda() and is_sm120_supported()
_use_aiter = False
"""

# 0.5.6 to 0.5.18: `_is_cuda and ...`, a name after is_sm100_supported in the import.
FLAG_BEFORE = """
from sglang.srt.utils import (
    is_cuda,
    is_sm90_supported,
    is_sm100_supported,
    prepare_weight_cache,
)

_is_cuda = is_cuda()
_is_sm90_supported = _is_cuda and is_sm90_supported()
_is_sm100_supported = _is_cuda and is_sm100_supported()
"""
FLAG_AFTER = """
from sglang.srt.utils import (
    is_cuda,
    is_sm90_supported,
    is_sm100_supported,
    is_sm120_supported,
    prepare_weight_cache,
)

_is_cuda = is_cuda()
_is_sm90_supported = _is_cuda and is_sm90_supported()
_is_sm100_supported = _is_cuda and is_sm100_supported()
_is_sm120_supported = _is_cuda and is_sm120_supported()
"""

# 0.5.19 on: `get_platform()` flags, nothing to import.
PLATFORM_BEFORE = """
from sglang.srt.runtime_context import get_exec, get_platform
from sglang.srt.utils import (
    is_cuda,
    is_hip,
)

_is_cuda = is_cuda()
_is_sm90_supported = _is_cuda and get_platform().is_sm90
_is_sm100_supported = _is_cuda and get_platform().is_sm100
_use_aiter = False
"""
PLATFORM_AFTER = """
from sglang.srt.runtime_context import get_exec, get_platform
from sglang.srt.utils import (
    is_cuda,
    is_hip,
)

_is_cuda = is_cuda()
_is_sm90_supported = _is_cuda and get_platform().is_sm90
_is_sm100_supported = _is_cuda and get_platform().is_sm100
_is_sm120_supported = _is_cuda and get_platform().is_sm120
_use_aiter = False
"""

SHAPES = [
    pytest.param(CALL_BEFORE, CALL_AFTER, id="is_cuda-call"),
    pytest.param(FLAG_BEFORE, FLAG_AFTER, id="_is_cuda-flag"),
    pytest.param(PLATFORM_BEFORE, PLATFORM_AFTER, id="get_platform"),
]


def status(res):
    return [o.status for o in res.outcomes]


@pytest.mark.parametrize(("before", "after"), SHAPES)
def test_applies(run_patch, before, after):
    res = run_patch(PATCH, before)
    assert status(res) == [Status.APPLIED], res.outcomes[0].reason
    assert res.after == textwrap.dedent(after)


@pytest.mark.parametrize(("before", "after"), SHAPES)
def test_second_run_is_already_applied(run_patch, before, after):
    res = run_patch(PATCH, after)
    assert status(res) == [Status.ALREADY_APPLIED]
    assert not res.changed


def test_keeps_crlf_line_endings(run_patch):
    res = run_patch(PATCH, textwrap.dedent(FLAG_BEFORE).replace("\n", "\r\n"))
    assert res.after == textwrap.dedent(FLAG_AFTER).replace("\n", "\r\n")


def test_import_already_there_adds_only_the_flag(run_patch):
    before = FLAG_AFTER.replace("_is_sm120_supported = _is_cuda and is_sm120_supported()\n", "")
    res = run_patch(PATCH, before)
    assert status(res) == [Status.APPLIED]
    assert res.after == textwrap.dedent(FLAG_AFTER)


def refusal(run_patch, source: str) -> str:
    res = run_patch(PATCH, source)
    assert status(res) == [Status.REFUSED]
    assert not res.changed
    assert res.outcomes[0].site == "_is_sm120_supported"
    return res.outcomes[0].reason


def test_refuses_missing_sm100_flag(run_patch):
    src = FLAG_BEFORE.replace("_is_sm100_supported = _is_cuda and is_sm100_supported()\n", "")
    assert "found none" in refusal(run_patch, src)


def test_refuses_sm100_flag_twice(run_patch):
    src = FLAG_BEFORE + "_is_sm100_supported = _is_cuda and is_sm100_supported()\n"
    assert "2 assignments of _is_sm100_supported" in refusal(run_patch, src)


@pytest.mark.parametrize(
    "changed",
    [
        "_is_cuda or is_sm100_supported()",
        "is_sm100_supported()",
        "_is_cuda and is_sm100_supported(0)",
        "_is_cuda and get_platform().is_sm100_or_later",
        "_is_cuda and not _is_hip and is_sm100_supported()",
    ],
)
def test_refuses_sm100_flag_of_unknown_form(run_patch, changed):
    src = FLAG_BEFORE.replace("_is_cuda and is_sm100_supported()", changed)
    reason = refusal(run_patch, src)
    assert f"found `_is_sm100_supported = {changed}`" in reason


def test_refuses_sm120_flag_of_another_form(run_patch):
    src = FLAG_AFTER.replace(
        "_is_sm120_supported = _is_cuda and is_sm120_supported()",
        "_is_sm120_supported = is_cuda() and is_sm120_supported()",
    )
    reason = refusal(run_patch, src)
    assert "expected `_is_sm120_supported = _is_cuda and is_sm120_supported()`" in reason
    assert "found `_is_sm120_supported = is_cuda() and is_sm120_supported()`" in reason


def test_refuses_sm120_flag_twice(run_patch):
    src = FLAG_AFTER + "_is_sm120_supported = _is_cuda and is_sm120_supported()\n"
    assert "2 assignments" in refusal(run_patch, src)


def test_refuses_flag_without_its_import(run_patch):
    src = FLAG_AFTER.replace("    is_sm120_supported,\n", "")
    assert "no such import" in refusal(run_patch, src)


def test_refuses_when_the_import_cannot_be_placed(run_patch):
    # is_sm100_supported comes from another module: there is no import to extend.
    src = (
        FLAG_BEFORE.replace("    is_sm100_supported,\n", "")
        + "from sglang.srt.utils.common import is_sm100_supported\n"
    )
    assert "naming is_sm100_supported" in refusal(run_patch, src)


def test_chained_with_fusion_gate_on_one_parse():
    gate = load_patch("sglang.fusion-gate")
    fn = """

def apply_flashinfer_allreduce_fusion(batch_size: int):
    return (
        (_is_sm90_supported or _is_sm100_supported)
        and batch_size > 0
    )
"""
    before = textwrap.dedent(FLAG_BEFORE) + fn
    res = transform_text([PATCH, gate], "communicator.py", before)
    assert status(res) == [Status.APPLIED, Status.APPLIED]
    assert res.after == textwrap.dedent(FLAG_AFTER) + fn.replace(
        "_is_sm100_supported)", "_is_sm100_supported or _is_sm120_supported)"
    )
    # One commit per patch: the flag step alone, then the gate on top of it.
    assert [pid for pid, _ in res.step_texts()] == ["sglang.sm120-flag", "sglang.fusion-gate"]
    assert res.step_texts()[0][1] == textwrap.dedent(FLAG_AFTER) + fn
    again = transform_text([PATCH, gate], "communicator.py", res.after)
    assert status(again) == [Status.ALREADY_APPLIED, Status.ALREADY_APPLIED]
    assert not again.changed


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ({"add_norm": False, "communicator": True}, "communicator"),  # 0.5.2 to 0.5.20
        ({"add_norm": True, "communicator": False}, "add_norm"),  # 0.5.21 on
        # A tree holding both (a checkout mid-move): the file with the flags wins.
        ({"add_norm": "stub", "communicator": True}, "communicator"),
    ],
)
def test_pick_file_follows_the_flags(present, expected):
    gate = load_patch("sglang.fusion-gate")
    texts = {
        "sglang/srt/layers/layer_boundary/residual/add_norm.py": present["add_norm"],
        "sglang/srt/layers/communicator.py": present["communicator"],
    }

    def read(rel: str) -> str | None:
        has = texts.get(rel)
        if has is False or has is None:
            return None
        return "# moved\n" if has == "stub" else textwrap.dedent(FLAG_BEFORE)

    picked = PATCH.pick_file(read)
    assert picked is not None and expected in picked
    assert gate.pick_file(read) == picked
