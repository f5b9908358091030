"""The MoE runner patches write the same bytes on every release as the code they replaced.

`patchkit/moe.py` once derived the SM120 branch from the release's SM100 branch on the syntax
tree; each patch now inserts a literal branch of its own. `moe_outputs.toml` holds the sha256 of
what the derivation wrote (our output, not upstream's code), per release and patch, alone and in
the moe profile's order on a file the patches share. Here the patches run on each release's
real files: where a hash is recorded the text must hash to it, and elsewhere the file must be
left as it is (a template must not start applying where the derivation did not).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from packaging.version import Version
from realcache import release_set

from sm120patch.maintain import releases, trees
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
VERSIONS = sorted(
    {v for by_patch in RECORDED.values() for by in by_patch.values() for v in by}
    | set(release_set("sglang")),
    key=Version,
)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def release_tree(version: str) -> Path:
    if releases.cached("sglang", version) is None and not releases.index_reachable():
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


@pytest.mark.parametrize("version", VERSIONS)
def test_same_bytes_as_the_derived_branch(version: str) -> None:
    tree = release_tree(version)
    cat = catalog.load()
    seen = 0
    for rel, group in files_of(tree, [cat.patches[p] for p in PATCHES]).items():
        text = (tree / rel).read_text(encoding="utf-8")
        for patch in group:
            res = transform_text([patch], rel, text)
            want = RECORDED["alone"][patch.id].get(version, sha(text))
            assert sha(res.after) == want, f"{patch.id} on {version}: {res.outcomes[0].describe()}"
            applied = res.outcomes[0].status is Status.APPLIED
            assert applied == (version in RECORDED["alone"][patch.id]), res.outcomes[0].describe()
            seen += applied
        chain = transform_text(group, rel, text)
        steps = dict(chain.step_texts())
        for outcome in chain.outcomes:
            want = RECORDED["chained"][outcome.patch].get(version)
            if want is not None:
                assert sha(steps[outcome.patch]) == want, f"{outcome.describe()} (chained)"
            else:
                assert outcome.patch not in steps, f"{outcome.describe()} (chained)"
    recorded = sum(version in RECORDED["alone"][p] for p in PATCHES)
    assert seen == recorded, f"{seen} patches applied on {version}, {recorded} recorded"
