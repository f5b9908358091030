"""The runner's sieve: a patch whose sought names are all absent from a file's bytes is
not-applicable there without a parse, exactly as its transform would say after one.

tests/real/test_sieve_real.py holds the two ways equal on every default release."""

from __future__ import annotations

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit import runner
from sm120patch.patchkit.model import Patch, Result, Sought, Status, already_applied

BACKEND = load_patch("sglang.fusion-backend")
PREFLIGHT = load_patch("sglang.fusion-preflight")
MOE_AUTO = load_patch("sglang.moe-runner-auto")

# Before: a comm-fusion file of a release before 0.5.14, with no `_resolve_backend`.
BEFORE = '''
from sglang.srt.utils import is_sm90_supported, is_sm100_supported


def _flashinfer_ar_fusion_supported():
    return is_sm90_supported() or is_sm100_supported()
'''
# After: the same file once the release has the function (0.5.14 to 0.5.18's call form).
AFTER = BEFORE + '''

def _resolve_backend(backend, is_multi_node=False):
    if not (is_sm90_supported() or is_sm100_supported()):
        raise ValueError("FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.")
    return backend
'''


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts the runner parses, in order."""
    seen: list[str] = []
    real = runner._parsed.__wrapped__

    def counting(text: str) -> object:
        seen.append(text)
        return real(text)

    monkeypatch.setattr(runner, "_parsed", counting)
    return seen


def test_a_file_without_the_names_is_not_parsed(parses: list[str]) -> None:
    sieved = runner.transform_text([BACKEND, PREFLIGHT], "f.py", BEFORE)
    assert parses == []
    assert [o.status for o in sieved.outcomes] == [Status.NOT_APPLICABLE] * 2
    assert "`_resolve_backend`" in sieved.outcomes[0].reason
    assert sieved.outcomes[0].site == "_resolve_backend"
    assert sieved.after == BEFORE
    parsed = runner.transform_text([BACKEND, PREFLIGHT], "f.py", BEFORE, sieve=False)
    assert parses == [BEFORE]
    assert [o.status for o in parsed.outcomes] == [o.status for o in sieved.outcomes]
    assert [o.site for o in parsed.outcomes] == [o.site for o in sieved.outcomes]


def test_a_file_with_a_name_is_parsed_and_patched_the_same_both_ways(
    parses: list[str],
) -> None:
    sieved = runner.transform_text([BACKEND, PREFLIGHT], "f.py", AFTER)
    parsed = runner.transform_text([BACKEND, PREFLIGHT], "f.py", AFTER, sieve=False)
    assert parses == [AFTER, AFTER]  # once each way
    statuses = [o.status for o in sieved.outcomes]
    assert statuses == [Status.APPLIED, Status.NOT_APPLICABLE]
    assert statuses == [o.status for o in parsed.outcomes]
    assert sieved.after == parsed.after != AFTER
    assert "or is_sm120_supported()" in sieved.after


def test_a_sieved_patch_beside_one_that_parses_keeps_its_outcome(parses: list[str]) -> None:
    """The parse another patch of the file needs does not run the sieved patch."""
    ran: list[str] = []

    def transform(module: object) -> Result:
        ran.append("ran")
        return already_applied("x", "nothing to do")

    other = Patch(id="t.other", target="sglang", title="", why="", marker="", transform=transform)
    result = runner.transform_text([PREFLIGHT, other], "f.py", AFTER)
    assert ran == ["ran"] and len(parses) == 1
    assert [o.status for o in result.outcomes] == [Status.NOT_APPLICABLE, Status.ALREADY_APPLIED]


def test_a_sieved_patch_is_not_refused_for_a_file_that_does_not_parse() -> None:
    broken = AFTER + "def (\n"
    result = runner.transform_text([PREFLIGHT, BACKEND], "f.py", broken)
    assert [o.status for o in result.outcomes] == [Status.NOT_APPLICABLE, Status.REFUSED]


def test_moe_runner_auto_is_not_applicable_without_is_auto_whatever_the_method_holds() -> None:
    """Its sought name is the `auto` choice, not the class: the class and method exist from
    before the choice does, so the transform must say not-applicable for a method without
    one, even one whose shape it would refuse (the sieve's promise)."""
    text = (
        "class ModelOptNvFp4FusedMoEMethod:\n"
        "    def create_moe_runner(self, other):\n"
        "        self.runner = MoeRunner(MoeRunnerBackend.FLASHINFER_TRTLLM)\n"
    )
    for sieve in (True, False):
        [outcome] = runner.transform_text([MOE_AUTO], "m.py", text, sieve=sieve).outcomes
        assert outcome.status is Status.NOT_APPLICABLE, (sieve, outcome.describe())


def test_sought_names_must_be_identifiers() -> None:
    assert Sought("s", ("def f",)).problems() == ["sought: 'def f' is not an identifier"]
    assert Sought("s", ()).problems() == ["sought: no names"]
    assert Sought("s", ("f",)).problems() == []
