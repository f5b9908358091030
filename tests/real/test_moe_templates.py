"""The MoE runner patches write the same bytes on every release as the code they replaced.

`patchkit/moe.py` once derived the SM120 branch from the release's SM100 branch on the syntax
tree; each patch now inserts a literal branch of its own. `moe_outputs.toml` holds the sha256 of
what the derivation wrote (our output, not upstream's code), per release and patch, alone and in
the moe profile's order on a file the patches share. Here the patches run on each release's
real files: where a hash is recorded the text must hash to it, and elsewhere the outcome must
be the one recorded and the file left as it is (a template must not start applying where the
derivation did not).
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.version import Version

from sm120patch.maintain import dists, releases, trees
from sm120patch.patchkit import moe
from sm120patch.patchkit.model import Patch, Status
from sm120patch.patchkit.runner import transform_text
from sm120patch.plan import catalog

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.real

PATCHES = ("sglang.moe-backend", "sglang.moe-backend-qwen3", "sglang.moe-backend-minimax")
RECORDED: dict[str, dict[str, dict[str, str]]] = tomllib.loads(
    Path(__file__).with_name("moe_outputs.toml").read_text(encoding="utf-8")
)
# Every release recorded: those where a patch applies, and the real tier's default set.
VERSIONS = sorted(
    {v for by_patch in RECORDED.values() for by in by_patch.values() for v in by}, key=Version
)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def release_tree(version: str) -> Path:
    if dists.cached("sglang", version) is None and not releases.index_reachable():
        pytest.skip(f"SGLang {version} is not in the cache and the index is unreachable")
    return trees.tree("sglang", version)


def files_of(tree: Path, patches: list[Patch]) -> dict[str, list[Patch]]:
    """The file each patch picks on this release, with the patches picking it, in order."""

    def read(rel: str) -> str | None:
        path = tree / rel
        return path.read_text(encoding="utf-8") if path.is_file() else None

    by_file: dict[str, list[Patch]] = {}
    for patch in patches:
        rel = patch.pick_file(read)
        if rel is not None:
            by_file.setdefault(rel, []).append(patch)
    return by_file


@dataclass(frozen=True)
class Alone:
    """One patch run alone on its file of one release."""

    sha: str  # of the text it left
    status: str
    said: str  # the outcome, described
    fingerprint: str | None  # of the SM100 branch it twinned, where it applied


@cache
def run(version: str) -> tuple[dict[str, Alone], dict[str, str | None]]:
    """Per patch: its run alone, and the sha256 of the text after it in the chain (None where
    it changed nothing there). Kept small: a release's syntax trees are not kept."""
    tree = release_tree(version)
    cat = catalog.load()
    alone: dict[str, Alone] = {}
    chained: dict[str, str | None] = {}
    for rel, group in files_of(tree, [cat.patches[p] for p in PATCHES]).items():
        text = (tree / rel).read_text(encoding="utf-8")
        for patch in group:
            res = transform_text([patch], rel, text)
            [outcome] = res.outcomes
            found = None
            if outcome.status is Status.APPLIED:
                spec = importlib.import_module(patch.transform.__module__)
                name, suite = moe.site(res.tree, spec.MODEL, spec.OVERRIDES_FUNC)
                found = moe.fingerprint(moe.sm100_branch(name, suite)[0])
            alone[patch.id] = Alone(sha(res.after), outcome.status.value, outcome.describe(), found)
        steps = dict(transform_text(group, rel, text).step_texts())
        chained.update({p.id: sha(steps[p.id]) if p.id in steps else None for p in group})
    return alone, chained


@pytest.mark.parametrize("version", VERSIONS)
def test_same_bytes_as_the_derived_branch(version: str) -> None:
    alone, chained = run(version)
    for pid in PATCHES:
        recorded = RECORDED["alone"][pid].get(version)
        got = alone.get(pid)
        if got is None:  # no file of its own on this release
            assert recorded is None, f"{pid} found no file on {version}"
            continue
        if recorded is None:
            assert got.status == RECORDED["not_applied"][pid].get(version), got.said
            assert got.sha == alone_unchanged(version, pid), got.said
        else:
            assert got.status == "applied" and got.sha == recorded, got.said
        assert chained[pid] == RECORDED["chained"][pid].get(version), f"{got.said} (chained)"


def alone_unchanged(version: str, pid: str) -> str:
    """The sha256 of the file `pid` picks on `version`, as the release ships it."""
    tree = release_tree(version)
    [rel] = [r for r, g in files_of(tree, [catalog.load().patches[pid]]).items()]
    return sha((tree / rel).read_text(encoding="utf-8"))


def test_every_branch_twins_a_release() -> None:
    """Each SM100 fingerprint a patch's branches list is met on some recorded release, and
    every fingerprint met there is listed."""
    met = {(pid, got.fingerprint) for v in VERSIONS for pid, got in run(v)[0].items()
           if got.fingerprint is not None}
    listed = {
        (pid, fp)
        for pid in PATCHES
        for branch in importlib.import_module(
            catalog.load().patches[pid].transform.__module__
        ).BRANCHES
        for fp in branch.sm100
    }
    assert listed == met
