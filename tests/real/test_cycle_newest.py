"""The operator's whole cycle, for every profile, on the newest SGLang and FlashInfer releases the
index lists inside the tracked range (the highest a profile's pins allow: SGLang 0.5.23 and
FlashInfer 0.7.4 when this was written), installed and as git checkouts kept as upstream keeps
them (a release tag, no generated version file; FlashInfer's version.txt):

    apply, status, ensure twice, pin (the same lock as pinned on the pristine tree, steps and
    diffs included), on the same tree apply --locked, ensure --locked and apply --locked
    again, then on a fresh copy (a clone, for a checkout) the same three, and revert --all
    byte for byte on both (the state directory aside).

A profile that refuses one of these releases (pcie-allreduce from SGLang 0.5.21) must refuse it
with the catalog's reason and change nothing. FlashInfer 0.7.4 needs none of `fusion`'s patch
(flashinfer.comm-arch is upstream from 0.6.17): that target is as wanted all along."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.version import Version
from trees import tree_hash, upstream_checkout

from sm120patch.cli import main
from sm120patch.maintain import dists, releases, trees
from sm120patch.plan import catalog, lockfile, pins
from sm120patch.targets.finding import find

pytestmark = pytest.mark.real

# The profiles on the kinds kept as distributions; one that patches vLLM (whose releases are kept
# as their sources) runs its cycle in test_cycle_vllm.py.
PROFILES = sorted(n for n, p in catalog.load().profiles.items()
                  if set(p.targets) <= set(releases.KINDS))  # fmt: skip
LAYOUTS = ("installed", "git")


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


@pytest.fixture(scope="module")
def newest() -> dict[str, str]:
    """The newest release of each kind inside the tracked range (`releases.full_range`: up to
    the highest pin), read from the index (or its cached listing)."""
    try:
        found = {kind: max(releases.available(kind), key=Version) for kind in releases.KINDS}
    except (releases.ReleaseError, ValueError) as exc:
        pytest.skip(f"the index ({releases.index_sources()}) cannot be read: {exc}")
    missing = [f"{k} {v}" for k, v in found.items() if dists.cached(k, v) is None]
    if missing and not releases.index_reachable():
        pytest.skip(f"the index is unreachable and {', '.join(missing)} is not cached")
    return found


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plan-cache")


def installed(base: Path, kind: str, version: str) -> Path:
    """`kind` as pip installs it (the package and its dist-info) in a site directory."""
    site = base / "site"
    tree = trees.tree(kind, version)
    for entry in tree.iterdir():
        if entry.is_dir():
            shutil.copytree(entry, site / entry.name)
    return site


def make(base: Path, layout: str, versions: dict[str, str]) -> list[str]:
    base.mkdir(parents=True)
    build = installed if layout == "installed" else upstream_checkout
    roots = {kind: build(base, kind, v) for kind, v in versions.items()}
    return [arg for kind, root in roots.items() for arg in (f"--{kind}", str(root))]


def fresh_clone(where: list[str], base: Path) -> list[str]:
    """A clone of each checkout of `where`, of its `main` (what a fleet node checks out; the
    reference checkout itself is on the patch branch)."""
    base.mkdir()
    out = []
    for flag, root in zip(where[::2], where[1::2], strict=True):
        clone = base / Path(root).name
        git(base, "clone", "-q", "--branch", "main", root, str(clone))
        out += [flag, str(clone)]
    return out


def roots(where: list[str]) -> list[Path]:
    return [Path(r) for r in dict.fromkeys(where[1::2])]


def everything(where: list[str]) -> dict[Path, str]:
    """Every file under each root, bytes and modes, and a checkout's HEAD and refs; the state
    directory aside (`trees.tree_hash`)."""
    return {root: tree_hash(root) for root in roots(where)}


def version_unmoved(where: list[str], newest: dict[str, str]) -> None:
    """sm120patch's own commits never change a checkout's version: it is read below them, so
    the lock, `ensure --locked` and a second `apply --locked` see the same release."""
    now = {t["kind"]: t["version"] for t in states(where).values()}
    assert now == {k: newest[k] for k in now}, now


def states(where: list[str]) -> dict[str, dict]:
    code, out, err = cli("status", *where, "--json")
    assert code == 0, err
    return {t["kind"]: t for t in json.loads(out)["targets"]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("profile", PROFILES)
def test_the_operators_cycle_on_the_newest_releases(
    profile: str, layout: str, newest: dict[str, str], plan_cache: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("SM120PATCH_CACHE", str(plan_cache))
    prof = catalog.load().profile(profile)
    where = make(tmp_path / "box", layout, {k: newest[k] for k in prof.targets})
    before = everything(where)
    assert {t["kind"]: t["version"] for t in states(where).values()} == {
        k: newest[k] for k in prof.targets}  # fmt: skip
    refused = pins.check_pins(
        prof, [find(k, r) for k, r in zip(prof.targets, where[1::2], strict=True)])
    if refused:
        # The catalog's reasons, in the words the apply and the pin refuse with; nothing changed.
        for verb in (["apply", profile, "--no-gpu-check"], ["ensure", profile, "--no-gpu-check"],
                     ["pin", profile, "-o", str(tmp_path / "x.lock")]):  # fmt: skip
            code, _, err = cli(*verb, *where)
            assert code == 1, verb
            assert all(line in " ".join(err.split()) for line in refused), err
        assert everything(where) == before
        assert not (tmp_path / "x.lock").exists()
        return

    pristine_lock, lock = tmp_path / "pristine.lock", tmp_path / "applied.lock"
    code, _, err = cli("pin", profile, *where, "-o", str(pristine_lock))
    assert code == 0, err
    code, _, err = cli("apply", profile, *where, "--no-gpu-check")
    assert code == 0, err
    version_unmoved(where, newest)
    found = states(where)
    assert {k: (t["state"], t["profile"]) for k, t in found.items()} == {
        k: ("applied", profile) for k in prof.targets}, found  # fmt: skip
    for _ in range(2):
        code, out, err = cli("ensure", profile, *where, "--no-gpu-check")
        assert code == 0, err
        assert "nothing was changed" in out
    code, _, err = cli("pin", profile, *where, "-o", str(lock))
    assert code == 0, err
    assert lock.read_text() == pristine_lock.read_text()
    assert "[[steps]]" in lock.read_text()
    # A target the lock writes nothing into is one the profile needs nothing from, recorded.
    written = {f.target for f in lockfile.read(lock).files}
    assert {k: t["needs_nothing"] for k, t in found.items()} == {
        k: k not in written for k in prof.targets}  # fmt: skip
    for verb in ("apply", "ensure", "apply"):  # the same tree
        code, _, err = cli(verb, "--locked", str(lock), *where, "--no-gpu-check")
        assert code == 0, f"{verb} --locked on the applied tree: {err}"

    copy = (make(tmp_path / "copy", layout, {k: newest[k] for k in prof.targets})
            if layout == "installed" else fresh_clone(where, tmp_path / "clone"))  # fmt: skip
    copy_before = everything(copy)
    for verb in ("apply", "ensure", "apply"):
        code, _, err = cli(verb, "--locked", str(lock), *copy, "--no-gpu-check")
        assert code == 0, f"{verb} --locked on a fresh copy: {err}"
    assert {t["state"] for t in states(copy).values()} == {"applied"}

    for w, was in ((where, before), (copy, copy_before)):
        code, _, err = cli("revert", "--all", *w)
        assert code == 0, err
        assert everything(w) == was
        assert {t["state"] for t in states(w).values()} == {"pristine"}
