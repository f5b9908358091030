"""sglang.gdn-prefill on sources we write in the shape of gdn_backend.py (0.5.19 to 0.5.23)."""

from __future__ import annotations

import ast
import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog

PATCH = load_patch("sglang.gdn-prefill")

# The function's shape: early returns with the arch admission, an SM100 branch with its CUDA
# floor, an else for SM90, then the chunk and state-dtype checks.
BEFORE = '''
import torch


def flashinfer_gdn_prefill_default(model_runner):
    """Pick FlashInfer where validated."""
    sm_major = torch.cuda.get_device_capability()[0]
    if (
        backend_override() is not None
        or sm_major not in (9, 10)
    ):
        return None

    cuda_version = torch.version.cuda
    if sm_major == 10:
        if cuda_version is None or int(cuda_version.split(".", 1)[0]) < 13:
            return None
        max_chunk = 8192
        expected_state_dtype = torch.bfloat16
    else:
        max_chunk = 32768
        expected_state_dtype = torch.float32

    if not 1 <= chunk_size() <= max_chunk or state_dtype() != expected_state_dtype:
        return None
    return "flashinfer"
'''

SM120_BRANCH = '''\
    elif sm_major == 12:
        # sm120patch gdn-prefill: FlashInfer's SM120 GDN prefill kernel (FlashInfer 0.6.14+)
        # needs CUDA 13 and an fp32 state; without the kernel, Triton as upstream.
        if cuda_version is None or int(cuda_version.split(".", 1)[0]) < 13:
            return None
        try:
            from flashinfer.gdn_kernels import chunk_gated_delta_rule_sm120
        except (ImportError, RuntimeError):
            return None
        if chunk_gated_delta_rule_sm120 is None:
            return None
        max_chunk = 8192
        expected_state_dtype = torch.float32
'''
AFTER = BEFORE.replace("sm_major not in (9, 10)", "sm_major not in (9, 10, 12)").replace(
    "    else:\n        max_chunk = 32768", SM120_BRANCH + "    else:\n        max_chunk = 32768"
)


def _one(res):
    assert len(res.outcomes) == 1
    return res.outcomes[0]


def test_applies(run_patch):
    res = run_patch(PATCH, BEFORE)
    assert _one(res).status is Status.APPLIED, _one(res).reason
    assert res.after == textwrap.dedent(AFTER)
    assert AFTER != BEFORE


def test_second_run_is_already_applied(run_patch):
    first = run_patch(PATCH, BEFORE)
    second = run_patch(PATCH, first.after)
    assert _one(second).status is Status.ALREADY_APPLIED, _one(second).reason
    assert second.after == first.after


def decide(source: str, *, major: int, cuda: str | None, chunk: int, state: str,
           kernel: object = "loaded") -> str | None:
    """Run the function of `source` with the GPU, CUDA, chunk size, state dtype and
    FlashInfer SM120 kernel given (a fake torch and flashinfer in its namespace)."""
    import sys
    import types

    torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_device_capability=lambda: (major, 0)),
        version=types.SimpleNamespace(cuda=cuda), bfloat16="bf16", float32="fp32")
    fi = types.ModuleType("flashinfer")
    kernels = types.ModuleType("flashinfer.gdn_kernels")
    if kernel != "absent":
        kernels.chunk_gated_delta_rule_sm120 = None if kernel is None else object()  # type: ignore[attr-defined]
    fi.gdn_kernels = kernels  # type: ignore[attr-defined]
    namespace = {"backend_override": lambda: None, "chunk_size": lambda: chunk,
                 "state_dtype": lambda: state}
    code = compile(textwrap.dedent(source).replace("import torch\n", ""), "gdn.py", "exec")
    saved = {k: sys.modules.get(k) for k in ("flashinfer", "flashinfer.gdn_kernels")}
    sys.modules.update({"flashinfer": fi, "flashinfer.gdn_kernels": kernels})
    try:
        namespace["torch"] = torch
        exec(code, namespace)
        return namespace["flashinfer_gdn_prefill_default"](None)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@pytest.mark.parametrize(("major", "cuda", "chunk", "state", "kernel", "want"), [
    (12, "13.0", 8192, "fp32", "loaded", "flashinfer"),
    (12, "13.0", 8193, "fp32", "loaded", None),  # over SM120's chunk limit
    (12, "13.0", 4096, "bf16", "loaded", None),  # a bf16 state pool: the kernel wants fp32
    (12, "12.9", 4096, "fp32", "loaded", None),  # CUDA before 13
    (12, None, 4096, "fp32", "loaded", None),
    (12, "13.0", 4096, "fp32", None, None),  # FlashInfer's SM120 import failed
    (12, "13.0", 4096, "fp32", "absent", None),  # a FlashInfer before 0.6.14
])
def test_sm120_domain(major, cuda, chunk, state, kernel, want):
    assert decide(AFTER, major=major, cuda=cuda, chunk=chunk, state=state, kernel=kernel) == want
    # The release's own code keeps SM120 on Triton whatever the rest.
    assert decide(BEFORE, major=major, cuda=cuda, chunk=chunk, state=state, kernel=kernel) is None


@pytest.mark.parametrize("major", [9, 10, 8, 11])
@pytest.mark.parametrize("chunk", [4096, 16384])
@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("cuda", ["12.8", "13.0"])
def test_other_archs_decide_as_released(major, chunk, state, cuda):
    kw = dict(major=major, cuda=cuda, chunk=chunk, state=state)
    assert decide(AFTER, **kw) == decide(BEFORE, **kw)


def test_the_kernel_is_imported_only_on_sm120():
    # A FlashInfer without the SM120 symbol changes nothing on SM100.
    kw = dict(cuda="13.0", chunk=4096, state="bf16", kernel="absent")
    assert decide(AFTER, major=10, **kw) == "flashinfer" == decide(BEFORE, major=10, **kw)


def test_release_admitting_sm120_itself_is_upstream(run_patch):
    theirs = AFTER.replace("            from flashinfer.gdn_kernels import chunk_gated_delta_rule_sm120\n", "            pass\n")
    res = run_patch(PATCH, theirs)
    assert _one(res).status is Status.UPSTREAM, _one(res).reason
    assert not res.changed


@pytest.mark.parametrize(("old", "new", "why"), [
    ("sm_major not in (9, 10)", "sm_major < 9", "0 `sm_major not in (9, 10)` tests"),
    ("    else:\n        max_chunk = 32768\n", "", "followed by no else"),
    ("if sm_major == 10:", "if sm_major >= 10:", "0 `if sm_major == 10:`"),
    ("        max_chunk = 8192\n", "", "without the CUDA, chunk and state dtype"),
])
def test_refuses_other_shapes(run_patch, old, new, why):
    src = BEFORE.replace(old, new)
    assert src != BEFORE
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED
    assert why in _one(res).reason
    assert not res.changed


def test_admitted_without_branch_is_refused(run_patch):
    src = BEFORE.replace("sm_major not in (9, 10)", "sm_major not in (9, 10, 12)")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.REFUSED


def test_sm100_only_default_is_not_applicable(run_patch):
    # 0.5.17 and 0.5.18: one SM100 domain, no per-arch rows.
    src = BEFORE.replace("or sm_major not in (9, 10)",
                         "or torch.cuda.get_device_capability()[0] != 10")
    res = run_patch(PATCH, src)
    assert _one(res).status is Status.NOT_APPLICABLE, _one(res).reason
    assert not res.changed


def test_no_site_is_not_applicable(run_patch):
    res = run_patch(PATCH, "def other():\n    return None\n")
    assert _one(res).status is Status.NOT_APPLICABLE


def test_check_passes_the_patch_and_fails_wrong_edits():
    fact = next(f for f in PATCH.facts if f.status is Status.APPLIED)
    before = ast.parse(textwrap.dedent(BEFORE))
    assert PATCH.check is not None
    PATCH.check(before, ast.parse(textwrap.dedent(AFTER)), fact)
    wrong = {
        "no kernel check": AFTER.replace("        if chunk_gated_delta_rule_sm120 is None:\n"
                                         "            return None\n", ""),
        "a bf16 state": AFTER.replace("expected_state_dtype = torch.float32\n    else",
                                      "expected_state_dtype = torch.bfloat16\n    else"),
        "SM90 changed": AFTER.replace("max_chunk = 32768", "max_chunk = 65536"),
        "not admitted": AFTER.replace("(9, 10, 12)", "(9, 10)"),
        "no-op": BEFORE,
    }
    for what, text in wrong.items():
        with pytest.raises(AssertionError):
            PATCH.check(before, ast.parse(textwrap.dedent(text)), fact)
        del what


def test_profile_refuses_flashinfer_without_the_kernel():
    prof = catalog.load().profile("gdn-prefill")
    assert prof.patches == ("sglang.gdn-prefill",)
    assert prof.status == "experimental"
    [refusal] = [r for r in prof.refuse if r.kind == "flashinfer"]
    assert refusal.refuses("0.6.13") and not refusal.refuses("0.6.14")
