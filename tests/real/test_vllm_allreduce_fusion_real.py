"""The vllm-allreduce-fusion profile as a whole on every pinned vLLM release's own files: its
three patches together (two of them in one file, chained on one parse as the planner runs them)
give what each gives alone and are already applied on a second run; and each release's own
METADATA requires a FlashInfer the profile does not refuse. Each patch alone (outcome per release
as its facts say, compiles, its independent `check`, only the site's lines, already-applied on a
second run) is tests/real/test_sites.py's, which sweeps vLLM's releases too.

The releases come from the release cache as their `.py` files (`maintain/sources.py`: never the
~240 MB wheel); without the index and the cache the tests skip, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from sm120patch.maintain import releases, sources
from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text
from sm120patch.plan import catalog

pytestmark = pytest.mark.real

PROFILE = "vllm-allreduce-fusion"
VERSIONS = releases.DEFAULT_RELEASES["vllm"]


def _tree(version: str) -> Path:
    """The release's sources from the cache, fetched when the index can be reached."""
    cached = sources.trees_dir() / f"vllm-{version}"
    if sources.tree_problem(cached) is not None and not releases.index_reachable():
        pytest.skip(f"vLLM {version} is not cached and the index "
                    f"({releases.index_sources()}) is unreachable")  # fmt: skip
    return sources.tree("vllm", version)


def _patches():
    cat = catalog.load()
    return [cat.patches[pid] for pid in cat.profile(PROFILE).patches]


@pytest.mark.parametrize("version", VERSIONS)
def test_profile_chained_per_file(version: str) -> None:
    """The planner's way: per file, every patch of the profile on one parse, in order."""
    root = _tree(version)
    by_file: dict[str, list] = {}
    for patch in _patches():
        [fact] = patch.facts_at(version)
        assert fact.file is not None
        by_file.setdefault(fact.file, []).append(patch)
    assert len(by_file) == 2  # vllm/config/vllm.py and allreduce_rms_fusion.py
    for rel, patches in by_file.items():
        text = (root / rel).read_text(encoding="utf-8")
        res = transform_text(patches, rel, text)
        assert [o.status for o in res.outcomes] == [Status.APPLIED] * len(patches), [
            o.describe() for o in res.outcomes
        ]
        alone = text
        for patch in patches:
            alone = transform_text([patch], rel, alone).after
        assert res.after == alone
        again = transform_text(patches, rel, res.after)
        assert [o.status for o in again.outcomes] == [Status.ALREADY_APPLIED] * len(patches)


@pytest.mark.parametrize("version", VERSIONS)
def test_release_requires_a_flashinfer_the_profile_accepts(version: str) -> None:
    """Every pinned release's own METADATA requires a FlashInfer the profile does not refuse
    (its refusal is for FlashInfer before 0.6.17, whose comm module has no SM12x build)."""
    from packaging.requirements import Requirement

    root = _tree(version)
    [meta] = list(root.glob("vllm-*.dist-info/METADATA"))
    wanted = [Requirement(line.split(":", 1)[1].strip())
              for line in meta.read_text(encoding="utf-8").splitlines()
              if line.startswith("Requires-Dist: flashinfer-python")]  # fmt: skip
    [req] = [r for r in wanted if not r.marker]
    [pinned] = [s.version for s in req.specifier if s.operator == "=="]
    [refusal] = catalog.load().profile(PROFILE).refuse
    assert pinned not in refusal.releases, f"vLLM {version} pins flashinfer {pinned}"
