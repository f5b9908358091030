"""The vllm-allreduce-fusion profile on every pinned vLLM release's own files: each patch's
outcome is the one its facts give, the patched file compiles, the patch's independent `check`
holds, only the site's lines change, and a second run finds it already applied; the profile's
three patches together (two in one file, as the planner chains them) give what each gives alone.

The releases come from the release cache as their `.py` files (`maintain/sources.py`: never the
~240 MB wheel). vLLM is not yet a kind the generic site tier (test_sites.py) sweeps, hence this
file; without the index and the cache the tests skip, saying so."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sm120patch.maintain import releases, sources
from sm120patch.patchkit import sitecheck
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
@pytest.mark.parametrize("patch_id", catalog.load().profile(PROFILE).patches)
def test_each_patch_on_the_release(version: str, patch_id: str) -> None:
    patch = catalog.load().patches[patch_id]
    [fact] = patch.facts_at(version)  # every pinned release has exactly one fact
    assert fact.file is not None
    root = _tree(version)
    text = (root / fact.file).read_text(encoding="utf-8")
    res = transform_text([patch], fact.file, text)
    [outcome] = res.outcomes
    assert outcome.status is fact.status is Status.APPLIED, outcome.describe()
    assert patch.pick_file(lambda rel: _read(root, rel)) == fact.file
    compile(res.after, fact.file, "exec", dont_inherit=True)
    assert patch.check is not None
    spans = patch.check(ast.parse(res.before), ast.parse(res.after), fact)
    sitecheck.only_in(res.before, res.after, spans)
    [again] = transform_text([patch], fact.file, res.after).outcomes
    assert again.status is Status.ALREADY_APPLIED, again.describe()


def _read(root: Path, rel: str) -> str | None:
    path = root / rel
    return path.read_text(encoding="utf-8") if path.is_file() else None


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
