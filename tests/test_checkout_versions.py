"""A checkout's version is what its own packaging says (docs/operator.md, "A checkout's
version"), on small repositories built in the shapes upstream keeps: release tags on release
branches with an old tag still reachable from main, a fork, an editable install's record, a dev
build, FlashInfer's version.txt, and sm120patch's own commits on top."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trees
from packaging.specifiers import SpecifierSet
from trees import SGLANG_SCM_PYPROJECT, commit_all, init_repo, make_tree

from sm120patch import targets
from sm120patch.cli import main
from sm120patch.patchkit import versions
from sm120patch.plan.catalog import Profile
from sm120patch.targets import finding

SCM_SGLANG = SGLANG_SCM_PYPROJECT
# setuptools-scm's own `git describe`: no describe command of the project's.
SCM_DEFAULT = "".join(
    line for line in SGLANG_SCM_PYPROJECT.splitlines(keepends=True)
    if not line.startswith(("git_describe_command", "version_file", "fallback"))
)  # fmt: skip


def git(root: Path, *args: str) -> str:
    return trees.git(root, *args).strip()


def commit(root: Path, name: str, message: str = "") -> str:
    (root / "log.txt").write_text((root / "log.txt").read_text() + name + "\n")
    return commit_all(root, message or name)


def sglang_repo(tmp_path: Path, pyproject: str | None = SCM_SGLANG) -> Path:
    """An SGLang-shaped repository (the package under python/, setuptools-scm's record
    ignored as upstream ignores it) with one commit on main."""
    root = tmp_path / "sglang"
    (root / "python" / "sglang").mkdir(parents=True)
    (root / "python" / "sglang" / "__init__.py").write_text("")
    if pyproject is not None:
        (root / "python" / "pyproject.toml").write_text(pyproject)
    (root / ".gitignore").write_text("python/sglang/_version.py\n")
    (root / "log.txt").write_text("")
    init_repo(root)
    commit(root, "first")
    return root


def upstream_shape(root: Path) -> dict[str, str]:
    """Upstream's history: an old release tagged on main, then release branches cut from main
    whose tags main never gets; main goes on past the last branch point."""
    shas = {"old": commit(root, "old release")}
    git(root, "tag", "v0.5.6.post2")
    shas["cut22"] = commit(root, "main work")
    git(root, "checkout", "-q", "-b", "release/v0.5.22")
    commit(root, "release 0.5.22")
    git(root, "tag", "-a", "-m", "0.5.22", "v0.5.22")  # an annotated tag, as releases are
    git(root, "checkout", "-q", "main")
    shas["cut23"] = commit(root, "more main work")
    git(root, "checkout", "-q", "-b", "release/v0.5.23")
    shas["v0.5.23"] = commit(root, "release 0.5.23")
    git(root, "tag", "v0.5.23")
    git(root, "tag", "v0.5.24rc0-nope")  # not v*.*.*-shaped for SGLang's rule: never counted
    git(root, "checkout", "-q", "main")
    commit(root, "main after the cut")
    shas["main"] = commit(root, "main head")
    return shas


def version_of(root: Path, kind: str = "sglang") -> targets.Target:
    return finding.find(kind, root)


# ---- SGLang's setuptools-scm configuration --------------------------------------------------
def test_main_past_a_release_on_its_branch_is_a_dev_build_of_the_next_never_the_old_tag(tmp_path):
    root = sglang_repo(tmp_path)
    shas = upstream_shape(root)
    found = version_of(root)
    # SGLang's rule: the highest v*.*.* tag anywhere (v0.5.23), counted from its merge base
    # with main (two commits of main since the cut), as `pip install -e` records it.
    assert git(root, "merge-base", "v0.5.23", "HEAD") == shas["cut23"]
    assert found.layout == "git"
    assert found.version == f"0.5.24.dev2+g{shas['main'][:9]}"
    assert "0.5.6" not in found.version
    assert "setuptools-scm, tag v0.5.23 + 2" in found.version_source


def test_a_release_branch_at_its_tag_is_that_release(tmp_path):
    root = sglang_repo(tmp_path)
    upstream_shape(root)
    git(root, "checkout", "-q", "v0.5.23")
    assert version_of(root).version == "0.5.23"
    git(root, "checkout", "-q", "v0.5.22")  # an annotated tag: its commit is the one tagged
    assert version_of(root).version == "0.5.22"


def test_sm120patch_commits_never_change_the_version(tmp_path):
    root = sglang_repo(tmp_path)
    upstream_shape(root)
    for start in ("main", "v0.5.23"):
        git(root, "checkout", "-q", start)
        before = version_of(root).version
        git(root, "checkout", "-q", "-B", "sm120patch/moe")
        for pid in ("sglang.moe-backend", "sglang.moe-backend-qwen3"):
            commit(root, pid, f"sm120patch: {pid}\n\nSm120patch-Patch: {pid}\n")
        assert version_of(root).version == before, start
        # a commit of the user's on top of them is drift (status says so), not a new release
        commit(root, "a fix of mine")
        assert version_of(root).version == before, start
        git(root, "checkout", "-q", "main")
        git(root, "branch", "-q", "-D", "sm120patch/moe")


def test_a_fork_with_commits_of_its_own_counts_them(tmp_path):
    root = sglang_repo(tmp_path)
    shas = upstream_shape(root)
    git(root, "checkout", "-q", "-b", "ours", "v0.5.23")
    head = [commit(root, f"ours {i}") for i in range(3)][-1]
    # the tag is below the fork's head: counted from it, as git describe would
    assert version_of(root).version == f"0.5.24.dev3+g{head[:9]}"
    assert shas["v0.5.23"] != head


def test_default_describe_refuses_an_old_tag_reachable_from_main(tmp_path):
    root = sglang_repo(tmp_path, SCM_DEFAULT)
    upstream_shape(root)
    found = version_of(root)
    assert found.version == "unknown"
    assert "v0.5.6.post2" in found.version_source and "v0.5.23" in found.version_source
    assert found.version_source.endswith("state it with --sglang-version VERSION")
    # where no higher release tag sits elsewhere, the nearest tag is the version's base
    git(root, "tag", "-d", "v0.5.22", "v0.5.23", "v0.5.24rc0-nope")
    head = git(root, "rev-parse", "HEAD")
    assert version_of(root).version == f"0.5.6.post3.dev4+g{head[:9]}"
    git(root, "checkout", "-q", "v0.5.6.post2")
    assert version_of(root).version == "0.5.6.post2"


def test_a_clone_without_tags_reads_the_editable_record_else_unknown(tmp_path):
    root = sglang_repo(tmp_path)
    found = version_of(root)
    assert found.version == "unknown", "never the fallback_version 0.0.0.dev0"
    assert "no v*.*.* tag" in found.version_source
    record = root / "python" / "sglang" / "_version.py"
    record.write_text("__version__ = version = '0.0.0.dev0'\n")  # a build that found no tag
    assert version_of(root).version == "unknown"
    record.write_text(
        "version: str\n__version__: str\n__version__ = version = '0.5.23'\n"
        "__version_tuple__ = version_tuple = (0, 5, 23)\n"
    )
    found = version_of(root)
    assert (found.version, found.version_source) == (
        "0.5.23", "sglang/_version.py, written by its editable install")  # fmt: skip


def test_the_tag_only_form_counts_the_commits_past_the_tag(tmp_path):
    """SGLang's setup around 0.5.10 ran the script with --tag-only, which names the highest
    tag for every commit: main would read as that release; it is counted as the later form."""
    root = sglang_repo(tmp_path, SCM_SGLANG.replace('.py"]', '.py", "--tag-only"]'))
    shas = upstream_shape(root)
    assert version_of(root).version == f"0.5.24.dev2+g{shas['main'][:9]}"


def test_a_version_attribute_named_by_setuptools(tmp_path):
    root = sglang_repo(tmp_path, '[project]\nname = "sglang"\ndynamic = ["version"]\n'
                       '[tool.setuptools.dynamic]\nversion = {attr = "sglang.version.__version__"}\n')
    (root / "python" / "sglang" / "version.py").write_text('__version__ = "0.4.6.post5"\n')
    commit(root, "version")
    found = version_of(root)
    assert found.version == "0.4.6.post5"
    assert "[tool.setuptools.dynamic] version from python/sglang/version.py" in found.version_source


def test_a_static_project_version_and_an_unknown_describe_command(tmp_path):
    root = sglang_repo(tmp_path, '[project]\nname = "sglang"\nversion = "0.5.1.post3"\n')
    assert version_of(root).version == "0.5.1.post3"
    other = sglang_repo(tmp_path / "x", SCM_SGLANG.replace("python/tools/get_version_tag.py",
                                                           "tools/mine.sh"))  # fmt: skip
    git(other, "tag", "v0.5.23")
    assert version_of(other).version == "unknown"
    assert "a program of the checkout's" in version_of(other).version_source


# ---- FlashInfer's version.txt -------------------------------------------------------------------
def flashinfer_repo(tmp_path: Path, version_txt: str) -> Path:
    root = tmp_path / "flashinfer"
    (root / "flashinfer").mkdir(parents=True)
    (root / "flashinfer" / "__init__.py").write_text("")
    (root / "version.txt").write_text(version_txt + "\n")
    (root / ".gitignore").write_text("flashinfer/_build_meta.py\n")
    (root / "log.txt").write_text("")
    init_repo(root)
    commit(root, "first")
    git(root, "tag", "v0.6.5")  # an old tag: version.txt decides, not git describe
    commit(root, "main")
    return root


def test_flashinfer_reads_version_txt_and_a_dev_builds_record(tmp_path):
    root = flashinfer_repo(tmp_path, "0.7.4")
    found = version_of(root, "flashinfer")
    assert found.version == "0.7.4"
    assert found.version_source.startswith("version.txt at ")
    meta = root / "flashinfer" / "_build_meta.py"
    meta.write_text('"""Build metadata."""\n__version__ = "0.7.4.dev3"\n__git_commit__ = "x"\n')
    assert version_of(root, "flashinfer").version == "0.7.4.dev3"
    meta.write_text('__version__ = "0.7.2"\n')  # stale: built before version.txt moved on
    assert version_of(root, "flashinfer").version == "0.7.4"
    (root / "version.txt").write_text("0.7.5\n")  # uncommitted: the commit's version counts
    assert version_of(root, "flashinfer").version == "0.7.4"


# ---- PEP 440 in pins ------------------------------------------------------------------------------
def test_dev_and_local_versions_compare_as_pep_440_says():
    prof = Profile("p", "", "recommended", (), {"sglang": SpecifierSet(">=0.5.4,<0.5.24")})
    upper = Profile("q", "", "recommended", (), {"sglang": SpecifierSet("<=0.5.23")})
    next_ = Profile("r", "", "recommended", (), {"sglang": SpecifierSet(">=0.5.24")})
    assert prof.pinned("sglang", "0.5.23")
    assert not prof.pinned("sglang", "0.5.24.dev3")  # a dev build of 0.5.24 is not 0.5.24 ...
    assert not next_.pinned("sglang", "0.5.24.dev3")  # ... nor after it
    assert prof.pinned("sglang", "0.5.24.dev3+g123456789") is False
    assert upper.pinned("sglang", "0.5.23+g1234")  # a local version is its public version
    assert prof.pinned("sglang", "0.5.23.post1") and prof.pinned("sglang", "0.5.23rc1")
    assert str(versions.base_release("0.5.9.dev12")) == "0.5.9.dev12"


@pytest.mark.parametrize(
    ("tag", "distance", "scheme", "local", "expected"),
    [
        ("v0.5.23", 0, "guess-next-dev", "node-and-date", "0.5.23"),
        ("v0.5.23", 3, "guess-next-dev", "node-and-date", "0.5.24.dev3+gabcdef012"),
        ("0.5.10.post1", 2, "guess-next-dev", "no-local-version", "0.5.10.post2.dev2"),
        ("v0.5.10rc0", 1, "guess-next-dev", "no-local-version", "0.5.10rc1.dev1"),
        ("0.6.0.dev0", 4, "guess-next-dev", "no-local-version", "0.6.0.dev4"),
        ("0.6.0.dev3", 4, "guess-next-dev", "no-local-version", None),
        ("0.5.23", 5, "post-release", "node-and-date", "0.5.23.post5+gabcdef012"),
        ("0.5.23.post1", 5, "post-release", "no-local-version", None),
        ("0.5.23", 5, "no-guess-dev", "no-local-version", "0.5.23.post1.dev5"),
        ("0.5.23", 5, "calver-by-date", "no-local-version", None),
        ("0.5.23", 5, "guess-next-dev", "my-scheme", None),
    ],
)
def test_scm_version_as_setuptools_scm_computes_it(tag, distance, scheme, local, expected):
    parsed = versions.tag_version(tag)
    assert parsed is not None
    got = versions.scm_version(
        parsed, distance, "abcdef0123456789", version_scheme=scheme, local_scheme=local
    )
    assert got == expected


# ---- unknown: refused as outside the pins, with how to state it -----------------------------------
def unknown_sglang(tmp_path: Path) -> Path:
    root = make_tree(tmp_path, "sglang", "0.5.8", "git")
    (root / "python" / "sglang" / "version.py").unlink()
    commit_all(root, "no version file")
    return root


def test_an_unknown_version_refuses_with_the_flag_that_states_it(tmp_path, capsys):
    sg = unknown_sglang(tmp_path)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]
    with pytest.raises(SystemExit) as exc:
        main(["apply", "moe", *where, "--dry-run", "--no-gpu-check"])
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert "SGLang version unknown (no version file in the tree; state it with " in err
    assert "--sglang-version VERSION): profile moe is pinned to" in err
    assert "state the version (--sglang-version VERSION), or apply anyway" in err
    next_line = next(line for line in err.splitlines() if line.lstrip().startswith("next: "))
    assert next_line.rstrip().endswith("--dry-run --no-gpu-check --force"), next_line
    # stated, it is that version (and a stated version outside the pins refuses as such)
    with pytest.raises(SystemExit) as exc:
        main(["apply", "moe", *where, "--sglang-version", "0.5.8", "--dry-run", "--no-gpu-check"])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    with pytest.raises(SystemExit) as exc:
        main(["apply", "moe", *where, "--sglang-version", "0.1.0", "--dry-run", "--no-gpu-check"])
    assert exc.value.code == 1
    assert "SGLang 0.1.0 is outside the pins of profile moe" in capsys.readouterr().err
    for command in ("status", "doctor"):  # each says why, and how to state it, in one line
        with pytest.raises(SystemExit):
            main([command, *where])
        assert ("  version unknown: no version file in the tree; state it with --sglang-version "
                "VERSION") in capsys.readouterr().out.splitlines()  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main(["status", *where, "--sglang-version", "0.5.x"])
    assert exc.value.code == 2
    assert "not a PEP 440 version" in capsys.readouterr().err


def test_a_stated_version_says_what_the_tree_reads(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    found = finding.find("sglang", sg, "0.5.9")
    assert found.version == "0.5.9"
    assert found.version_source.startswith("--sglang-version; the tree reads 0.5.8 (")
    assert finding.find("sglang", sg).version == "0.5.8"


# ---- a .git above a target ------------------------------------------------------------------------
def test_a_repository_above_that_does_not_track_the_package_is_not_a_checkout(tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    init_repo(tmp_path)  # a project holding the venv, tracking none of it
    found = finding.find("sglang", site)
    assert (found.layout, found.root) == ("installed", site)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the repository another owner")
def test_a_repository_above_owned_by_another_user_is_not_read(tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    commit_all(init_repo(tmp_path), "someone else's repository tracking the venv")
    for path in (tmp_path, tmp_path / ".git"):
        os.chown(path, 65534, 65534)
    found = finding.find("sglang", site)  # no refusal: it is not the package owner's checkout
    assert (found.layout, found.version) == ("installed", "0.5.8")
    # the repository of the package's owner, who is not the user running sm120patch: refused
    os.chown(site / "sglang", 65534, 65534)
    with pytest.raises(targets.Refused, match="owned by another user"):
        finding.find("sglang", site)
