"""Each behaviour check fails on a tree made wrong on purpose: the checks can see a patch that
does the wrong thing on SM120, and one that changes what SM100 decides."""

from __future__ import annotations

from pathlib import Path

import pytest
from behave import Behaviour, Case
from checks import same_problems, sm120_problems

pytestmark = pytest.mark.behaviour

VERSION = "0.5.8"  # the cheapest release to import; every check has a site there


def edited(behaviour: Behaviour, tmp_path: Path, module: str, old: str, new: str
           ) -> dict[str, str]:
    """The patched overlay of VERSION with one module's text edited (`old` must be there)."""
    overlay = dict(behaviour._overlays[("sglang", VERSION)])
    text = Path(overlay[module]).read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in the patched {module}"
    path = tmp_path / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(old, new), encoding="utf-8")
    overlay[module] = str(path)
    return overlay


@pytest.mark.parametrize("sglang_version", [VERSION])
def test_a_wrong_sm120_branch_fails_the_patched_sm120_check(
    behaviour: Behaviour, sglang_version: str, tmp_path: Path
) -> None:
    pristine = behaviour.result(Case("sglang", VERSION, "pristine", "sm120"))
    sm100 = behaviour.result(Case("sglang", VERSION, "pristine", "sm100"))
    patched = behaviour.result(Case("sglang", VERSION, "patched", "sm120"))
    assert sm120_problems(pristine, patched, sm100) == []
    # The SM120 branch choosing another backend: a patch that "applies" but is wrong.
    wrong = edited(behaviour, tmp_path, "sglang.srt.server_args",
                   'self.moe_runner_backend = "flashinfer_cutlass"',
                   'self.moe_runner_backend = "triton"')
    result = behaviour.run(Case("sglang", VERSION, "patched", "sm120"), overlay=wrong)
    problems = sm120_problems(pristine, result, sm100)
    assert any("moe-nvfp4-config" in p and "triton" in p for p in problems), problems


@pytest.mark.parametrize("sglang_version", [VERSION])
def test_an_edit_of_the_sm100_path_fails_the_control(
    behaviour: Behaviour, sglang_version: str, tmp_path: Path
) -> None:
    pristine = behaviour.result(Case("sglang", VERSION, "pristine", "sm100"))
    patched = behaviour.result(Case("sglang", VERSION, "patched", "sm100"))
    assert same_problems(pristine, patched) == []
    # A gate widened for SM120 that drops SM100 on the way.
    wrong = edited(behaviour, tmp_path, "sglang.srt.layers.communicator",
                   "(_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)",
                   "(_is_sm90_supported or _is_sm120_supported)")
    result = behaviour.run(Case("sglang", VERSION, "patched", "sm100"), overlay=wrong)
    problems = same_problems(pristine, result)
    assert any(p.startswith("gate:") and "'passes': False" in p for p in problems), problems


@pytest.mark.parametrize("sglang_version", [VERSION])
def test_fusion_at_every_tp_size_fails_the_sm120_check(
    behaviour: Behaviour, sglang_version: str, tmp_path: Path
) -> None:
    """The fusion auto-enable as it was before TP2-only (SM120 at every TP size), and no
    patch at all (the pristine text as the patched side), each fail the SM120 check."""
    pristine = behaviour.result(Case("sglang", VERSION, "pristine", "sm120"))
    sm100 = behaviour.result(Case("sglang", VERSION, "pristine", "sm100"))
    wrong = edited(behaviour, tmp_path, "sglang.srt.server_args",
                   "(is_sm120_supported() and self.tp_size == 2)", "is_sm120_supported()")
    result = behaviour.run(Case("sglang", VERSION, "patched", "sm120"), overlay=wrong)
    problems = sm120_problems(pristine, result, sm100)
    assert any("fusion4-plain" in p and "at TP4" in p for p in problems), problems
    noop = sm120_problems(pristine, pristine, sm100)
    assert any("fusion not auto-enabled" in p for p in noop), noop
