"""The apply's transaction on a checkout, as StGit makes it: the commits are built in git's
object database, the patch branch moves once (its reflog gets one entry, whatever the number
of patches), then one checkout. A kill before the branch moves leaves nothing to undo, and one
at any later boundary is settled by `recover` (`tests/test_reliability_kill.py` kills at each);
here, git's half-done checkout, and a branch or HEAD moved under the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from killing import KILL_ENV, cli, run
from trees import git, make_tree, tree_hash

from sm120patch.engine import interrupts

BRANCH = "sm120patch/all"


@pytest.fixture
def checkouts(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    return sg, fi


def where(sg: Path, fi: Path) -> list[str]:
    return ["--sglang", str(sg), "--flashinfer", str(fi)]


def apply_all(sg: Path, fi: Path) -> list[str]:
    return ["apply", "all", *where(sg, fi), "--no-gpu-check"]


def reflog(root: Path, ref: str) -> list[str]:
    """The reflog entries of `ref` (its messages, newest first); [] when it has none."""
    if ref != "HEAD" and not git(root, "for-each-ref", f"refs/heads/{ref}").strip():
        return []
    return git(root, "reflog", "show", "--format=%gs", ref, "--").splitlines()


def test_apply_all_moves_the_patch_branch_once(checkouts):
    """One reflog entry for the patch branch and one for HEAD (the checkout), however many
    commits; each commit one patch's, with its trailers; again after `revert --keep-branch`
    and a second apply, which reuses the branch: one entry more."""
    sg, fi = checkouts
    heads = {root: reflog(root, "HEAD") for root in (sg, fi)}
    code, out, err = cli(*apply_all(sg, fi))
    assert code == 0, err
    for root in (sg, fi):
        commits = git(root, "rev-list", f"main..{BRANCH}").split()
        assert len(reflog(root, BRANCH)) == 1, reflog(root, BRANCH)
        assert len(reflog(root, "HEAD")) == len(heads[root]) + 1, reflog(root, "HEAD")
        assert git(root, "rev-parse", "--abbrev-ref", "HEAD").strip() == BRANCH
        # Nothing staged or changed is left: index and work tree are the branch's.
        assert git(root, "status", "--porcelain", "--untracked-files=no") == ""
        trailer = "--format=%(trailers:key=Sm120patch-Patch,valueonly)"
        patches = git(root, "log", trailer, f"main..{BRANCH}").split()
        assert len(patches) == len(commits) == len(set(patches)), patches
        body = git(root, "log", "-1", "--format=%B", BRANCH)
        assert body.startswith("sm120patch: ") and "\n\n\n" not in body, body
        assert "Sm120patch-Profile: all\nSm120patch-Version: " in body, body
    assert len(git(sg, "rev-list", f"main..{BRANCH}").split()) > 1  # the case that mattered
    assert cli("revert", "--all", *where(sg, fi), "--keep-branch")[0] == 0
    for root in (sg, fi):
        # Other commits (in the same second the same ones would leave the branch unmoved).
        git(root, "config", "user.name", "Another User")
    assert cli(*apply_all(sg, fi))[0] == 0
    for root in (sg, fi):
        assert len(reflog(root, BRANCH)) == 2, reflog(root, BRANCH)


def test_a_checkout_killed_with_git_half_way_is_rolled_back(checkouts):
    """git killed inside the checkout (`kill -9` of the control group): some files already
    hold the patched text, one is cut short, `index.lock` is left and HEAD never moved.
    `recover` removes the lock, puts every file back from the user's branch and drops the
    patch branch."""
    sg, fi = checkouts
    pristine = tree_hash(sg), tree_hash(fi)
    assert run(*apply_all(sg, fi), env={KILL_ENV: "after-branch:1"}).returncode == -9
    journal = json.loads((sg / ".git/sm120patch/sglang/journal.json").read_text())
    touched = [f["path"] for f in journal["files"]]
    assert len(touched) >= 2
    written, cut = touched[0], touched[1]
    (sg / written).write_bytes(git(sg, "show", f"{BRANCH}:{written}").encode())
    (sg / cut).write_bytes(b"")
    (sg / ".git/index.lock").write_bytes(b"")
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    code, out, err = cli("recover", *where(sg, fi))
    assert code == 0, err
    assert "left by a killed git" in out and "rolled back" in out, out
    assert (tree_hash(sg), tree_hash(fi)) == pristine
    assert not (sg / ".git/index.lock").exists()


def test_a_branch_made_meanwhile_is_refused_and_kept(checkouts, monkeypatch):
    """Someone makes the patch branch while the commits are built: the ref transaction
    refuses (StGit's rule), nothing is changed, and their branch is left as they made it."""
    sg, fi = checkouts
    before = tree_hash(fi)

    def theirs() -> None:
        git(sg, "branch", BRANCH, "main")

    monkeypatch.setitem(interrupts.HOOKS, "after-objects", theirs)
    code, _, err = cli(*apply_all(sg, fi))
    monkeypatch.delitem(interrupts.HOOKS, "after-objects")
    assert code == 1 and "moved while sm120patch built its commits" in err, err
    assert git(sg, "rev-parse", BRANCH) == git(sg, "rev-parse", "main")
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    assert tree_hash(fi) == before
    code, out, _ = cli("status", *where(sg, fi), "--json")
    found = [(t["profile"], t["unfinished"]) for t in json.loads(out)["targets"]]
    assert found == [(None, None)] * 2


def test_head_moved_meanwhile_is_refused(checkouts, monkeypatch):
    """A commit lands on the user's branch while the commits are built on the one before:
    the branch does not move, the user's commit stays, nothing of sm120patch's is left."""
    sg, fi = checkouts

    def commit() -> None:
        (sg / "NOTES").write_text("mine\n")
        git(sg, "add", "NOTES")
        git(sg, "commit", "-q", "-m", "mine")

    monkeypatch.setitem(interrupts.HOOKS, "after-objects", commit)
    code, _, err = cli(*apply_all(sg, fi))
    monkeypatch.delitem(interrupts.HOOKS, "after-objects")
    assert code == 1 and "moved while sm120patch built its commits" in err, err
    assert git(sg, "log", "-1", "--format=%s", "main").strip() == "mine"
    assert reflog(sg, BRANCH) == [] and reflog(fi, BRANCH) == []
    assert git(sg, "status", "--porcelain") == ""


def test_the_files_git_checked_out_are_made_durable(checkouts, monkeypatch):
    """git writes the work tree without fsync: every file the apply's checkout wrote, and its
    directory, is fsync-ed before the manifest commits the apply."""
    import os

    sg, fi = checkouts
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert cli(*apply_all(sg, fi))[0] == 0
    monkeypatch.undo()
    for root in (sg, fi):
        for rel in git(root, "diff", "--name-only", "main", BRANCH).split():
            assert str(root / rel) in synced, rel
            assert str((root / rel).parent) in synced, rel
