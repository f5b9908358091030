"""The fp4-gemm profile's patches on fixtures in the shapes of the releases, and the patched
`auto` executed against stand-ins for torch and FlashInfer: flashinfer_b12x on SM120 only where
FlashInfer offers b12x, everything else as upstream decides."""

from __future__ import annotations

import sys
import types

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text
from sm120patch.plan import catalog

ENUM = load_patch("sglang.fp4-gemm-enum")
AUTO = load_patch("sglang.fp4-gemm-auto")
CHOICES = load_patch("sglang.fp4-gemm-choices")
AUTOTUNE = load_patch("sglang.fp4-gemm-autotune")

HEAD_0523 = """\
import logging
from enum import Enum

from sglang.srt.runtime_context import (
    get_exec,
    get_platform,
)
from sglang.srt.utils.common import (
    get_device_capability,
    is_cuda,
)

logger = logging.getLogger(__name__)
"""
HEAD_0513 = HEAD_0523.replace(
    "from sglang.srt.runtime_context import (\n    get_exec,\n    get_platform,\n)\n", ""
).replace("    is_cuda,\n)", "    is_cuda,\n    is_sm100_supported,\n)")
ENUM_CLASS = '''

class Fp4GemmRunnerBackend(Enum):
    """Enum for FP4 GEMM runner backend selection."""

    AUTO = "auto"
    FLASHINFER_CUDNN = "flashinfer_cudnn"
    FLASHINFER_CUTEDSL = "flashinfer_cutedsl"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    MARLIN = "marlin"

    def is_auto(self) -> bool:
        return self == Fp4GemmRunnerBackend.AUTO

    def is_flashinfer_trtllm(self) -> bool:
        return self == Fp4GemmRunnerBackend.FLASHINFER_TRTLLM

    def get_flashinfer_backend(self) -> str:
        if self.value.startswith("flashinfer_"):
            return self.value.removeprefix("flashinfer_")
        else:
            return self.value


FP4_GEMM_RUNNER_BACKEND = None
'''
INIT_0523 = '''

def initialize_fp4_gemm_config() -> None:
    """Initialize the FP4 GEMM backend from the published configuration."""
    global FP4_GEMM_RUNNER_BACKEND

    backend = get_exec().kernel.fp4_gemm_runner_backend
    if backend == "auto":
        if get_platform().is_sm100:
            backend = "flashinfer_cutedsl"
        elif is_cuda() and (10, 0) > get_device_capability() >= (8, 0):
            backend = "marlin"
        else:
            backend = "flashinfer_cutlass"

    FP4_GEMM_RUNNER_BACKEND = Fp4GemmRunnerBackend(backend)


def get_fp4_gemm_runner_backend():
    return FP4_GEMM_RUNNER_BACKEND
'''
INIT_0513 = (
    INIT_0523.replace("initialize_fp4_gemm_config()", "initialize_fp4_gemm_config(server_args)")
    .replace("get_exec().kernel.fp4_gemm_runner_backend", "server_args.fp4_gemm_runner_backend")
    .replace("get_platform().is_sm100", "is_sm100_supported()")
)
INIT_0512 = INIT_0513.replace(
    "        if is_sm100_supported():\n",
    "        if is_sm120_supported():\n"
    "            # flashinfer_cutlass produces NaN in dense MLP layers on SM120.\n"
    '            backend = "flashinfer_cudnn"\n'
    "        elif is_sm100_supported():\n",
).replace(
    "        elif is_cuda() and (10, 0) > get_device_capability() >= (8, 0):\n"
    '            backend = "marlin"\n',
    "",
)
HEAD_0512 = HEAD_0513.replace(
    "    is_sm100_supported,\n", "    is_sm100_supported,\n    is_sm120_supported,\n"
)
INIT_0508 = """

def initialize_fp4_gemm_config(server_args) -> None:
    global FP4_GEMM_RUNNER_BACKEND

    backend = server_args.fp4_gemm_runner_backend
    FP4_GEMM_RUNNER_BACKEND = Fp4GemmRunnerBackend(backend)
"""

V0523 = HEAD_0523 + ENUM_CLASS + INIT_0523
V0513 = HEAD_0513 + ENUM_CLASS + INIT_0513
V0512 = HEAD_0512 + ENUM_CLASS + INIT_0512
V0508 = HEAD_0513 + ENUM_CLASS + INIT_0508


def outcomes(text: str, patches=(ENUM, AUTO)):
    res = transform_text(list(patches), "sglang/srt/layers/quantization/fp4_utils.py", text)
    return res, {o.patch: o for o in res.outcomes}


@pytest.mark.parametrize(
    ("text", "auto_status", "test"),
    [
        (V0523, Status.APPLIED, "get_platform().is_sm120 and _flashinfer_offers_b12x()"),
        (V0513, Status.APPLIED, "is_sm120_supported() and _flashinfer_offers_b12x()"),
        (V0512, Status.APPLIED, "is_sm120_supported() and _flashinfer_offers_b12x()"),
        (V0508, Status.UPSTREAM, None),
    ],
    ids=["0.5.23", "0.5.13", "0.5.12", "0.5.8"],
)
def test_shapes(text: str, auto_status: Status, test: str | None) -> None:
    res, by = outcomes(text)
    assert by["sglang.fp4-gemm-enum"].status is Status.APPLIED, by["sglang.fp4-gemm-enum"].reason
    assert by["sglang.fp4-gemm-auto"].status is auto_status, by["sglang.fp4-gemm-auto"].reason
    assert (
        '    FLASHINFER_TRTLLM = "flashinfer_trtllm"\n    FLASHINFER_B12X = "flashinfer_b12x"\n'
        in res.after
    )
    assert (
        "    def is_flashinfer_b12x(self) -> bool:\n"
        "        return self == Fp4GemmRunnerBackend.FLASHINFER_B12X\n" in res.after
    )
    if test is not None:
        # the new branch first, the old first branch now an elif
        assert (
            f'    if backend == "auto":\n        if {test}:\n'
            '            backend = "flashinfer_b12x"\n' in res.after
        )
        assert "\n        elif " in res.after.split("def initialize_fp4_gemm_config")[1]
        assert res.after.count("def _flashinfer_offers_b12x() -> bool:") == 1
        assert res.after.count("is_sm120_supported,\n") == (test.startswith("is_sm120") and 1)
    again, by2 = outcomes(res.after)
    assert {o.status for o in again.outcomes} <= {Status.ALREADY_APPLIED, Status.UPSTREAM}
    assert again.after == res.after


def test_0512_keeps_upstreams_sm120_choice_after_ours() -> None:
    res, _ = outcomes(V0512)
    body = res.after.split("def initialize_fp4_gemm_config")[1]
    ours, theirs = body.index("flashinfer_b12x"), body.index("flashinfer_cudnn")
    assert ours < theirs and "# flashinfer_cutlass produces NaN" in body


@pytest.mark.parametrize(
    ("edit", "patch", "found"),
    [
        (
            lambda s: s.replace('self.value.removeprefix("flashinfer_")', "MAP[self.value]"),
            "sglang.fp4-gemm-enum",
            "another mapping",
        ),
        (
            lambda s: s.replace('    FLASHINFER_TRTLLM = "flashinfer_trtllm"\n', ""),
            "sglang.fp4-gemm-enum",
            "FLASHINFER_TRTLLM",
        ),
        (
            lambda s: s.replace(
                '    MARLIN = "marlin"\n', '    MARLIN = "marlin"\n    FLASHINFER_B12X = "b12x"\n'
            ),
            "sglang.fp4-gemm-enum",
            "FLASHINFER_B12X = 'b12x'",
        ),
        (
            lambda s: s.replace("        elif is_cuda()", "        elif is_sm120_supported()"),
            "sglang.fp4-gemm-auto",
            "2 forms",
        ),
        (
            lambda s: s + "\n\ndef _flashinfer_offers_b12x():\n    return True\n",
            "sglang.fp4-gemm-auto",
            "one of them without the other",
        ),
        (
            lambda s: s.replace("logger = logging.getLogger(__name__)\n", ""),
            "sglang.fp4-gemm-auto",
            "logger",
        ),
    ],
    ids=[
        "mapping",
        "no-trtllm-member",
        "other-b12x-member",
        "mixed-forms",
        "helper-alone",
        "no-logger",
    ],
)
def test_refusals(edit, patch: str, found: str) -> None:
    res, by = outcomes(edit(V0523), [p for p in (ENUM, AUTO) if p.id == patch])
    assert by[patch].status is Status.REFUSED and found in by[patch].reason, by[patch].describe()
    assert res.after == res.before


def test_upstream_where_the_release_picks_b12x_itself() -> None:
    """If PR 38170 lands as proposed (`elif is_cuda() and get_device_capability()[0] == 12`)."""
    text = V0523.replace(
        '        else:\n            backend = "flashinfer_cutlass"',
        "        elif is_cuda() and get_device_capability()[0] == 12:\n"
        '            backend = "flashinfer_b12x"\n'
        '        else:\n            backend = "flashinfer_cutlass"',
    )
    _, by = outcomes(text)
    assert by["sglang.fp4-gemm-auto"].status is Status.UPSTREAM


def test_crlf_kept() -> None:
    res, by = outcomes(V0523.replace("\n", "\r\n"))
    assert all(o.status is Status.APPLIED for o in by.values())
    assert res.after.count("\n") == res.after.count("\r\n")


# ---- the patched code, executed ------------------------------------------------------------


def stand_ins(monkeypatch, *, capability, cuda, backends, minimum=None) -> None:
    """torch and FlashInfer as the helper reads them: a GPU's capability, FlashInfer's CUDA
    version and which mm_fp4 backends it has for which capability."""
    from packaging.version import Version

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(get_device_capability=lambda *a: capability)
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.__path__ = []

    def mm_fp4(*args, **kwargs):
        raise AssertionError("not called here")

    mm_fp4.is_backend_supported = lambda b, cc=None: b in backends and (cc in backends[b])
    flashinfer.mm_fp4 = mm_fp4
    gemm = types.ModuleType("flashinfer.gemm")
    gemm.__path__ = []
    gemm_base = types.ModuleType("flashinfer.gemm.gemm_base")
    if minimum is not None:
        gemm_base._MIN_B12X_CUDA_VERSION = Version(minimum)
    gemm.gemm_base = gemm_base
    jit = types.ModuleType("flashinfer.jit")
    jit.__path__ = []
    cpp_ext = types.ModuleType("flashinfer.jit.cpp_ext")
    cpp_ext.get_cuda_version = lambda: Version(cuda)
    for name, module in {
        "torch": torch,
        "flashinfer": flashinfer,
        "flashinfer.gemm": gemm,
        "flashinfer.gemm.gemm_base": gemm_base,
        "flashinfer.jit": jit,
        "flashinfer.jit.cpp_ext": cpp_ext,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)


B12X = {"b12x": {120, 121}, "cutlass": {100, 120, 121}}


def load(text: str, arch: str, requested: str = "auto") -> dict:
    """The module `text` (after its imports) run for a GPU of `arch`, `initialize_fp4_gemm_config`
    called with `requested`: the module's namespace."""
    scope: dict = {}
    code = text.split("logger = logging.getLogger(__name__)\n", 1)[1]
    major = {"sm120": 12, "sm100": 10, "sm90": 9}[arch]
    platform = types.SimpleNamespace(is_sm100=arch == "sm100", is_sm120=arch == "sm120")
    scope.update(
        Enum=__import__("enum").Enum,
        logger=types.SimpleNamespace(info=lambda *a: None),
        get_exec=lambda: types.SimpleNamespace(
            kernel=types.SimpleNamespace(fp4_gemm_runner_backend=requested)
        ),
        get_platform=lambda: platform,
        is_cuda=lambda: True,
        get_device_capability=lambda: (major, 0),
    )
    exec(compile(code, "fp4_utils.py", "exec"), scope)
    scope["initialize_fp4_gemm_config"]()
    return scope


def resolve(text: str, arch: str, requested: str = "auto") -> str:
    return load(text, arch, requested)["FP4_GEMM_RUNNER_BACKEND"].value


@pytest.mark.parametrize(
    ("arch", "capability", "cuda", "backends", "minimum", "want"),
    [
        ("sm120", (12, 0), "13.0", B12X, None, "flashinfer_b12x"),
        ("sm120", (12, 1), "13.0", B12X, None, "flashinfer_b12x"),
        ("sm120", (12, 0), "12.9", B12X, None, "flashinfer_cutlass"),  # b12x wants CUDA 13
        ("sm120", (12, 0), "12.9", B12X, "12.9", "flashinfer_b12x"),  # FlashInfer 0.7's minimum
        ("sm120", (12, 0), "13.0", {"cutlass": {120}}, None, "flashinfer_cutlass"),  # < 0.6.9
        ("sm100", (10, 0), "13.0", B12X, None, "flashinfer_cutedsl"),
        ("sm90", (9, 0), "13.0", B12X, None, "marlin"),
    ],
    ids=["sm120", "sm121", "cuda-12.9", "fi-0.7-minimum", "no-b12x", "sm100", "sm90"],
)
def test_patched_auto_decides(monkeypatch, arch, capability, cuda, backends, minimum, want):
    stand_ins(monkeypatch, capability=capability, cuda=cuda, backends=backends, minimum=minimum)
    patched = outcomes(V0523)[0].after
    assert resolve(patched, arch) == want
    if want != "flashinfer_b12x":  # off the SM120 path: what the pristine code picks
        assert resolve(V0523, arch) == want


def test_helper_says_no_when_flashinfer_is_missing(monkeypatch) -> None:
    stand_ins(monkeypatch, capability=(12, 0), cuda="13.0", backends=B12X)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    assert resolve(outcomes(V0523)[0].after, "sm120") == "flashinfer_cutlass"


def test_explicit_choice_is_kept_and_maps_to_b12x(monkeypatch) -> None:
    stand_ins(monkeypatch, capability=(12, 0), cuda="13.0", backends=B12X)
    patched = outcomes(V0523)[0].after
    assert resolve(patched, "sm120", "flashinfer_cutlass") == "flashinfer_cutlass"
    chosen = load(patched, "sm100", "flashinfer_b12x")["FP4_GEMM_RUNNER_BACKEND"]
    assert chosen.get_flashinfer_backend() == "b12x" and chosen.is_flashinfer_b12x()
    with pytest.raises(ValueError):  # the pristine enum has no such member
        load(V0523, "sm120", "flashinfer_b12x")


# ---- choices and autotune ------------------------------------------------------------------

CHOICES_TEXT = """\
FP4_GEMM_RUNNER_BACKEND_CHOICES = [
    "auto",
    "flashinfer_cudnn",
    "flashinfer_cutedsl",
    "flashinfer_cutlass",
    "flashinfer_trtllm",
    "marlin",
]

add_fp4_gemm_runner_backend_choices = FP4_GEMM_RUNNER_BACKEND_CHOICES.extend
"""


def test_choices_appends_one_line() -> None:
    res = transform_text([CHOICES], "sglang/srt/arg_groups/choices.py", CHOICES_TEXT)
    assert res.outcomes[0].status is Status.APPLIED
    assert res.after == CHOICES_TEXT.replace(
        '    "marlin",\n', '    "marlin",\n    "flashinfer_b12x",\n'
    )
    again = transform_text([CHOICES], "c.py", res.after)
    assert again.outcomes[0].status is Status.ALREADY_APPLIED


def test_choices_refuses_a_list_it_does_not_know() -> None:
    res = transform_text([CHOICES], "c.py", 'FP4_GEMM_RUNNER_BACKEND_CHOICES = ["auto"]\n')
    assert (
        res.outcomes[0].status is Status.REFUSED and "flashinfer_cutlass" in res.outcomes[0].reason
    )


AUTOTUNE_TEXT = """\
def should_run_flashinfer_autotune(model_runner, *, for_speculative_draft=False):
    mr = model_runner
    model_uses_fp4 = mr.model_config.quantization in ("modelopt_fp4", "modelopt_mixed")
    fp4_gemm_needs_autotune = model_uses_fp4 and (
        get_fp4_gemm_runner_backend().is_flashinfer_cutlass()
        or get_fp4_gemm_runner_backend().is_flashinfer_cutedsl()
    )
    return fp4_gemm_needs_autotune
"""


def test_autotune_gains_b12x() -> None:
    res = transform_text([AUTOTUNE], "a.py", AUTOTUNE_TEXT)
    assert res.outcomes[0].status is Status.APPLIED, res.outcomes[0].reason
    assert res.after == AUTOTUNE_TEXT.replace(
        "        or get_fp4_gemm_runner_backend().is_flashinfer_cutedsl()\n",
        "        or get_fp4_gemm_runner_backend().is_flashinfer_cutedsl()\n"
        "        or get_fp4_gemm_runner_backend().is_flashinfer_b12x()\n",
    )
    assert transform_text([AUTOTUNE], "a.py", res.after).outcomes[0].status is (
        Status.ALREADY_APPLIED
    )


def test_autotune_before_fp4_terms_is_not_applicable() -> None:
    text = "def _should_run_flashinfer_autotune(self):\n    return True\n"
    assert transform_text([AUTOTUNE], "a.py", text).outcomes[0].status is Status.NOT_APPLICABLE


# ---- the profile ---------------------------------------------------------------------------


def test_profile_pins_and_the_0612_refusal() -> None:
    prof = catalog.load().profile("fp4-gemm")
    assert prof.status == "experimental"
    assert prof.patches == (
        "sglang.fp4-gemm-enum",
        "sglang.fp4-gemm-auto",
        "sglang.fp4-gemm-choices",
        "sglang.fp4-gemm-autotune",
    )
    assert prof.pinned("sglang", "0.5.8") and prof.pinned("sglang", "0.5.23")
    assert not prof.pinned("sglang", "0.5.7")
    assert prof.pinned("flashinfer", "0.6.13") and prof.pinned("flashinfer", "0.7.4")
    problems = catalog.pin_problems(prof, {"flashinfer": "0.6.12"}) + catalog.refusal_problems(
        prof, {"flashinfer": "0.6.12"}
    )
    assert problems and "0.6.12" in problems[0]
    if hasattr(prof, "refusals"):  # refuse tables with their reasons (the moe work adds them)
        assert any("issues/3398" in p for p in problems), problems
    others = [
        n
        for n, p in catalog.load().profiles.items()
        if n != "fp4-gemm" and set(p.patches) & set(prof.patches)
    ]
    assert others == []  # judged by trial, never part of `all`


# ---- explain -------------------------------------------------------------------------------


def test_explain_lines_for_fp4_and_attention() -> None:
    """What the probe reports becomes two `explain` lines: the backend `auto` resolves to, and
    the launch's attention backend."""
    from sm120patch.explain import explain

    def result(fp4: str, attention: str) -> dict:
        return {
            "launches": {"launch": {"server_args": {"attention_backend": attention}}},
            "fp4_gemm": {"backends": {"auto": {"value": fp4}}},
        }

    found = explain.Explanation(
        python="py", simulate="sm120", launch=["--model-path", "m"], targets=[], applied=False,
        pristine=explain.decision(result("flashinfer_cutlass", "flashinfer"), "launch"),
        patched=explain.decision(result("flashinfer_b12x", "trtllm_mha"), "launch"),
    )
    rows = {label: (a, b) for label, a, b in found.rows()}
    assert rows["FP4 GEMM backend (auto)"] == ("flashinfer_cutlass", "flashinfer_b12x")
    assert rows["attention backend"] == ("flashinfer", "trtllm_mha")
    missing = {"fp4_gemm": {"error": "ModuleNotFoundError: No module named 'sglang.srt.layers."
                            "quantization.fp4_utils'"}}
    assert explain.decision(missing, None).fp4_gemm_backend == "not in this release"
    assert explain.decision({}, None).fp4_gemm_backend == "not checked"
