"""Every verdict from the files on disk: each state of a target reached the way a user
reaches it (a reinstall, an upgrade, a branch switch, a deleted branch, a commit on the user's
branch), each command's verdict checked against the bytes; the dry run against the apply on
every refusal; ensure in each state; the smaller truths found on the way."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from killing import command, fail_writes
from trees import git, make_tree, tree_hash

from sm120patch.cli import main
from sm120patch.engine import store
from sm120patch.targets import finding

SERVER_ARGS = "sglang/srt/server_args.py"
COMM = "flashinfer/jit/comm.py"


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def module_path(root: Path, layout: str, kind: str, module: str) -> Path:
    return (root / "python" / module) if (kind == "sglang" and layout == "git") else root / module


def where(sg: Path, fi: Path) -> list[str]:
    return ["--sglang", str(sg), "--flashinfer", str(fi)]


def status_of(*args: str) -> dict[str, dict]:
    code, out, err = cli("status", *args, "--json")
    assert code == 0, err
    return {t["kind"]: t for t in json.loads(out)["targets"]}


def everything(*roots: Path) -> str:
    """Every byte under the roots, state directories and git internals included: what a
    command that "writes nothing anywhere" must leave exactly as it was."""
    h = hashlib.sha256()
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink() and p.name != "index":
                h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
            elif p.is_dir():
                h.update(p.relative_to(root).as_posix().encode() + b"/")
    return h.hexdigest()


@pytest.fixture(params=["git", "installed"])
def pair(request, tmp_path):
    layout = request.param
    return layout, make_tree(tmp_path, "sglang", "0.5.8", layout), make_tree(
        tmp_path, "flashinfer", "0.6.8", layout
    )


def reinstall(root: Path, layout: str, kind: str, module: str, original: bytes) -> None:
    """What `pip install --force-reinstall` of the same release, or `git checkout main`, does."""
    if layout == "git":
        git(root, "checkout", "-q", "main")
    else:
        module_path(root, layout, kind, module).write_bytes(original)


# ---- gone: a reinstall of the same release, or a checkout of another branch ---------------


def test_reinstall_is_gone_and_apply_reapplies_and_revert_drops_the_record(pair):
    layout, sg, fi = pair
    sa = module_path(sg, layout, "sglang", SERVER_ARGS)
    original = sa.read_bytes()
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    patched = sa.read_bytes()
    reinstall(sg, layout, "sglang", SERVER_ARGS, original)
    assert sa.read_bytes() == original
    found = status_of("--sglang", str(sg))["sglang"]
    assert found["state"] == "gone", found
    assert "the patches are" in found["message"]
    code, out, err = cli("status", "--sglang", str(sg))
    assert ": gone" in out and "profile moe" in out

    # apply says what it found and re-applies: the bytes are patched again, the state applied.
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert "the patches are" in out and "already applied" not in out
    assert sa.read_bytes() == patched
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "applied"
    if layout == "git":  # the kept branch held only sm120patch's commits: reused
        assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/moe"

    # gone again, then revert: nothing to restore, the record is dropped, the bytes untouched.
    reinstall(sg, layout, "sglang", SERVER_ARGS, original)
    before = tree_hash(sg)
    code, out, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 0, err
    assert "dropped the record" in out
    assert tree_hash(sg) == before or layout == "git"  # git: the patch branch is deleted
    assert sa.read_bytes() == original
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"
    if layout == "git":
        assert "sm120patch/moe" not in git(sg, "branch", "--list")


def test_a_lock_applies_again_over_a_reinstall_and_proves_its_result(pair, tmp_path):
    layout, sg, fi = pair
    lock = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(sg), "-o", str(lock))[0] == 0
    sa = module_path(sg, layout, "sglang", SERVER_ARGS)
    original = sa.read_bytes()
    assert cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")[0] == 0
    locked_after = {line.split('"')[1] for line in lock.read_text().splitlines()
                    if line.startswith("after")}  # fmt: skip
    assert hashlib.sha256(sa.read_bytes()).hexdigest() in locked_after
    # The same lock again: a no-op that says so.
    code, out, _ = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 0 and "already exactly as" in out
    reinstall(sg, layout, "sglang", SERVER_ARGS, original)
    # An ensure over pristine files (a reinstall) patches them again, it does not exit 0.
    code, out, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert hashlib.sha256(sa.read_bytes()).hexdigest() in locked_after


def test_pin_on_a_patched_box_writes_the_lock_of_the_pristine_box(pair, tmp_path):
    layout, sg, fi = pair
    pristine_lock, patched_lock = tmp_path / "a.lock", tmp_path / "b.lock"
    assert cli("pin", "all", *where(sg, fi), "-o", str(pristine_lock))[0] == 0
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0
    code, _, err = cli("pin", "all", *where(sg, fi), "-o", str(patched_lock))
    assert code == 0, err
    # Planned from the pristine side (the pristine copies, or the commit the apply started
    # from): the same lock, byte for byte, the reviewed steps and their diffs included.
    assert "[[steps]]" in pristine_lock.read_text()
    assert patched_lock.read_text() == pristine_lock.read_text()
    assert cli("revert", "all", *where(sg, fi))[0] == 0
    assert cli("apply", "--locked", str(patched_lock), *where(sg, fi), "--no-gpu-check")[0] == 0


def test_apply_locked_whose_result_differs_rolls_back_naming_the_file(pair, tmp_path, monkeypatch):
    layout, sg, fi = pair
    lock = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(sg), "-o", str(lock))[0] == 0
    text = lock.read_text()
    after = next(line for line in text.splitlines() if line.startswith("after"))
    lock.write_text(text.replace(after, 'after = "' + "0" * 64 + '"'))
    before = tree_hash(sg)
    # The plan's own comparison refuses first ...
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 1 and "patched text would differ" in err
    # ... and were it not there, the written bytes are checked against the lock.
    from sm120patch.plan import lockfile

    monkeypatch.setattr(lockfile, "check", lambda lock, path: None)
    code, _, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 1, err
    assert "server_args.py does not have the lock's after-hash" in err
    assert tree_hash(sg) == before
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"


# ---- replaced: another release installed ---------------------------------------------------


def upgrade(site: Path, kind: str, version: str, module: str, original: bytes) -> None:
    """What `pip install -U --no-deps sglang==X` does to the files: new bytes, new dist-info."""
    for info in site.glob("*.dist-info"):
        if info.name.startswith(("sglang-", "flashinfer")) and kind in info.name:
            shutil.rmtree(info)
    dist = "sglang" if kind == "sglang" else "flashinfer_python"
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {kind}\nVersion: {version}\n")
    path = site / module
    path.write_text(original.decode().replace("import logging", "import logging  # 0.5.9"))


def test_upgrade_then_revert_force_never_writes_the_old_release(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    original = (sg / SERVER_ARGS).read_bytes()
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0
    upgrade(sg, "sglang", "0.5.9", SERVER_ARGS, original)
    new_bytes = (sg / SERVER_ARGS).read_bytes()
    found = status_of(*where(sg, fi))
    assert found["sglang"]["state"] == "replaced"
    assert found["sglang"]["message"] == (
        "SGLang was 0.5.8 when profile all was applied, 0.5.9 is installed now: the patches "
        "are gone"
    )
    assert found["flashinfer"]["state"] == "applied"
    code, out, err = cli("revert", "all", *where(sg, fi), "--force")
    assert code == 0, err
    assert "0.5.9 is installed now" in out and "dropped the record" in out
    assert (sg / SERVER_ARGS).read_bytes() == new_bytes  # 0.5.8's bytes never land
    assert status_of(*where(sg, fi))["sglang"]["state"] == "pristine"
    assert status_of(*where(sg, fi))["flashinfer"]["state"] == "pristine"


def test_a_replaced_release_is_planned_afresh(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    original = (sg / SERVER_ARGS).read_bytes()
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    upgrade(sg, "sglang", "0.5.9", SERVER_ARGS, original)
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert "0.5.9 is installed now" in out
    found = status_of("--sglang", str(sg))["sglang"]
    assert found["state"] == "applied" and found["applied_version"] == "0.5.9"
    assert "import logging  # 0.5.9" in (sg / SERVER_ARGS).read_text()


def test_a_deleted_file_is_missing_not_a_diff(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    (sg / SERVER_ARGS).unlink()
    found = status_of("--sglang", str(sg))["sglang"]
    assert found["state"] == "missing"
    assert [f["state"] for f in found["files"]] == ["missing"]
    code, _, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 1 and "deleted since the apply" in err and "@@" not in err


def test_record_hashes_tell_a_foreign_edit(tmp_path):
    import base64

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    data = (sg / SERVER_ARGS).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    (sg / "sglang-0.5.8.dist-info" / "RECORD").write_text(f"{SERVER_ARGS},sha256={digest},1\n")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    (sg / SERVER_ARGS).write_text(data.decode() + "# someone else\n")
    found = status_of("--sglang", str(sg))["sglang"]
    assert found["state"] == "drifted"
    assert found["files"][0]["as_installed"] is False
    code, out, _ = cli("status", "--sglang", str(sg))
    assert "matches neither what sm120patch wrote nor the installed RECORD" in out


# ---- git: git restores, never pristine bytes over a branch ----------------------------------


def test_a_commit_on_the_original_branch_is_kept_by_revert(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    git(sg, "checkout", "-q", "main")
    sa = sg / "python" / SERVER_ARGS
    sa.write_text(sa.read_text() + "# the user's own change\n")
    git(sg, "commit", "-qam", "user change")
    mine = git(sg, "rev-parse", "main").strip()
    git(sg, "checkout", "-q", "sm120patch/moe")
    code, _, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 0, err
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    assert git(sg, "rev-parse", "main").strip() == mine
    assert git(sg, "status", "--porcelain") == ""  # nothing written over the user's commit
    assert sa.read_text().endswith("# the user's own change\n")


def test_a_deleted_patch_branch_is_reported_and_revert_drops_the_record(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    git(sg, "checkout", "-q", "main")
    git(sg, "branch", "-D", "sm120patch/moe")
    found = status_of("--sglang", str(sg))["sglang"]
    assert found["state"] == "gone" and "was deleted" in found["message"]
    assert found["patch_branch_exists"] is False
    assert cli("recover", "--sglang", str(sg))[1].strip() == "nothing to recover"
    code, out, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 0 and "dropped the record" in out, err
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0


def test_keep_branch_then_apply_again(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert cli("revert", "moe", "--sglang", str(sg), "--keep-branch")[0] == 0
    assert "sm120patch/moe" in git(sg, "branch", "--list")
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/moe"


def test_a_branch_of_the_users_under_our_name_is_left_alone(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    git(sg, "checkout", "-q", "-b", "sm120patch/moe")
    (sg / "notes.txt").write_text("mine\n")
    git(sg, "add", "notes.txt")
    git(sg, "commit", "-qm", "the user's commit")
    theirs = git(sg, "rev-parse", "sm120patch/moe").strip()
    git(sg, "checkout", "-q", "main")
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/moe-2"
    assert git(sg, "rev-parse", "sm120patch/moe").strip() == theirs
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert git(sg, "rev-parse", "sm120patch/moe").strip() == theirs


def test_a_branch_checked_out_in_another_worktree(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert cli("revert", "moe", "--sglang", str(sg), "--keep-branch")[0] == 0
    other = tmp_path / "other-worktree"
    git(sg, "worktree", "add", "-q", str(other), "sm120patch/moe")
    # The kept branch is busy there: a fresh name here, and the worktree is left alone.
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/moe-2"
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert git(other, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/moe"


def test_the_users_branch_deleted_under_the_apply_is_refused_with_the_way_out(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    git(sg, "checkout", "-q", "-b", "work")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    git(sg, "branch", "-D", "work")
    before = tree_hash(sg)
    code, _, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 1 and "your branch work no longer exists" in err
    assert "git checkout -b work" in err
    assert tree_hash(sg) == before


# ---- the dry run is the apply minus the writes -----------------------------------------------


def _other_profile(sg, fi, layout):
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    return ["all", *where(sg, fi)]


def _dirty(sg, fi, layout):
    sa = module_path(sg, layout, "sglang", SERVER_ARGS)
    sa.write_text(sa.read_text() + "# uncommitted\n")
    return ["all", *where(sg, fi)]


def _unfinished(sg, fi, layout):
    st = store.TargetState.of(*_root_layout(sg, layout), "sglang")
    st.dir.mkdir(parents=True, exist_ok=True)
    (st.dir / "journal.json").write_text(json.dumps(
        {"schema": 1, "op": "apply", "files": [], "git": None, "peers": []}))  # fmt: skip
    return ["all", *where(sg, fi)]


def _outside_pins(sg, fi, layout):
    return ["moe", "--sglang", str(make_tree(sg.parent / "old", "sglang", "0.5.7", layout))]


def _drifted(sg, fi, layout):
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0
    sa = module_path(sg, layout, "sglang", SERVER_ARGS)
    sa.write_text(sa.read_text() + "# edited after the apply\n")
    return ["all", *where(sg, fi)]


def error_lines(err: str) -> list[str]:
    """The error and its next: line (the dry run shows known outcomes on stderr too, as its
    stdout is the diff)."""
    # A next: line that repeats the user's own command (`... --force`) has the dry run's
    # --dry-run in it after a dry run: the same step, as each command pastes it.
    return [line.replace(" --dry-run", "") if line.startswith("  next:") else line
            for line in err.splitlines() if line.startswith(("sm120patch:", "  next:"))]  # fmt: skip


def _root_layout(sg: Path, layout: str) -> tuple[Path, str]:
    t = finding.find("sglang", sg)
    return t.root, t.layout


@pytest.mark.parametrize(
    "make", [_other_profile, _dirty, _unfinished, _outside_pins, _drifted], ids=lambda f: f.__name__
)
def test_the_dry_run_refuses_exactly_as_the_apply_and_writes_nothing(make, pair, tmp_path):
    layout, sg, fi = pair
    if make is _dirty and layout == "installed":
        pytest.skip("an installed package has no uncommitted changes")
    args = make(sg, fi, layout)
    roots = [tmp_path]
    before = everything(*roots)
    dry = cli("apply", *args, "--dry-run", "--no-gpu-check")
    assert everything(*roots) == before  # no lock file, no state directory, nothing
    dry_json = cli("apply", *args, "--dry-run", "--no-gpu-check", "--json")
    assert everything(*roots) == before
    real = cli("apply", *args, "--no-gpu-check")
    assert dry[0] == real[0] == 1, (dry, real)
    assert error_lines(dry[2]) == error_lines(real[2])  # the same message and next: line
    assert error_lines(dry[2])
    doc = json.loads(dry_json[1])
    assert doc["exit_code"] == 1 and doc["error"] in dry[2] and doc["next"]


def test_the_dry_run_refuses_while_another_run_holds_the_lock(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    st = store.TargetState.of(sg, "installed", "sglang")
    with st.locked():
        dry = cli("apply", "moe", "--sglang", str(sg), "--dry-run", "--no-gpu-check")
        real = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert dry[0] == real[0] == 1 and error_lines(dry[2]) == error_lines(real[2])
    assert "holds the lock" in dry[2]


def test_the_dry_run_says_what_it_found_as_the_apply_does(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    original = (sg / SERVER_ARGS).read_bytes()
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    (sg / SERVER_ARGS).write_bytes(original)
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--dry-run", "--no-gpu-check")
    assert code == 0 and "the patches are gone" in err and "+" in out
    assert (sg / SERVER_ARGS).read_bytes() == original


def test_a_file_changed_between_plan_and_journal_is_refused(tmp_path, monkeypatch):
    from sm120patch.plan import planner

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    real_plan = planner.plan_admitted

    def plan_then_install(*args, **kwargs):
        result = real_plan(*args, **kwargs)
        path = sg / SERVER_ARGS
        path.write_text(path.read_text() + "# a pip install landed here\n")
        return result

    monkeypatch.setattr(planner, "plan_admitted", plan_then_install)
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 1 and "changed since it was planned" in err, err
    assert (sg / SERVER_ARGS).read_text().endswith("# a pip install landed here\n")
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"


# ---- ensure, in each state ---------------------------------------------------------------------


def test_ensure_in_each_state(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    ensure = ["ensure", "moe", "--sglang", str(sg), "--no-gpu-check"]
    original = (sg / SERVER_ARGS).read_bytes()
    code, out, err = cli(*ensure)  # pristine: applies
    assert code == 0 and "applied now" in out, err
    patched = (sg / SERVER_ARGS).read_bytes()
    code, out, _ = cli(*ensure)  # applied: nothing to do
    assert code == 0 and "already as wanted" in out
    (sg / SERVER_ARGS).write_bytes(original)  # gone: applies again
    assert cli(*ensure)[0] == 0 and (sg / SERVER_ARGS).read_bytes() == patched
    (sg / SERVER_ARGS).write_bytes(patched + b"# drift\n")  # drifted: refused, unchanged
    before = tree_hash(sg)
    code, _, err = cli(*ensure)
    assert code == 1 and "changed since profile moe was applied" in err
    assert tree_hash(sg) == before
    (sg / SERVER_ARGS).write_bytes(patched)
    code, _, err = cli("ensure", "all", "--sglang", str(sg), "--flashinfer",
                       str(make_tree(tmp_path, "flashinfer", "0.6.8", "installed")),
                       "--no-gpu-check")  # fmt: skip
    assert code == 1 and "profile moe is applied" in err  # another profile: refused
    for info in sg.glob("sglang-*.dist-info"):
        info.rename(sg / "sglang-0.5.7.dist-info")  # replaced, outside the pins: refused
    (sg / "sglang-0.5.7.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: "
                                                           "sglang\nVersion: 0.5.7\n")  # fmt: skip
    before = tree_hash(sg)
    code, _, err = cli(*ensure)
    assert code == 1 and "outside the pins" in err
    assert tree_hash(sg) == before


def test_ensure_no_apply_only_verifies(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    verify = ["ensure", "moe", "--sglang", str(sg), "--no-gpu-check", "--no-apply"]
    before = tree_hash(sg)
    code, _, err = cli(*verify)
    assert code == 1 and "pristine" in err
    assert tree_hash(sg) == before and not (sg / ".sm120patch").exists()
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert cli(*verify)[0] == 0


def test_the_apply_report_carries_its_diff(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    dry = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check", "--dry-run", "--json")
    real = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check", "--json")
    assert json.loads(real[1])["diff"] == json.loads(dry[1])["diff"] != ""


def test_ensure_refuses_an_unfinished_run(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    proc = subprocess.run(
        command("apply", "moe", "--sglang", str(sg), "--no-gpu-check"),
        env={**os.environ, "SM120PATCH_KILL_AT": "after-write"},
        capture_output=True,
    )
    assert proc.returncode == -9
    code, _, err = cli("ensure", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 1 and "recover" in err


# ---- smaller truths ------------------------------------------------------------------------------


def test_revert_all_with_nothing_applied_names_each_target_once(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    code, out, err = cli("revert", "--all", *where(sg, fi))
    assert code == 0, err
    assert out.count(str(sg)) == 1 and out.count(str(fi)) == 1


def test_export_refuses_a_non_empty_directory_unless_overwrite(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    out_dir = tmp_path / "series"
    assert cli("export", "all", *where(sg, fi), "-o", str(out_dir))[0] == 0
    code, _, err = cli("export", "moe", *where(sg, fi), "-o", str(out_dir))
    assert code == 1 and "not empty" in err
    code, _, err = cli("export", "moe", *where(sg, fi), "-o", str(out_dir), "--overwrite")
    assert code == 0, err
    assert [p.name for p in sorted(out_dir.rglob("*.patch"))] == [
        "0001-sglang-moe-backend.patch", "0002-sglang-moe-backend-qwen3.patch"]
    # A checkout's export names checkout paths: `git am` takes it on another checkout as is.
    other = make_tree(tmp_path / "b", "sglang", "0.5.8", "git")
    proc = subprocess.run(["git", "-C", str(other), "am", "-q",
                           *map(str, sorted(out_dir.rglob("*.patch")))],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_json_errors_are_json_on_stdout(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    code, out, err = cli("apply", "all", *where(sg, fi), "--no-gpu-check", "--json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == 1
    assert doc["error"].startswith("profile moe is applied")
    # The next: line names commands that work: revert moe, then apply all.
    assert "sm120patch revert moe" in doc["next"] and "sm120patch apply all" in doc["next"]
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0


def test_a_closed_stdout_is_one_line(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sm120patch", "apply", "moe", "--sglang", str(sg), "--dry-run",
         "--no-gpu-check"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # `| head -0`: the reader is gone before the diff is written
    _, err = proc.communicate()
    # As git: the reader left on purpose; the command ends quietly and successfully.
    assert proc.returncode == 0, err
    text = err.decode()
    assert "standard output was closed" not in text and "Traceback" not in text, text


def test_state_of_0_1_0_is_read_and_migrated(tmp_path, monkeypatch):
    """0.1.0 kept an installed target's state in the user's state directory."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SM120PATCH_STATE_DIR", "relative-state")  # resolved once, absolutely
    legacy = store.legacy_state_dir_for(sg, "sglang")
    assert legacy is not None and legacy.is_absolute()
    legacy.parent.mkdir(parents=True)
    shutil.move(str(sg / ".sm120patch" / "sglang"), str(legacy))
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "applied"
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert not legacy.exists()
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"


def test_an_unwritable_trial_log_is_one_line_and_patches_nothing(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    before = tree_hash(sg)
    code, _, err = cli("trial", "moe", "--sglang", str(sg), "--no-gpu-check",
                       "--log", str(tmp_path / "no-such-dir" / "trial.log"), "--", "true")  # fmt: skip
    assert code == 2 and "--log" in err and "cannot write there" in err, err
    assert "internal error" not in err
    assert tree_hash(sg) == before
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"


def test_an_unwritable_directory_during_recover_is_one_line(tmp_path, monkeypatch):
    import errno

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    proc = subprocess.run(
        command("apply", "moe", "--sglang", str(sg), "--no-gpu-check"),
        env={**os.environ, "SM120PATCH_KILL_AT": "after-write"},
        capture_output=True,
    )
    assert proc.returncode == -9
    def refused(path, data):
        if path.name == "server_args.py":  # the restore of the pristine bytes
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    with pytest.MonkeyPatch.context() as mp:
        fail_writes(mp, refused)
        code, _, err = cli("recover", "--sglang", str(sg))
    assert code in (1, 75) and "internal error" not in err and "Traceback" not in err, err
    assert "Permission denied" in err and "recover" in err
    assert cli("recover", "--sglang", str(sg))[0] == 0
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "pristine"
