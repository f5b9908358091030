"""A checkout's version on the newest releases' files (SGLang 0.5.23, FlashInfer 0.7.4 from the
index), in repositories shaped as upstream keeps them: SGLang's setuptools-scm setup with release
tags on release branches and main ahead, FlashInfer's version.txt, an editable install's record,
a dev build, and an apply that must leave the version as it was.

The packaging files (pyproject.toml's setuptools-scm table, version.txt) are written here with
the settings upstream's trees carry; the package files are the released ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.specifiers import SpecifierSet
from trees import SGLANG_SCM_PYPROJECT, commit_all, init_repo
from trees import git as git_in

from sm120patch.cli import main
from sm120patch.maintain import releases, trees
from sm120patch.plan import catalog
from sm120patch.targets import finding
from sm120patch.targets import versions as target_versions

pytestmark = pytest.mark.real

SGLANG, FLASHINFER = "0.5.23", "0.7.4"
@pytest.fixture(scope="module")
def released():
    try:
        return trees.tree("sglang", SGLANG), trees.tree("flashinfer", FLASHINFER)
    except releases.ReleaseError as exc:  # offline, and not in the cache
        pytest.skip(f"SGLang {SGLANG} and FlashInfer {FLASHINFER} are needed: {exc}")


def git(root: Path, *args: str) -> str:
    return git_in(root, *args).strip()


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def sglang_checkout(tmp: Path, tree: Path) -> Path:
    """SGLang's layout: the released package under python/, its record untracked."""
    root = tmp / "sglang"
    shutil.copytree(tree / "sglang", root / "python" / "sglang",
                    ignore=shutil.ignore_patterns("_version.py"))  # fmt: skip
    (root / "python" / "pyproject.toml").write_text(SGLANG_SCM_PYPROJECT)
    (root / ".gitignore").write_text("python/sglang/_version.py\n__pycache__/\n")
    commit_all(init_repo(root), "sglang")
    return root


def upstream_history(root: Path) -> None:
    """An old release tagged on main; later releases tagged on release branches cut from main,
    the newest the release's own files; main two commits past the last cut."""
    git(root, "tag", "v0.5.6.post2")  # old, and reachable from main for good
    commit_all(root, "main work")
    for release in ("0.5.22", SGLANG):
        git(root, "checkout", "-q", "-b", f"release/v{release}")
        commit_all(root, f"release {release}")
        git(root, "tag", "-a", "-m", release, f"v{release}")
        git(root, "checkout", "-q", "main")
        commit_all(root, "main after the cut")
    commit_all(root, "main head")


def flashinfer_tree(tmp: Path, tree: Path, layout: str) -> Path:
    """FlashInfer's files as a checkout (version.txt at the root, as upstream keeps it, holding
    the release's own version from its METADATA) or as an installed copy."""
    root = tmp / f"flashinfer-{layout}"
    shutil.copytree(tree, root, ignore=shutil.ignore_patterns(".sm120patch-tree.json"))
    if layout == "git":
        info = next(root.glob("flashinfer_python-*.dist-info"))
        released = target_versions._metadata_version(info / "METADATA")
        shutil.rmtree(info)
        (root / "version.txt").write_text(f"{released}\n")
        (root / ".gitignore").write_text("flashinfer/_build_meta.py\n__pycache__/\n")
        commit_all(init_repo(root), "flashinfer")
        git(root, "tag", "v0.6.5")  # an old tag below main: version.txt decides, not describe
        commit_all(root, "main")
    return root


def test_main_ahead_of_the_release_branches_is_a_dev_build_of_the_next_release(tmp_path, released):
    root = sglang_checkout(tmp_path, released[0])
    upstream_history(root)
    head = git(root, "rev-parse", "HEAD")
    cut = git(root, "merge-base", f"v{SGLANG}", "HEAD")
    ahead = int(git(root, "rev-list", "--count", f"{cut}..HEAD"))
    found = finding.find("sglang", root)
    assert ahead == 2
    assert found.version == f"0.5.24.dev{ahead}+g{head[:9]}"
    # outside every profile's pins (a dev build of 0.5.24 is not a release before it) ...
    cat = catalog.load()
    assert not [p for p in cat.profiles.values() if "sglang" in p.pins
                and p.pinned("sglang", found.version)]  # fmt: skip
    # ... and never the old tag git describe reaches from main
    assert git(root, "describe", "--tags").startswith("v0.5.6.post2-")


def test_the_release_tag_then_an_apply_leaves_the_version_unchanged(tmp_path, released):
    root = sglang_checkout(tmp_path, released[0])
    upstream_history(root)
    git(root, "checkout", "-q", "-b", "deploy", f"v{SGLANG}")
    fi = flashinfer_tree(tmp_path, released[1], "installed")
    where = ["--sglang", str(root), "--flashinfer", str(fi)]
    assert finding.find("sglang", root).version == SGLANG
    code, _, err = cli("apply", "fusion", *where, "--no-gpu-check")
    assert code == 0, err
    assert git(root, "rev-parse", "--abbrev-ref", "HEAD") == "sm120patch/fusion"
    ours = git(root, "log", "--format=%B", "deploy..HEAD").count("Sm120patch-Patch:")
    assert ours >= 2  # the tool's own commits are there ...
    assert finding.find("sglang", root).version == SGLANG  # ... and do not count
    code, out, err = cli("status", *where, "--json")
    assert f'"version": "{SGLANG}"' in out, err
    # a commit of the user's on top: drift on the same release, not another release
    (root / "NOTES").write_text("mine\n")
    commit_all(root, "a note of mine")
    assert finding.find("sglang", root).version == SGLANG
    code, out, err = cli("status", *where, "--json")
    assert '"state": "drifted"' in out and '"state": "replaced"' not in out, out
    code, _, err = cli("revert", "--all", *where, "--force")
    assert code == 0, err


def test_an_editable_install_without_tags_reads_its_record(tmp_path, released):
    root = sglang_checkout(tmp_path, released[0])  # a clone without tags
    assert finding.find("sglang", root).version == "unknown"
    shutil.copy(released[0] / "sglang" / "_version.py", root / "python" / "sglang" / "_version.py")
    found = finding.find("sglang", root)
    assert (found.layout, found.version) == ("git", SGLANG)
    assert found.version_source == "sglang/_version.py, written by its editable install"


def test_flashinfer_main_reads_version_txt_and_a_dev_build_is_not_its_release(tmp_path, released):
    root = flashinfer_tree(tmp_path, released[1], "git")
    found = finding.find("flashinfer", root)
    assert found.version == FLASHINFER != git(root, "describe", "--tags").split("-")[0][1:]
    # A nightly-style build (FLASHINFER_DEV_RELEASE_SUFFIX) records a dev version: it is not
    # 0.7.4 for a pin, and a profile pinned to <0.7.4 or >=0.7.4 does not take it.
    (root / "flashinfer" / "_build_meta.py").write_text(
        f'"""Build metadata for flashinfer package."""\n__version__ = "{FLASHINFER}.dev3"\n'
    )
    dev = finding.find("flashinfer", root)
    assert dev.version == f"{FLASHINFER}.dev3"
    fusion = catalog.load().profile("fusion")
    assert fusion.pinned("flashinfer", FLASHINFER)
    from_release = catalog.Profile(
        "x", "", "experimental", (), {"flashinfer": SpecifierSet(f">={FLASHINFER}")}
    )
    assert from_release.pinned("flashinfer", FLASHINFER)
    assert not from_release.pinned("flashinfer", dev.version)


def test_a_lock_pinned_on_the_release_tag_holds_after_the_apply(tmp_path, released):
    """The fleet flow on a checkout: the lock names 0.5.23, and the tool's commits leave it so
    (it refused "lock has 0.5.23, found 0.5.23+3.g..." on the second locked run)."""
    root = sglang_checkout(tmp_path, released[0])
    upstream_history(root)
    git(root, "checkout", "-q", "-b", "deploy", f"v{SGLANG}")
    fi = flashinfer_tree(tmp_path, released[1], "installed")
    where = ["--sglang", str(root), "--flashinfer", str(fi), "--no-gpu-check"]
    lock = tmp_path / "moe.lock"
    code, _, err = cli("pin", "moe", *where[:4], "-o", str(lock))
    assert code == 0, err
    assert f'sglang = "{SGLANG}"' in lock.read_text()
    for verb in ("apply", "ensure", "apply"):
        code, _, err = cli(verb, "--locked", str(lock), *where)
        assert code == 0, (verb, err)
        assert finding.find("sglang", root).version == SGLANG
    assert git(root, "rev-parse", "--abbrev-ref", "HEAD") == "sm120patch/moe"
