"""sglang.moe-runner-auto on small fixtures in the shapes of the releases, and the patched
`create_moe_runner` executed against stand-ins: flashinfer_cutlass (with the weights prepared
for it) on SM120 without expert parallelism, everything else as upstream decides."""

from __future__ import annotations

import enum
import sys
import types

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text

PATCH = load_patch("sglang.moe-runner-auto")
FILE = "sglang/srt/layers/quantization/modelopt_quant.py"

# The FP8 method has a create_moe_runner too: the patch must keep to the NVFP4 class.
FP8_METHOD = """\
class ModelOptFp8MoEMethod:
    def create_moe_runner(self, layer, moe_runner_config):
        self.runner = MoeRunner(get_moe_runner_backend(), moe_runner_config)

"""
PROPERTY = '''\
    @property
    def enable_flashinfer_cutlass_moe(self) -> bool:
        from sglang.srt.layers.moe import get_moe_runner_backend

        """The global setting (a string after the import, as the releases have it)."""
        return get_moe_runner_backend().is_flashinfer_cutlass()

'''
# 0.5.13 on: Marlin for SM80 to SM90, TRT-LLM otherwise; the choice kept for apply().
CHOICE_0513 = """\
    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        moe_runner_backend = get_moe_runner_backend()

        if moe_runner_backend.is_auto():
            if is_cuda() and (8, 0) <= get_device_capability() < (10, 0):
                moe_runner_backend = MoeRunnerBackend.MARLIN
            else:
                # a comment of upstream's above the TRT-LLM default
                moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM

        self._moe_runner_backend = moe_runner_backend
        self.runner = MoeRunner(moe_runner_backend, moe_runner_config)
"""
# 0.5.11, 0.5.12: TRT-LLM on every GPU, the choice not kept.
CHOICE_0511 = """\
    def create_moe_runner(self, layer, moe_runner_config):
        moe_runner_backend = get_moe_runner_backend()
        if moe_runner_backend.is_auto():
            moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM
        if not moe_runner_backend.is_flashinfer_cutlass():
            self.runner = MoeRunner(moe_runner_backend, moe_runner_config)
"""
# Before 0.5.11: no `auto` choice at all.
CHOICE_0509 = """\
    def create_moe_runner(self, layer, moe_runner_config):
        if get_moe_runner_backend().is_flashinfer_trtllm():
            self.runner = MoeRunner(MoeRunnerBackend.FLASHINFER_TRTLLM, moe_runner_config)
"""
HEAD = "class ModelOptNvFp4FusedMoEMethod:\n"
V0523 = FP8_METHOD + HEAD + PROPERTY + CHOICE_0513
V0511 = FP8_METHOD + HEAD + PROPERTY + CHOICE_0511
V0509 = FP8_METHOD + HEAD + PROPERTY + CHOICE_0509

SM120 = (
    'is_cuda() and (12, 0) <= get_device_capability() < (13, 0) and getattr(layer, '
    '"moe_ep_size", None) == 1'
)
PATCHED = V0523.replace(
    "                moe_runner_backend = MoeRunnerBackend.MARLIN\n",
    "                moe_runner_backend = MoeRunnerBackend.MARLIN\n"
    f"            elif {SM120}:\n"
    "                # sm120patch moe: SM120 cannot run TRT-LLM-gen MoE; FlashInfer's CUTLASS MoE "
    "runs there.\n"
    "                moe_runner_backend = MoeRunnerBackend.FLASHINFER_CUTLASS\n"
    "                self._sm120_auto_flashinfer_cutlass = True\n",
).replace(
    "        return get_moe_runner_backend().is_flashinfer_cutlass()\n",
    "        return get_moe_runner_backend().is_flashinfer_cutlass() or getattr(self, "
    '"_sm120_auto_flashinfer_cutlass", False)\n',
)


def run(text: str):
    res = transform_text([PATCH], FILE, text)
    return res, res.outcomes[0]


def test_applies_exactly_and_once() -> None:
    res, out = run(V0523)
    assert out.status is Status.APPLIED, out.reason
    assert res.after == PATCHED
    again, out2 = run(res.after)
    assert out2.status is Status.ALREADY_APPLIED, out2.reason
    assert again.after == res.after


def test_crlf_kept() -> None:
    res, out = run(V0523.replace("\n", "\r\n"))
    assert out.status is Status.APPLIED, out.reason
    assert res.after == PATCHED.replace("\n", "\r\n")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (V0511, "apply() never reads that choice"),
        (V0509, "no `auto` choice"),
        (FP8_METHOD, "no class ModelOptNvFp4FusedMoEMethod"),
    ],
    ids=["0.5.11", "0.5.9", "no-class"],
)
def test_not_applicable(text: str, why: str) -> None:
    """The transform's own reason (the runner's sieve off), and the same status with it on."""
    res = transform_text([PATCH], FILE, text, sieve=False)
    out = res.outcomes[0]
    assert out.status is Status.NOT_APPLICABLE and why in out.reason, out.describe()
    assert res.after == text
    sieved, out = run(text)
    assert out.status is Status.NOT_APPLICABLE and sieved.after == text


@pytest.mark.parametrize(
    ("edit", "found"),
    [
        (lambda s: s.replace("< (10, 0)", "< (12, 0)"), "(12, 0)"),  # another Marlin range
        (
            lambda s: s.replace(
                "            else:\n",
                "            elif is_sm110_supported():\n"
                "                moe_runner_backend = MoeRunnerBackend.FLASHINFER_CUTLASS\n"
                "            else:\n",
            ),
            "is_sm110_supported()",
        ),  # a branch we do not know
        (
            lambda s: s.replace(
                "return get_moe_runner_backend().is_flashinfer_cutlass()",
                "return self._cutlass",
            ),
            "self._cutlass",
        ),
        (
            lambda s: s.replace("def create_moe_runner(self, layer,", "def create_moe_runner("
                                "self, moe_layer,").replace("(self, moe_layer, moe_runner_config)"
                                ":\n        self.runner = MoeRunner(get", "(self, layer, "
                                "moe_runner_config):\n        self.runner = MoeRunner(get"),
            "self, moe_layer",
        ),
        (
            lambda s: s.replace(
                "        self._moe_runner_backend = moe_runner_backend\n",
                "        if moe_runner_backend.is_auto():\n            pass\n"
                "        self._moe_runner_backend = moe_runner_backend\n",
            ),
            "2 `if moe_runner_backend.is_auto():`",
        ),
        (
            lambda s: s.replace(
                "        if moe_runner_backend.is_auto():\n",
                "        if moe_runner_backend.is_auto() or True:\n",
            ),
            "outside a top-level `if`",
        ),
        (
            lambda s: s.replace(
                "            moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM\n\n",
                "            moe_runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM\n"
                "            log(moe_runner_backend)\n\n",
            ),
            "log(moe_runner_backend)",
        ),
    ],
    ids=["marlin-range", "other-branch", "property", "param", "two-autos", "other-auto",
         "extra-statement"],
)
def test_refuses_a_shape_it_does_not_know(edit, found: str) -> None:
    text = edit(V0523)
    assert text != V0523
    res, out = run(text)
    assert out.status is Status.REFUSED and found in out.reason, out.describe()
    assert res.after == text


@pytest.mark.parametrize("half", ["branch", "property"])
def test_refuses_half_a_patch(half: str) -> None:
    """The branch without the property would prepare no weights for CUTLASS; the property
    alone is dead: either means someone else edited the file."""
    if half == "branch":
        text = PATCHED.replace(' or getattr(self, "_sm120_auto_flashinfer_cutlass", False)', "")
    else:
        text = PATCHED.split("            elif is_cuda() and (12")[0] + (
            "            else:" + PATCHED.split("            else:")[1])
    assert text not in (V0523, PATCHED)
    res, out = run(text)
    assert out.status is Status.REFUSED and "one without the other" in out.reason, out.describe()


# ---- the patched code, executed ------------------------------------------------------------


class MoeRunnerBackend(enum.Enum):
    AUTO = "auto"
    MARLIN = "marlin"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"

    def is_auto(self) -> bool:
        return self is MoeRunnerBackend.AUTO

    def is_flashinfer_trtllm(self) -> bool:
        return self is MoeRunnerBackend.FLASHINFER_TRTLLM

    def is_flashinfer_cutlass(self) -> bool:
        return self is MoeRunnerBackend.FLASHINFER_CUTLASS


def decide(monkeypatch, text: str, capability, requested="auto", ep_size=1):
    """`text` run for a GPU of `capability` with --moe-runner-backend `requested`: (the backend
    the runner is built with, what enable_flashinfer_cutlass_moe then says)."""
    backend = MoeRunnerBackend(requested)
    moe = types.ModuleType("sglang.srt.layers.moe")
    moe.get_moe_runner_backend = lambda: backend  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.moe", moe)
    scope: dict = {
        "MoeRunnerBackend": MoeRunnerBackend,
        "MoeRunner": lambda chosen, config: chosen,
        "get_moe_runner_backend": lambda: backend,
        "is_cuda": lambda: True,
        "get_device_capability": lambda: capability,
    }
    exec(compile(text, FILE, "exec"), scope)
    method = scope["ModelOptNvFp4FusedMoEMethod"]()
    method.create_moe_runner(types.SimpleNamespace(moe_ep_size=ep_size), object())
    return method.runner, method.enable_flashinfer_cutlass_moe


def patched() -> str:
    """What the patch writes over the 0.5.13-on fixture."""
    return run(V0523)[0].after


CUTLASS, TRTLLM, MARLIN = (MoeRunnerBackend.FLASHINFER_CUTLASS,
                           MoeRunnerBackend.FLASHINFER_TRTLLM, MoeRunnerBackend.MARLIN)


@pytest.mark.parametrize(
    ("capability", "want"),
    [
        ((12, 0), (CUTLASS, True)),
        ((12, 1), (CUTLASS, True)),
        ((10, 0), (TRTLLM, False)),
        ((11, 0), (TRTLLM, False)),
        ((9, 0), (MARLIN, False)),
        ((8, 0), (MARLIN, False)),
    ],
    ids=["sm120", "sm121", "sm100", "sm110", "sm90", "sm80"],
)
def test_patched_auto_decides(monkeypatch, capability, want) -> None:
    assert decide(monkeypatch, patched(), capability) == want
    if want[0] is not CUTLASS:  # off SM120: exactly what the pristine code decides
        assert decide(monkeypatch, V0523, capability) == want
    else:  # the control: pristine SM120 takes the TRT-LLM-gen runner, weights not for CUTLASS
        assert decide(monkeypatch, V0523, capability) == (TRTLLM, False)


def test_expert_parallel_keeps_upstreams_choice(monkeypatch) -> None:
    assert decide(monkeypatch, patched(), (12, 0), ep_size=2) == (TRTLLM, False)


@pytest.mark.parametrize("requested", ["flashinfer_trtllm", "flashinfer_cutlass", "marlin"])
def test_explicit_backend_is_kept(monkeypatch, requested: str) -> None:
    chosen = MoeRunnerBackend(requested)
    for text in (V0523, patched()):
        assert decide(monkeypatch, text, (12, 0), requested) == (chosen, chosen is CUTLASS)


# ---- the explain line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("probe", "row"),
    [
        (None, "not checked"),
        ({"backend": None}, "no auto choice (the runner follows --moe-runner-backend)"),
        ({"backend": "flashinfer_trtllm", "cutlass_weights": False}, "flashinfer_trtllm"),
        ({"backend": "flashinfer_cutlass", "cutlass_weights": True},
         "flashinfer_cutlass; weights prepared for CUTLASS"),
        ({"error": "ModuleNotFoundError: No module named 'sglang.srt.layers.moe'"},
         "not in this release"),
        ({"error": "RuntimeError: boom"}, "RuntimeError: boom"),
    ],
)
def test_explain_row(probe, row: str) -> None:
    from sm120patch.explain import explain

    result = {} if probe is None else {"moe_runner": probe}
    assert explain.decision(result, None).moe_runner_auto == row
    labels = dict(explain.labels())
    assert labels["moe_runner_auto"] == "NVFP4 MoE runner (auto, no expert parallelism)"
