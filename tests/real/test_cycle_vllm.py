"""The operator's whole cycle for every profile that patches vLLM, on the newest pinned vLLM
release its pins allow (0.34.0 when this was written), from the release cache's sources
(`maintain.sources`): installed (the package, its dist-info and the wheel's RECORD) and as a
checkout kept as upstream keeps one (the package at the root, setuptools-scm's pyproject table,
the release tagged v<version> on its release branch, no _version.py):

    apply --dry-run (the diff, nothing written), pin on the pristine tree, apply, status, ensure
    twice, pin again (the same lock), apply/ensure --locked on the same tree, then on a fresh
    copy (a clone of the release branch, for a checkout), and revert --all byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from packaging.version import Version
from test_cycle_newest import cli, git
from trees import VLLM_SCM_PYPROJECT, tree_hash

from sm120patch.maintain import releases, sources
from sm120patch.plan import catalog

pytestmark = pytest.mark.real

# A `refused` profile (vllm-fp8-moe) never writes: it has no cycle, and
# tests/real/test_vllm_gates_real.py holds its refusal on every pinned release.
PROFILES = sorted(n for n, p in catalog.load().profiles.items()
                  if "vllm" in p.targets and p.status != "refused")
LAYOUTS = ("installed", "git")


def newest(profile: str) -> str:
    prof = catalog.load().profile(profile)
    pinned = [v for v in releases.DEFAULT_RELEASES["vllm"] if prof.pinned("vllm", v)]
    assert pinned, f"{profile} pins none of {releases.DEFAULT_RELEASES['vllm']}"
    return max(pinned, key=Version)


@pytest.fixture(scope="module")
def reachable() -> None:
    wanted = releases.DEFAULT_RELEASES["vllm"]
    if not releases.index_reachable() and not all(
        (releases.trees_dir() / f"vllm-{v}").is_dir() for v in wanted
    ):
        pytest.skip(f"the index ({releases.index_sources()}) is unreachable and vLLM's "
                    "sources are not all cached")  # fmt: skip


def installed(base: Path, version: str) -> Path:
    site = base / "site"
    tree = sources.tree("vllm", version)
    for entry in tree.iterdir():
        if entry.is_dir():
            shutil.copytree(entry, site / entry.name)
    return site


def checkout(base: Path, version: str) -> Path:
    root = base / "vllm"
    shutil.copytree(sources.tree("vllm", version) / "vllm", root / "vllm")
    (root / "vllm" / "_version.py").unlink(missing_ok=True)  # a build's record, not tracked
    (root / "pyproject.toml").write_text(VLLM_SCM_PYPROJECT)
    (root / ".gitignore").write_text("vllm/_version.py\n__pycache__/\n")
    git(base, "init", "-q", "-b", "main", str(root))
    ident = ("-c", "user.name=T", "-c", "user.email=t@example.com")
    git(root, "add", "-A")
    git(root, *ident, "commit", "-q", "-m", "main")
    git(root, "checkout", "-q", "-b", f"releases/v{version}")
    git(root, *ident, "commit", "-q", "--allow-empty", "-m", f"release {version}")
    git(root, *ident, "tag", "-a", "-m", f"v{version}", f"v{version}")
    return root


def state(root: Path) -> dict:
    code, out, err = cli("status", "--vllm", str(root), "--json")
    assert code == 0, err
    [target] = [t for t in json.loads(out)["targets"] if t["kind"] == "vllm"]
    return target


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("profile", PROFILES)
def test_the_operators_cycle_on_the_newest_vllm(
    profile: str, layout: str, reachable: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SM120PATCH_CACHE", str(tmp_path / "plan-cache"))
    version = newest(profile)
    build = installed if layout == "installed" else checkout
    root = build(tmp_path / "box", version)
    v = ["--vllm", str(root)]
    before = tree_hash(root)
    assert (state(root)["version"], state(root)["state"]) == (version, "pristine")

    code, out, err = cli("apply", profile, *v, "--dry-run")
    assert code == 0, err
    assert "diff --git a/vllm/" in out
    assert tree_hash(root) == before
    pristine_lock, lock = tmp_path / "pristine.lock", tmp_path / "applied.lock"
    code, _, err = cli("pin", profile, *v, "-o", str(pristine_lock))
    assert code == 0, err
    code, _, err = cli("apply", profile, *v, "--no-gpu-check")
    assert code == 0, err
    found = state(root)
    assert (found["version"], found["state"], found["profile"]) == (version, "applied", profile)
    for _ in range(2):
        code, out, err = cli("ensure", profile, *v, "--no-gpu-check")
        assert code == 0 and "nothing was changed" in out, err
    code, _, err = cli("pin", profile, *v, "-o", str(lock))
    assert code == 0, err
    assert lock.read_text() == pristine_lock.read_text()
    assert f'[versions]\nvllm = "{version}"' in lock.read_text() and "[[steps]]" in lock.read_text()
    for verb in ("apply", "ensure", "apply"):
        code, _, err = cli(verb, "--locked", str(lock), *v, "--no-gpu-check")
        assert code == 0, f"{verb} --locked on the applied tree: {err}"

    if layout == "installed":
        copy = installed(tmp_path / "copy", version)
    else:
        copy = tmp_path / "clone"
        git(tmp_path, "clone", "-q", "--branch", f"releases/v{version}", str(root), str(copy))
    copy_before = tree_hash(copy)
    for verb in ("apply", "ensure", "apply"):
        code, _, err = cli(verb, "--locked", str(lock), "--vllm", str(copy), "--no-gpu-check")
        assert code == 0, f"{verb} --locked on a fresh copy: {err}"
    assert state(copy)["state"] == "applied"

    for r, was in ((root, before), (copy, copy_before)):
        code, _, err = cli("revert", "--all", "--vllm", str(r))
        assert code == 0, err
        assert tree_hash(r) == was
        assert state(r)["state"] == "pristine"


def test_a_dev_build_of_vllm_main_keeps_its_version_through_the_cycle(
    reachable: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's main past the newest release tag (two commits of its own): setuptools-scm calls it
    a dev build of the next patch release, and sm120patch's own commits on its branch do not
    move that version (the SGLang twin is in test_checkout_versions_real.py)."""
    monkeypatch.setenv("SM120PATCH_CACHE", str(tmp_path / "plan-cache"))
    version = newest("vllm-moe")
    root = checkout(tmp_path / "box", version)
    git(root, "checkout", "-q", "main")
    git(root, "merge", "-q", "--ff-only", f"releases/v{version}")
    ident = ("-c", "user.name=T", "-c", "user.email=t@example.com")
    for n in (1, 2):
        (root / "vllm" / f"upstream_{n}.py").write_text(f"N = {n}\n")
        git(root, "add", "-A")
        git(root, *ident, "commit", "-q", "-m", f"upstream work {n}")
    head = git(root, "rev-parse", "HEAD").strip()
    major, minor, micro = Version(version).release
    dev = f"{major}.{minor}.{micro + 1}.dev2+g{head[:9]}"
    before = tree_hash(root)
    assert state(root)["version"] == dev
    v = ["--vllm", str(root)]
    code, _, err = cli("apply", "vllm-moe", *v, "--no-gpu-check")
    assert code == 0, err
    found = state(root)
    assert (found["version"], found["state"]) == (dev, "applied")
    assert int(git(root, "rev-list", "--count", f"{head}..HEAD")) >= 1  # its commits are there
    code, out, err = cli("ensure", "vllm-moe", *v, "--no-gpu-check")
    assert code == 0 and "nothing was changed" in out, err
    code, _, err = cli("revert", "--all", *v)
    assert code == 0, err
    assert tree_hash(root) == before and state(root)["version"] == dev
