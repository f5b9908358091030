"""The real tier runs each transform and each site check once per distinct input (realcache's
ByBytes and `checked`). These tests hold the keys sound: what a key leaves out (the release's
version, its other files, the earlier results) changes nothing that is shared under it."""

from __future__ import annotations

import ast

import pytest
from expected import judged
from realcache import ByBytes, RealReleases, SiteCase, checked, run_key, transform_text

from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog

pytestmark = pytest.mark.real

# A site whose file is byte-identical on several default releases (11 of 15 share one).
PATCH = "sglang.attention-default"


def _shared_pair(real: RealReleases) -> tuple[str, str]:
    """Two default SGLang releases on which PATCH's chain reads the same bytes."""
    from realcache import release_set

    seen: dict[object, str] = {}
    for version in release_set("sglang"):
        run = real.site(SiteCase(PATCH, "sglang", version))
        key = run_key([run.patch], run.file, run.before)
        if key in seen:
            return seen[key], version
        seen[key] = version
    pytest.skip(f"no two default releases share {PATCH}'s site bytes")


def test_a_shared_transform_is_what_each_release_gets_alone(real: RealReleases) -> None:
    first, second = _shared_pair(real)
    run = real.site(SiteCase(PATCH, "sglang", second))
    chain = [run.patch]
    by_bytes = ByBytes()
    shared = by_bytes(chain, run.file, real.site(SiteCase(PATCH, "sglang", first)).before)
    again = by_bytes(chain, run.file, run.before)
    assert by_bytes.ran == 1, "byte-identical input ran twice"
    alone = transform_text(chain, run.file, run.before)  # nothing remembered
    assert [(o.patch, o.status, o.reason) for o in again.outcomes] == [
        (o.patch, o.status, o.reason) for o in alone.outcomes
    ]
    assert again.after == alone.after and again.step_texts() == alone.step_texts()
    assert shared is not again  # the planner's edits to one release's result stay its own
    # Other bytes (one comment line more) run again and get their own answer.
    edited = run.before + "# one more line\n"
    assert by_bytes(chain, run.file, edited).after == transform_text(chain, run.file, edited).after
    assert by_bytes.ran == 2


def test_a_key_changes_with_a_byte_of_the_file_and_with_the_patch() -> None:
    patch = catalog.load().patches[PATCH]
    key = run_key([patch], "a.py", "x = 1\n")
    assert run_key([patch], "a.py", "x = 2\n") != key
    assert run_key([patch], "b.py", "x = 1\n") != key
    other = next(p for p in catalog.load().patches.values() if p.id != PATCH)
    assert run_key([other], "a.py", "x = 1\n") != key


def test_a_shared_check_is_what_each_release_gets_alone(real: RealReleases) -> None:
    """A check's answer on one release stands for another with the same two texts and fact:
    the check, run afresh on the other release's own trees, gives the same spans."""
    from realcache import patches_of, release_set

    for patch in patches_of("sglang"):
        seen = {}
        for version in release_set("sglang"):
            run = real.site(SiteCase(patch.id, "sglang", version))
            known = judged(patch.id, "sglang", version)
            if run.outcome.status is not Status.APPLIED or known is None:
                continue
            if run.key(known) in seen:
                first = seen[run.key(known)]
                break
            seen[run.key(known)] = run
        else:
            continue
        break
    else:
        pytest.skip("no applied site with the same bytes and fact on two default releases")
    shared = checked(first, known)
    assert run.patch.check is not None
    alone = run.patch.check(ast.parse(run.before), ast.parse(run.after), known)
    assert checked(run, known) == shared == alone
    assert first.target.version != run.target.version


def test_a_failing_check_fails_every_release_that_shares_its_input(real: RealReleases) -> None:
    """A check that fails on one release's input fails each release with the same input; it
    runs once."""
    from dataclasses import replace

    from realcache import release_set

    calls = []

    def failing(before: ast.Module, after: ast.Module, known: object) -> object:
        calls.append(known)
        raise AssertionError("the site moved")

    runs = [real.site(SiteCase(PATCH, "sglang", v)) for v in release_set("sglang")]
    shared = [r for r in runs if r.before == runs[0].before and r.file == runs[0].file]
    assert len(shared) >= 2
    fact = judged(PATCH, "sglang", shared[0].target.version)
    for run in shared:
        # A patch of its own id (so its own key): the real check's answers stay as they are.
        run = replace(run, patch=replace(run.patch, id=f"{PATCH}.failing", check=failing))
        with pytest.raises(AssertionError, match="the site moved"):
            checked(run, fact)
    assert len(calls) == 1
