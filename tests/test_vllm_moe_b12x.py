"""vllm.moe-b12x on fixtures in the shapes of vLLM's releases (written by us): the list alone
(0.30, 0.31), the list then `prioritize_humming` (0.32 to 0.34); the refusals; and the patched
selection run with a stand-in `current_platform`: B12X, then FLASHINFER_B12X, right before MARLIN
on exactly 12.0 without expert parallelism (B12X unsupported, as without the b12x package: the
next one), nothing changed on 12.1, 10.0 or with EP."""

from __future__ import annotations

import ast
import sys
import textwrap
import types

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("vllm.moe-b12x")

# 0.30, 0.31: the list, then the swiglu filter.
LIST = '''\
from enum import Enum

from vllm.logger import init_logger

logger = init_logger(__name__)


class NvFp4MoeBackend(Enum):
    B12X = "B12X"
    FLASHINFER_TRTLLM = "FLASHINFER_TRTLLM"
    FLASHINFER_CUTLASS = "FLASHINFER_CUTLASS"
    FLASHINFER_B12X = "FLASHINFER_B12X"
    VLLM_CUTLASS = "VLLM_CUTLASS"
    MARLIN = "MARLIN"
    HUMMING = "HUMMING"
    EMULATION = "EMULATION"


CLAMPED = {NvFp4MoeBackend.B12X, NvFp4MoeBackend.MARLIN}


def select_nvfp4_moe_backend(config, weight_key, activation_key):
    """Pick the NVFP4 MoE backend; shapes may still fall back at run time."""
    # NOTE: the kernels are tried in this order; FLASHINFER_B12X only on request.
    AVAILABLE_BACKENDS = [
        NvFp4MoeBackend.FLASHINFER_TRTLLM,
        NvFp4MoeBackend.FLASHINFER_CUTLASS,
        NvFp4MoeBackend.VLLM_CUTLASS,
        NvFp4MoeBackend.MARLIN,
        NvFp4MoeBackend.HUMMING,
        NvFp4MoeBackend.EMULATION,
    ]

    if config.swiglu_limit is not None:
        AVAILABLE_BACKENDS = [b for b in AVAILABLE_BACKENDS if b in CLAMPED]

    if config.moe_backend != "auto":
        return NvFp4MoeBackend[config.moe_backend.upper()], AVAILABLE_BACKENDS
    for backend in AVAILABLE_BACKENDS:
        if backend in config.supported:
            logger.info(f"Using '{backend.value}' NvFp4 MoE backend.")
            return backend, AVAILABLE_BACKENDS
    raise NotImplementedError("No NvFp4 MoE backend supports the deployment configuration.")
'''

INSERTED = '''\
    # sm120patch vllm.moe-b12x: on SM120 (exactly 12.0; SM121 keeps Marlin) without expert
    # parallelism, try B12X (the b12x package; falls through where it is not installed),
    # then FLASHINFER_B12X, right before MARLIN, as open PRs
    # https://github.com/vllm-project/vllm/pull/54669 (B12X) and
    # https://github.com/vllm-project/vllm/pull/47577 (FLASHINFER_B12X) do.
    from vllm.platforms import current_platform

    if (
        current_platform.is_device_capability(120)
        and not config.moe_parallel_config.use_ep
    ):
        AVAILABLE_BACKENDS.insert(
            AVAILABLE_BACKENDS.index(NvFp4MoeBackend.MARLIN),
            NvFp4MoeBackend.B12X,
        )
        AVAILABLE_BACKENDS.insert(
            AVAILABLE_BACKENDS.index(NvFp4MoeBackend.MARLIN),
            NvFp4MoeBackend.FLASHINFER_B12X,
        )
'''

# The patch's previous form (FLASHINFER_B12X alone), as a tree applied by an older sm120patch has it.
OLD_INSERTED = INSERTED.replace('''        AVAILABLE_BACKENDS.insert(
            AVAILABLE_BACKENDS.index(NvFp4MoeBackend.MARLIN),
            NvFp4MoeBackend.B12X,
        )
''', "")

LIST_AFTER = LIST.replace(
    "        NvFp4MoeBackend.EMULATION,\n    ]\n",
    "        NvFp4MoeBackend.EMULATION,\n    ]\n" + INSERTED,
)

# 0.32 to 0.34: the list, then Humming moved ahead of Marlin where it is preferred.
HUMMING = LIST.replace(
    "from vllm.logger import init_logger\n",
    "from vllm.logger import init_logger\n"
    "from vllm.model_executor.layers.quantization.utils.humming import prioritize_humming\n",
).replace(
    "        NvFp4MoeBackend.EMULATION,\n    ]\n",
    "        NvFp4MoeBackend.EMULATION,\n    ]\n"
    "    AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)\n",
)

HUMMING_AFTER = HUMMING.replace(
    "    AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)\n",
    "    AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)\n" + INSERTED,
)


def one(res):
    [outcome] = res.outcomes
    return outcome


@pytest.mark.parametrize(("before", "after"), [(LIST, LIST_AFTER), (HUMMING, HUMMING_AFTER)],
                         ids=["0.30-list", "0.32-humming"])  # fmt: skip
def test_exact_diff_and_already_applied(run_patch, before: str, after: str) -> None:
    res = run_patch(PATCH, before)
    assert one(res).status is Status.APPLIED, one(res).reason
    assert one(res).site == "select_nvfp4_moe_backend"
    assert res.after == after
    again = run_patch(PATCH, res.after)
    assert one(again).status is Status.ALREADY_APPLIED and again.after == res.after


@pytest.mark.parametrize("before", [LIST, HUMMING], ids=["0.30-list", "0.32-humming"])
def test_the_check_accepts_the_patch_and_nothing_else(run_patch, before: str) -> None:
    [fact] = [f for f in PATCH.facts if f.form == ("humming" if "prioritize" in before else "list")
              ][:1]  # fmt: skip
    after = run_patch(PATCH, before).after
    assert PATCH.check is not None
    PATCH.check(ast.parse(before), ast.parse(after), fact)
    moved = after.replace("        NvFp4MoeBackend.FLASHINFER_B12X,\n        )",
                          "        NvFp4MoeBackend.B12X,\n        )")
    with pytest.raises(AssertionError):
        PATCH.check(ast.parse(before), ast.parse(moved), fact)


def test_crlf_kept(run_patch) -> None:
    res = run_patch(PATCH, HUMMING.replace("\n", "\r\n"))
    assert one(res).status is Status.APPLIED
    assert res.after.count("\n") == res.after.count("\r\n")


def _second_list(s: str) -> str:
    return s.replace("    if config.swiglu_limit is not None:\n",
                     "    AVAILABLE_BACKENDS = [NvFp4MoeBackend.MARLIN]\n"
                     "    if config.swiglu_limit is not None:\n")  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        (lambda s: s.replace("        NvFp4MoeBackend.MARLIN,\n", ""), Status.REFUSED,
         "NvFp4MoeBackend.MARLIN in `AVAILABLE_BACKENDS`"),
        (_second_list, Status.REFUSED, "2 such statements"),
        (lambda s: s.replace("        NvFp4MoeBackend.MARLIN,\n",
                             "        NvFp4MoeBackend.FLASHINFER_B12X,\n"
                             "        NvFp4MoeBackend.MARLIN,\n"),
         Status.REFUSED, "without NvFp4MoeBackend.FLASHINFER_B12X"),
        (lambda s: s.replace("select_nvfp4_moe_backend(config,", "select_nvfp4_moe_backend(cfg,"),
         Status.REFUSED, "a `config` parameter"),
        (lambda s: s.replace("    AVAILABLE_BACKENDS = [\n", "    BACKENDS = [\n"),
         Status.NOT_APPLICABLE, "no `AVAILABLE_BACKENDS = [...]`"),
        (lambda s: s.replace("def select_nvfp4_moe_backend", "def select_backend"),
         Status.NOT_APPLICABLE, "select_nvfp4_moe_backend"),
        (lambda s: s.replace("        NvFp4MoeBackend.MARLIN,\n",
                             "        NvFp4MoeBackend.B12X,\n"
                             "        NvFp4MoeBackend.MARLIN,\n"),
         Status.REFUSED, "without NvFp4MoeBackend.B12X"),
        (lambda s: s.replace('    B12X = "B12X"\n', ""), Status.REFUSED, "no B12X"),
    ],
    ids=["no-marlin", "two-lists", "fi-b12x-listed", "no-config", "no-list", "no-function",
         "b12x-listed", "no-b12x-member"],
)
def test_refusals(run_patch, edit, status, found) -> None:
    res = run_patch(PATCH, edit(HUMMING))
    assert one(res).status is status and found in one(res).reason, one(res).describe()
    assert res.after == res.before


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.replace("is_device_capability(120)", "is_device_capability_family(120)"),
        lambda s: s.replace("        and not config.moe_parallel_config.use_ep\n", ""),
        lambda s: s.replace("    from vllm.platforms import current_platform\n\n", ""),
    ],
    ids=["family-instead-of-exact", "ep-gate-dropped", "import-dropped"],
)
def test_a_hand_edited_insertion_refuses(run_patch, edit) -> None:
    edited = edit(HUMMING_AFTER)
    assert edited != HUMMING_AFTER
    res = run_patch(PATCH, edited)
    assert one(res).status is Status.REFUSED, one(res).describe()
    assert res.after == res.before


def _select(text: str, capability: int, *, ep: bool = False, backend: str = "auto",
            supported: tuple[str, ...] = ("FLASHINFER_B12X", "MARLIN")):  # fmt: skip
    """Run the fixture's `select_nvfp4_moe_backend` with a stand-in `current_platform` that has
    exactly `capability` (vLLM's `is_device_capability(int)`: `to_int() == capability`)."""
    platform = types.SimpleNamespace(is_device_capability=lambda c: c == capability)
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.SimpleNamespace(current_platform=platform),
        "vllm.logger": types.SimpleNamespace(
            init_logger=lambda name: types.SimpleNamespace(info=lambda msg: None)),
        "vllm.model_executor.layers.quantization.utils.humming": types.SimpleNamespace(
            prioritize_humming=lambda kernels: kernels),
    }
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)  # type: ignore[arg-type]
    try:
        scope: dict[str, object] = {}
        exec(compile(text, "nvfp4.py", "exec"), scope)
        enum = scope["NvFp4MoeBackend"]
        config = types.SimpleNamespace(
            swiglu_limit=None, moe_backend=backend,
            moe_parallel_config=types.SimpleNamespace(use_ep=ep),
            supported={enum[name] for name in supported},  # type: ignore[index]
        )
        chosen, order = scope["select_nvfp4_moe_backend"](config, None, None)  # type: ignore[operator]
        return chosen.value, [b.value for b in order]
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_the_previous_form_refuses_saying_so(run_patch) -> None:
    """A tree an older sm120patch patched (FLASHINFER_B12X alone) is not taken for a hand edit:
    the refusal names the previous patch and what to do."""
    res = run_patch(PATCH, HUMMING.replace(
        "    AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)\n",
        "    AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)\n" + OLD_INSERTED))
    assert one(res).status is Status.REFUSED
    assert "the previous vllm.moe-b12x" in one(res).reason, one(res).describe()


def test_the_patched_selection_runs_as_the_prs_say(run_patch) -> None:
    after = run_patch(PATCH, HUMMING).after
    everything = ("B12X", "FLASHINFER_B12X", "MARLIN")
    chosen, order = _select(after, 120, supported=everything)
    assert chosen == "B12X"  # PRs 54669 and 54719: B12X before MARLIN
    assert order[order.index("MARLIN") - 2 : order.index("MARLIN")] == ["B12X", "FLASHINFER_B12X"]
    assert order.count("FLASHINFER_B12X") == 1 and order.count("B12X") == 1
    # B12X not supported (no b12x package): FLASHINFER_B12X, as PR 47577
    assert _select(after, 120)[0] == "FLASHINFER_B12X"
    for capability, ep in ((121, False), (100, False), (120, True)):
        assert _select(after, capability, ep=ep, supported=everything) == _select(
            HUMMING, capability, ep=ep, supported=everything)
        assert _select(after, capability, ep=ep, supported=everything)[0] == "MARLIN"
    for capability, ep in ((121, False), (100, False), (120, True)):
        assert _select(after, capability, ep=ep) == _select(HUMMING, capability, ep=ep)
        assert _select(after, capability, ep=ep)[0] == "MARLIN"
    # b12x not supported by this deployment: MARLIN, as before
    assert _select(after, 120, supported=("MARLIN",))[0] == "MARLIN"
    # an explicit backend returns before the list is walked, as upstream
    assert _select(after, 120, backend="marlin")[0] == "MARLIN"


def test_facts_cover_the_pins_and_wiring_reads_both_log_forms() -> None:
    from sm120patch.plan import catalog

    profile = catalog.load().profile("vllm-moe")
    assert profile.patches == ("vllm.moe-b12x",) and profile.status == "experimental"
    assert str(profile.pins["vllm"]) in (">=0.30.0,<0.35", "<0.35,>=0.30.0")
    for version in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"):
        assert len(PATCH.facts_at(version)) == 1, version
    assert PATCH.wiring is not None
    older = ("INFO [nvfp4.py:222] Using 'FLASHINFER_B12X' NvFp4 MoE backend out of potential "
             "backends: ['FLASHINFER_TRTLLM', 'MARLIN'].")  # fmt: skip
    newer = ("INFO [nvfp4.py:304] Using FLASHINFER_B12X NvFp4 MoE backend out of potential "
             "backends: ['FLASHINFER_TRTLLM', 'FLASHINFER_B12X', 'MARLIN'].")  # fmt: skip
    marlin = "INFO Using MARLIN NvFp4 MoE backend out of potential backends: ['MARLIN']."
    assert PATCH.wiring.read(older).seen.value == "ran"
    assert PATCH.wiring.read(newer).seen.value == "ran"
    native = "INFO Using B12X NvFp4 MoE backend out of potential backends: ['B12X', 'MARLIN']."
    assert PATCH.wiring.read(native).seen.value == "ran"
    assert PATCH.wiring.read(marlin).seen.value == "skipped"
    assert PATCH.wiring.read(textwrap.dedent("nothing here")).seen.value == "not-seen"
