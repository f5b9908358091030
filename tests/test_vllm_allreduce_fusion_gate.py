"""vllm.allreduce-fusion-gate on fixtures in the shapes of vLLM 0.30-0.33 (`current_platform`
imported inside the selector) and 0.34 (imported at module level), before/after; refusals,
upstream, already-applied; and the selector itself run under a simulated SM120, SM100 and SM90."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("vllm.allreduce-fusion-gate")

# 0.34.0: vllm/config/vllm.py, `current_platform` imported at module level
SELECTOR = '''
from vllm.platforms import current_platform


def enable_allreduce_rms_fusion(cfg: "VllmConfig") -> bool:
    """Enable if TP > 1 and Hopper/Blackwell and flashinfer installed."""
    from vllm.utils.flashinfer import has_flashinfer

    # The fused all-reduce + RMSNorm path is not batch-invariant
    if envs.VLLM_BATCH_INVARIANT:
        return False

    if current_platform.is_rocm():
        from vllm._aiter_ops import rocm_aiter_ops

        return (
            rocm_aiter_ops.is_enabled() and cfg.parallel_config.tensor_parallel_size > 1
        )

    return (
        cfg.parallel_config.tensor_parallel_size > 1
        and current_platform.is_cuda()
        and has_flashinfer()
        and (
            current_platform.is_device_capability_family(100)
            or current_platform.is_device_capability(90)
        )
    )
'''

# 0.30.0 to 0.33.0: the same, `current_platform` imported inside the function
SELECTOR_030 = SELECTOR.replace("from vllm.platforms import current_platform\n\n\n", "").replace(
    "    from vllm.utils.flashinfer import has_flashinfer\n",
    "    from vllm.platforms import current_platform\n"
    "    from vllm.utils.flashinfer import has_flashinfer\n",
)


def one(res):
    [outcome] = res.outcomes
    return outcome


@pytest.mark.parametrize("source", [SELECTOR, SELECTOR_030], ids=["0.34", "0.30-0.33"])
def test_exact_diff_and_already_applied(run_patch, source):
    res = run_patch(PATCH, source)
    assert one(res).status is Status.APPLIED, one(res).describe()
    assert one(res).site == "enable_allreduce_rms_fusion"
    want = textwrap.dedent(source).replace(
        "            or current_platform.is_device_capability(90)\n",
        "            or current_platform.is_device_capability(90)\n"
        "            or current_platform.is_device_capability(120)\n",
    )
    assert res.after == want
    again = run_patch(PATCH, res.after)
    assert one(again).status is Status.ALREADY_APPLIED and again.after == res.after


def test_crlf_kept(run_patch):
    res = run_patch(PATCH, textwrap.dedent(SELECTOR).replace("\n", "\r\n"))
    assert one(res).status is Status.APPLIED
    assert res.after.count("\n") == res.after.count("\r\n")


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        # an SM100 check that is exactly 10.0 (before vLLM PR 37755): a group the patch
        # was not written for
        (lambda s: s.replace("is_device_capability_family(100)", "is_device_capability(100)"),
         Status.REFUSED, "is_device_capability(100)"),
        (lambda s: s.replace("or current_platform.is_device_capability(90)",
                             "or other_platform.is_device_capability(90)"),
         Status.REFUSED, "other_platform"),
        (lambda s: s.replace("if envs.VLLM_BATCH_INVARIANT:",
                             "if current_platform.is_device_capability(89) or "
                             "current_platform.is_device_capability(80):"),
         Status.REFUSED, "one `or` of capability checks"),
        (lambda s: s.replace("def enable_allreduce_rms_fusion", "def enable_other"),
         Status.NOT_APPLICABLE, "enable_allreduce_rms_fusion"),
        (lambda s: s.replace("            or current_platform.is_device_capability(90)\n",
                             "            or current_platform.is_device_capability(90)\n"
                             "            or current_platform.is_device_capability_family(120)\n"),
         Status.UPSTREAM, "is_device_capability_family(120)"),
        (lambda s: s.replace("is_device_capability_family(100)", "has_device_capability(100)"),
         Status.UPSTREAM, "has_device_capability(100)"),
    ],
    ids=["exact-sm100", "other-receiver", "two-groups", "no-selector", "upstream-family-120",
         "upstream-has-100"],
)
def test_refusals_and_upstream(run_patch, edit, status, found):
    res = run_patch(PATCH, edit(textwrap.dedent(SELECTOR)))
    assert one(res).status is status and found in one(res).reason, one(res).describe()
    assert res.after == res.before


class FakePlatform:
    """vLLM's capability checks (vllm/platforms/interface.py) on one simulated GPU."""

    def __init__(self, major: int, minor: int) -> None:
        self.cap = major * 10 + minor

    def is_rocm(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def is_device_capability(self, c: int) -> bool:
        return self.cap == c

    def is_device_capability_family(self, c: int) -> bool:
        return self.cap // 10 == c // 10

    def has_device_capability(self, c: int) -> bool:
        return self.cap >= c


def _selector(source: str, platform: FakePlatform, tp: int) -> bool:
    """Run `enable_allreduce_rms_fusion` of `source` with `platform` and FlashInfer present."""
    import sys
    import types

    fake = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.utils": types.ModuleType("vllm.utils"),
        "vllm.utils.flashinfer": types.ModuleType("vllm.utils.flashinfer"),
    }
    fake["vllm.platforms"].current_platform = platform  # type: ignore[attr-defined]
    fake["vllm.utils.flashinfer"].has_flashinfer = lambda: True  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in fake}
    sys.modules.update(fake)
    try:
        namespace: dict = {"envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)}
        exec(compile(textwrap.dedent(source), "vllm/config/vllm.py", "exec"), namespace)
        cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))
        return bool(namespace["enable_allreduce_rms_fusion"](cfg))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@pytest.mark.parametrize("source", [SELECTOR, SELECTOR_030], ids=["0.34", "0.30-0.33"])
@pytest.mark.parametrize(
    ("cap", "tp", "pristine", "patched"),
    [
        ((12, 0), 2, False, True),  # the point of the patch
        ((12, 1), 2, False, False),  # SM121: no size row either, left as released
        ((10, 0), 2, True, True),
        ((10, 3), 4, True, True),
        ((9, 0), 8, True, True),
        ((8, 9), 2, False, False),
        ((12, 0), 1, False, False),  # TP1: nothing to fuse
    ],
)
def test_selector_on_simulated_gpus(run_patch, source, cap, tp, pristine, patched):
    after = run_patch(PATCH, source).after
    assert _selector(source, FakePlatform(*cap), tp) is pristine
    assert _selector(after, FakePlatform(*cap), tp) is patched
