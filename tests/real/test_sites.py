"""Each patch on each real release: outcome, compiles, intended node, nothing else, idempotent.

The intended node is each patch's own independent check (`Patch.check`, written with `ast` and
sm120patch.patchkit.sitecheck in the patch's module): nothing here is keyed by a patch id.
"""

from __future__ import annotations

import pytest
from expected import Fact, judged
from realcache import RealReleases, SiteCase, SiteRun, checked, compiles

from sm120patch.patchkit import sitecheck
from sm120patch.patchkit.model import Status
from sm120patch.patchkit.sitecheck import Spans

pytestmark = pytest.mark.real


def _run(real: RealReleases, case: SiteCase) -> tuple[SiteRun, Fact | None]:
    """The site's run and its fact; fails where a profile pins the release and no fact
    covers it (outside every pin a missing fact only leaves the outcome unjudged)."""
    return real.site(case), judged(case.patch_id, case.kind, case.version)


def _must_be_applied(run: SiteRun, known: Fact | None) -> Fact:
    """The fact of an applied site; skips the sites a check has nothing to say about."""
    status = run.outcome.status
    if status is not Status.APPLIED:
        if known is not None and known.status is Status.APPLIED:
            pytest.fail(f"expected applied; {run.outcome.describe()}")
        pytest.skip(f"nothing patched here ({status})")
    if known is None:  # outside every pin (inside one, `judged` failed already)
        pytest.skip(f"applied outside every pin, no fact ({run.outcome.describe()})")
    if known.status is not Status.APPLIED:
        pytest.fail(f"expected {known.status}; {run.outcome.describe()}")
    return known


def test_outcome(real: RealReleases, site_case: SiteCase) -> None:
    run, known = _run(real, site_case)
    if known is None:
        pytest.skip(f"outside every pin and no fact recorded; outcome: {run.outcome.describe()}")
    assert run.outcome.status is known.status, (
        f"{site_case}: expected {known.status} ({known.source}); {run.outcome.describe()}"
    )
    if known.file is not None:
        assert run.outcome.file == known.file, f"site found in {run.outcome.file}"


def test_compiles_or_untouched(real: RealReleases, site_case: SiteCase) -> None:
    run, _ = _run(real, site_case)
    if run.outcome.status is Status.APPLIED:
        assert compiles(run.after, run.file)
    else:
        assert run.after == run.before, f"{run.outcome.status} but the text changed"


def _check(run: SiteRun, known: Fact) -> sitecheck.Spans:
    """The patch's own check, once per distinct input (realcache.checked); a library patch
    without one fails tests/test_one_home.py."""
    assert __debug__, "a check asserts: run the real tier without -O"
    return checked(run, known)


def test_intended_node(real: RealReleases, site_case: SiteCase) -> None:
    run, known = _run(real, site_case)
    if run.outcome.status is Status.UPSTREAM and known is not None and (
        known.status is Status.UPSTREAM
    ):
        # Upstream must mean the release itself carries the change: the check says how, for
        # the patches with upstream facts, and nothing may change.
        assert _check(run, known) == Spans()
        return
    known = _must_be_applied(run, known)
    _check(run, known)


def test_only_site_lines_change(real: RealReleases, site_case: SiteCase) -> None:
    run, known = _run(real, site_case)
    known = _must_be_applied(run, known)
    spans = _check(run, known)
    sitecheck.only_in(run.before, run.after, spans)


def test_second_run_changes_nothing(real: RealReleases, site_case: SiteCase) -> None:
    run, _ = _run(real, site_case)
    if run.outcome.status is not Status.APPLIED:
        assert run.after == run.before
        return
    again = run.rerun
    assert again is not None
    (outcome,) = again.outcomes
    assert outcome.status is Status.ALREADY_APPLIED, outcome.describe()
    assert again.after == run.after


def test_sm120_imports_resolve(real: RealReleases, site_case: SiteCase) -> None:
    """A patch that imports an SM120 helper from sglang.srt.utils must only do so on a release
    that defines it: otherwise the patched module fails at import, on every GPU."""
    run, _ = _run(real, site_case)
    if run.outcome.status is not Status.APPLIED:
        pytest.skip(f"nothing patched here ({run.outcome.status})")
    before, after = sitecheck.imported(run.before_ast), sitecheck.imported(run.after_ast)
    gained = {n: m for n, (m, _) in after.items() if n not in before}
    root = real.tree(site_case.kind, site_case.version)
    for name, module in gained.items():
        if not module.startswith("sglang.srt.utils"):
            continue
        texts = [
            p.read_text(encoding="utf-8")
            for p in (root / "sglang/srt/utils.py", root / "sglang/srt/utils/common.py")
            if p.is_file()
        ]
        assert any(sitecheck.defines(t, name) for t in texts), (
            f"{run.file} now imports {name} from {module}, which SGLang {site_case.version} "
            "does not define"
        )


def test_sm120_helper_exists_where_imported(real: RealReleases, sglang_version: str) -> None:
    """Site A: `is_sm120_supported` is in sglang.srt.utils from 0.5.4 (0.5.2 and 0.5.3
    have none). The import form of the SM120 flag relies on it."""
    from packaging.version import Version

    root = real.tree("sglang", sglang_version)
    texts = [
        (root / rel).read_text(encoding="utf-8")
        for rel in ("sglang/srt/utils.py", "sglang/srt/utils/common.py")
        if (root / rel).is_file()
    ]
    has = any(sitecheck.defines(t, "is_sm120_supported") for t in texts)
    release = Version(sglang_version)
    if release >= Version("0.5.4"):
        assert has, f"SGLang {sglang_version} defines no is_sm120_supported in sglang.srt.utils"
    elif release >= Version("0.5.2"):
        assert not has, f"SGLang {sglang_version} defines is_sm120_supported, the facts say not"
