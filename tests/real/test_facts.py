"""The facts tables (`FACTS` in each patch module, sm120patch.patchkit.facts) as the real tier uses them:
every release a profile pins is covered, a missing fact fails instead of skipping, and the
per-site tables of docs/compatibility.md are the facts."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from expected import FACTS, judged, pinned_by
from packaging.specifiers import SpecifierSet
from realcache import release_set

from sm120patch.maintain import releases, tables
from sm120patch.patchkit import facts
from sm120patch.patchkit.kinds import TARGETS
from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog

COMPAT = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def test_missing_fact_inside_the_pins_fails_outside_is_unjudged() -> None:
    """Take the 0.5.19 to 0.5.20 fact out of sglang.sm120-flag: 0.5.19 (pinned by fusion and
    all) now fails; 0.5.1 (no profile pins it) still just has no fact."""
    gap = tuple(
        f for f in FACTS if not (f.patch == "sglang.sm120-flag" and f.covers("0.5.19"))
    )
    assert judged("sglang.sm120-flag", "sglang", "0.5.19") is not None
    with pytest.raises(AssertionError, match=r"no fact covers sglang\.sm120-flag on sglang "
                       r"0\.5\.19, which profile\(s\) all, fusion pin"):
        judged("sglang.sm120-flag", "sglang", "0.5.19", facts=gap)
    assert judged("sglang.sm120-flag", "sglang", "0.5.1", facts=gap) is None
    # A new profile pinning 0.5.1 makes the same gap a failure there too.
    profiles = dict(catalog.load().profiles)
    fusion = profiles["fusion"]
    profiles["wide"] = replace(
        fusion, name="wide", pins={**fusion.pins, "sglang": SpecifierSet(">=0.5.0")}
    )
    assert pinned_by("sglang.sm120-flag", "sglang", "0.5.1", profiles) == ["wide"]
    with pytest.raises(AssertionError, match="wide"):
        judged("sglang.sm120-flag", "sglang", "0.5.1", facts=gap, profiles=profiles)


@pytest.mark.parametrize("kind", ["sglang", "flashinfer", "vllm"])
def test_every_pinned_release_has_exactly_one_fact(kind: str) -> None:
    cat = catalog.load()
    for patch in (p for p in cat.patches.values() if p.target == kind):
        for version in release_set(kind):
            judged(patch.id, kind, version)  # fails on a gap inside a pin, or an overlap


def test_derived_tables_match_the_facts() -> None:
    """profiles' absent ranges and upstream readings come from the facts alone."""
    cat = catalog.load()
    assert cat.profile("moe").absent_ok("sglang.moe-backend", "0.5.7")
    assert not cat.profile("moe").absent_ok("sglang.moe-backend", "0.5.8")
    assert cat.profile("fusion").absent_ok("sglang.fusion-backend", "0.5.13")
    assert not cat.profile("fusion").absent_ok("sglang.fusion-backend", "0.5.14")
    comm = cat.patches["flashinfer.comm-arch"]
    assert comm.upstream_at("0.6.17") and not comm.upstream_at("0.6.16")
    assert all(not facts.check(p.facts) for p in cat.patches.values())
    for patch in cat.patches.values():
        assert patch.shapes == tuple(f.describe() for f in patch.facts)
        assert {f.status for f in patch.facts} <= set(Status)


def test_compatibility_site_tables_are_the_facts() -> None:
    text = COMPAT.read_text(encoding="utf-8")
    found = re.search(r"<!-- facts:begin -->\n(.*?)<!-- facts:end -->", text, re.S)
    assert found, "docs/compatibility.md has no <!-- facts:begin --> ... <!-- facts:end --> section"
    want = tables.markdown(catalog.load().patches.values())
    assert found.group(1) == want, (
        "docs/compatibility.md per-site tables differ from the patches' FACTS; regenerate with "
        "`python -m sm120patch.maintain.tables` and paste between the markers"
    )


@pytest.mark.parametrize("kind", TARGETS)
def test_the_default_releases_hold_every_pinned_fact(kind: str) -> None:
    """The real tier's default run takes a release of every range of releases a fact gives a
    shape of, wherever a profile holding the patch pins it; and only listed releases inside
    the full range."""
    try:
        listed = releases.available(kind)
    except releases.ReleaseError as exc:
        pytest.skip(f"the index's listing cannot be read: {exc}")
    defaults = releases.DEFAULT_RELEASES[kind]
    assert set(defaults) <= set(listed), sorted(set(defaults) - set(listed))
    cat = catalog.load()
    gaps = []
    for patch in (p for p in cat.patches.values() if p.target == kind):
        for fact in patch.facts:
            pinned = [v for v in listed if fact.covers(v) and pinned_by(patch.id, kind, v)]
            if pinned and not any(fact.covers(v) for v in defaults):
                gaps.append(f"{patch.id} {fact.releases} (pinned: {', '.join(pinned)})")
    assert not gaps, f"no default release of {kind} in: {'; '.join(gaps)}"
