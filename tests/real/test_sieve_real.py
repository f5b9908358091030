"""The runner's sieve on real releases: every file a patch with sought names would be run on,
planned with the sieve on and with it forced off, gives each patch the same status and the
file the same bytes (patchkit.runner.transform_text, patchkit.model.Sought)."""

from __future__ import annotations

import pytest
from realcache import RealReleases, patches_of, release_set

from sm120patch.maintain import releases
from sm120patch.patchkit.model import Patch
from sm120patch.patchkit.runner import transform_text

pytestmark = pytest.mark.real

CASES = [(kind, v) for kind in releases.KINDS for v in release_set(kind)]


def _files(real: RealReleases, kind: str, version: str) -> dict[str, tuple[list[Patch], str]]:
    """file -> (every patch of `kind` the planner runs on it, its text), for the files where
    at least one of them declares sought names; grouped as the planner groups them."""
    target = real.target(kind, version)
    texts: dict[str, str | None] = {}

    def read(rel: str) -> str | None:
        if rel not in texts:
            try:
                texts[rel] = target.handle.read(target.rel(rel)).decode("utf-8")
            except FileNotFoundError:
                texts[rel] = None
        return texts[rel]

    groups: dict[str, list[Patch]] = {}
    for patch in patches_of(kind):
        rel = patch.pick_file(read)
        if rel is not None:
            groups.setdefault(rel, []).append(patch)
    return {
        rel: (group, texts[rel] or "")
        for rel, group in groups.items()
        if any(p.sought is not None for p in group)
    }


@pytest.mark.parametrize(("kind", "version"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_the_sieve_changes_no_status_and_no_byte(
    real: RealReleases, kind: str, version: str
) -> None:
    files = _files(real, kind, version)
    for rel, (group, text) in files.items():
        for patch in group:  # each patch alone, and the file's whole group in planner order
            _same([patch], rel, text)
        _same(group, rel, text)


def _same(group: list[Patch], rel: str, text: str) -> None:
    on = transform_text(group, rel, text)
    off = transform_text(group, rel, text, sieve=False)
    where = f"{rel} with {[p.id for p in group]}"
    assert [(o.patch, o.status) for o in on.outcomes] == [
        (o.patch, o.status) for o in off.outcomes
    ], f"{where}: {[o.describe() for o in on.outcomes]} vs {[o.describe() for o in off.outcomes]}"
    assert on.after == off.after, where
    assert on.step_texts() == off.step_texts(), where


def test_the_sieve_spares_the_parses_the_benchmark_counts(real: RealReleases) -> None:
    """On SGLang 0.5.8, the benchmark's release, the two files `all` reads only to find its
    sites absent are decided without running a transform."""
    files = _files(real, "sglang", "0.5.8")
    spared = {
        rel
        for rel, (group, text) in files.items()
        if all(p.sought is not None and p.sought.absent_from(text) for p in group)
    }
    assert spared == {
        "sglang/srt/layers/quantization/modelopt_quant.py",
        "sglang/srt/layers/flashinfer_comm_fusion.py",
    }
