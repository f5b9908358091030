from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("sglang.fusion-backend")

# 0.5.14 to 0.5.18: is_sm120_supported is not imported yet.
CALL = '''
from sglang.srt.utils import (
    ceil_align,
    is_sm90_supported,
    is_sm100_supported,
)


def _mnnvl_supported(is_multi_node):
    if is_sm100_supported():
        return True
    return is_sm90_supported() and not is_multi_node


def _resolve_backend(backend, is_multi_node=False):
    if not (is_sm90_supported() or is_sm100_supported()):
        raise ValueError(
            "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."
        )
    if backend == "auto":
        if is_sm100_supported():
            return "mnnvl"
        return "trtllm"
    return backend
'''
CALL_AFTER = CALL.replace(
    "    is_sm100_supported,\n)",
    "    is_sm100_supported,\n    is_sm120_supported,\n)",
).replace(
    "if not (is_sm90_supported() or is_sm100_supported()):",
    "if not (is_sm90_supported() or is_sm100_supported() or is_sm120_supported()):",
)

# The same with is_sm120_supported already imported: no import is added.
CALL_IMPORTED = CALL.replace("    ceil_align,\n", "    ceil_align,\n    is_sm120_supported,\n")
CALL_IMPORTED_AFTER = CALL_IMPORTED.replace(
    "if not (is_sm90_supported() or is_sm100_supported()):",
    "if not (is_sm90_supported() or is_sm100_supported() or is_sm120_supported()):",
)

# 0.5.19 to 0.5.23: get_platform() form; the cutedsl check (0.5.23) is that backend's own.
PLATFORM = '''
from sglang.srt.runtime_context import get_platform


def _resolve_backend(backend, is_multi_node=False):
    """Resolve the requested FlashInfer allreduce fusion backend."""
    if not (get_platform().is_sm90 or get_platform().is_sm100):
        raise ValueError("FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.")
    if backend == "cutedsl":
        if not get_platform().is_sm100:
            raise ValueError("cutedsl backend requires a Blackwell system.")
        return backend
    return backend
'''
PLATFORM_AFTER = PLATFORM.replace(
    "if not (get_platform().is_sm90 or get_platform().is_sm100):",
    "if not (get_platform().is_sm90 or get_platform().is_sm100 or get_platform().is_sm120):",
)

CHECK = (
    "    if not (get_platform().is_sm90 or get_platform().is_sm100):\n"
    '        raise ValueError("FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.")\n'
)
RAISE = CHECK.splitlines(keepends=True)[1]

APPLIED = {
    "call": (CALL, CALL_AFTER),
    "call-imported": (CALL_IMPORTED, CALL_IMPORTED_AFTER),
    "platform": (PLATFORM, PLATFORM_AFTER),
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


def test_keeps_error_message_and_other_checks(run_patch):
    res = run_patch(PATCH, PLATFORM)
    assert "requires SM90 or SM10X NVIDIA GPUs." in res.after
    assert "        if not get_platform().is_sm100:\n" in res.after


def test_blackwell_is_upstream(run_patch):
    src = PLATFORM.replace("get_platform().is_sm100):", "get_platform().is_blackwell):")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.UPSTREAM
    assert not res.changed


def test_no_function_is_not_applicable(run_patch):
    # Before 0.5.14 the module exists without _resolve_backend.
    res = run_patch(PATCH, "def flashinfer_allreduce_residual_rmsnorm(x):\n    return x\n")
    assert _one(res).status is Status.NOT_APPLICABLE
    assert not res.changed


def test_refuses_function_twice(run_patch):
    twice = PLATFORM + "\n\n" + PLATFORM.split("\n\n\n")[1]
    res = run_patch(PATCH, twice)
    assert _one(res).status is Status.REFUSED
    assert "2 definitions" in _one(res).reason


def test_refuses_unknown_form(run_patch):
    src = CALL.replace(
        "if not (is_sm90_supported() or is_sm100_supported()):",
        "if not (is_sm90_supported() and is_sm100_supported()):",
    )
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "is_sm90_supported() and is_sm100_supported()" in _one(res).reason
    assert _one(res).site == "_resolve_backend"
    assert not res.changed


def test_refuses_other_archs(run_patch):
    src = PLATFORM.replace("or get_platform().is_sm100)", "or get_platform().is_sm89)")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED


def test_refuses_check_missing(run_patch):
    src = PLATFORM.replace(CHECK, "")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "no GPU-arch check" in _one(res).reason


def test_refuses_check_without_raise(run_patch):
    src = PLATFORM.replace(RAISE, '        return "none"\n')
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED


def test_refuses_several_checks(run_patch):
    res = run_patch(PATCH, PLATFORM.replace(CHECK, CHECK + CHECK))
    assert _one(res).status is Status.REFUSED
    assert "several" in _one(res).reason
    assert not res.changed


def test_refuses_without_import_to_extend(run_patch):
    # is_sm100_supported defined here, not imported: no import to put SM120's next to.
    local = "\n\ndef is_sm100_supported():\n    return False\n"
    src = CALL.replace("    is_sm100_supported,\n", "") + local
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert "naming is_sm100_supported, to add is_sm120_supported" in _one(res).reason


def test_refuses_sm120_used_but_not_imported(run_patch):
    src = CALL_AFTER.replace("    is_sm120_supported,\n", "")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            "if not (get_platform().is_sm100 or get_platform().is_sm90):",
            "if not (get_platform().is_sm100 or get_platform().is_sm90"
            " or get_platform().is_sm120):",
        ),
        (
            "if not (\n        get_platform().is_sm90\n        or get_platform().is_sm100\n    ):",
            "if not (\n        get_platform().is_sm90\n        or get_platform().is_sm100\n"
            "        or get_platform().is_sm120\n    ):",
        ),
    ],
    ids=["reversed", "broken over lines"],
)
def test_formatting_variants(run_patch, old, new):
    anchor = "if not (get_platform().is_sm90 or get_platform().is_sm100):"
    res = run_patch(PATCH, PLATFORM.replace(anchor, old))
    assert _one(res).status is Status.APPLIED, _one(res).reason
    assert res.after == textwrap.dedent(PLATFORM.replace(anchor, new))
