"""What an operator meets on the way from a dry run to a verified server: states that tell a
patch branch carrying commits of the user's apart from a plain apply, `export` on the
reference box (which is patched already), per-state hints of `ensure --no-apply`, and lock
mismatches that name the real difference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_states import SERVER_ARGS, cli, status_of, tree_hash  # noqa: F401
from trees import git, make_tree

from sm120patch.engine import pristine
from sm120patch.plan import mails


def test_commits_on_the_patch_branch_are_drifted_not_applied(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "applied"
    (sg / "notes.txt").write_text("an operator's note\n")
    git(sg, "add", "notes.txt")
    git(sg, "commit", "-qm", "a note on the patch branch")
    found = status_of("--sglang", str(sg))["sglang"]
    assert found["state"] == "drifted", found
    assert "has commits after sm120patch's" in found["message"]
    assert all(f["state"] == "patched" for f in found["files"])  # the files are still ours
    # ensure --no-apply and revert now agree: neither passes it as "applied".
    code, _, err = cli("ensure", "moe", "--sglang", str(sg), "--no-gpu-check", "--no-apply")
    assert code == 1 and "drifted" in err, err
    code, _, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 1 and "has commits after sm120patch's" in err, err


def _series(directory: Path) -> dict[str, str]:
    """Every exported patch, its Date line aside (the export's time)."""
    return {
        p.relative_to(directory).as_posix(): "".join(
            line for line in p.read_text().splitlines(True) if not line.startswith("Date: ")
        )
        for p in sorted(directory.rglob("*.patch"))
    }


@pytest.mark.parametrize("layout", ["git", "installed"])
def test_export_on_an_applied_tree_is_the_series_of_the_pristine_one(layout, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", layout)
    paths = {"sglang": sg, "flashinfer": fi}
    mails.write_mails(pristine.plan_from_pristine("all", paths), tmp_path / "before")
    assert (
        cli("apply", "all", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check")[0] == 0
    )
    applied = tree_hash(sg), tree_hash(fi)
    mails.write_mails(pristine.plan_from_pristine("all", paths), tmp_path / "after")
    assert _series(tmp_path / "after") == _series(tmp_path / "before") != {}
    assert (tree_hash(sg), tree_hash(fi)) == applied  # read only


def test_export_refuses_a_tree_edited_since_the_apply(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    (sg / SERVER_ARGS).write_text((sg / SERVER_ARGS).read_text() + "# edit\n")
    from sm120patch.errors import Refused

    with pytest.raises(Refused, match="is drifted"):
        pristine.plan_from_pristine("moe", {"sglang": sg})


def _verify(sg: Path, *extra: str) -> tuple[int, str, str]:
    return cli("ensure", "moe", "--sglang", str(sg), "--no-gpu-check", "--no-apply", *extra)


def _hint(err: str) -> str:
    """What a refusal says to do: its `next:` commands and its words, after the message."""
    lines = err.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("sm120patch: "))
    return "\n".join(line for line in lines[at + 1 :] if line.startswith("  "))


def test_ensure_no_apply_says_what_to_do_in_each_state(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    hints = {}
    hints["pristine"] = _hint(_verify(sg)[2])
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    patched = (sg / SERVER_ARGS).read_bytes()
    (sg / SERVER_ARGS).write_bytes(patched + b"# drift\n")
    hints["drifted"] = _hint(_verify(sg)[2])
    (sg / SERVER_ARGS).unlink()
    hints["missing"] = _hint(_verify(sg)[2])
    (sg / SERVER_ARGS).write_bytes(patched)
    state = sg / ".sm120patch" / "sglang"
    (state / "journal.json").write_text(
        json.dumps({"schema": 1, "op": "apply", "files": [], "git": None, "peers": []})
    )
    hints["unfinished"] = _hint(_verify(sg)[2])
    assert "sm120patch apply moe" in hints["pristine"]
    assert "revert moe --force" in hints["drifted"] and "status" in hints["drifted"]
    assert "revert moe --force" in hints["missing"] and "restores" in hints["missing"]
    assert "sm120patch recover" in hints["unfinished"]
    assert len(set(hints.values())) == len(hints), hints  # one hint per state


def test_ensure_no_apply_names_the_other_profile_and_the_lock(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    lock = tmp_path / "all.lock"
    assert cli("pin", "all", "--sglang", str(sg), "--flashinfer", str(fi), "-o", str(lock))[0] == 0
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    code, _, err = cli("ensure", "--locked", str(lock), "--sglang", str(sg), "--flashinfer",
                       str(fi), "--no-gpu-check", "--no-apply")  # fmt: skip
    assert code == 1
    hint = _hint(err)
    assert "revert moe" in hint and f"apply --locked {lock}" in hint, hint


def test_a_lock_for_another_profile_names_the_real_difference(tmp_path):
    """A lock of `all` read as one of `moe` (a profile changed since the lock was made): each
    difference is named as what it is, not 'found None' or 'this sm120patch has none'."""
    from dataclasses import replace

    from sm120patch.plan import lockfile, planner

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")  # moe wants 0.6.7 or later
    path = tmp_path / "all.lock"
    assert cli("pin", "all", "--sglang", str(sg), "--flashinfer", str(fi), "-o", str(path))[0] == 0
    lock = replace(lockfile.read(path), profile="moe")
    plan = planner.plan("moe", {"sglang": sg, "flashinfer": fi})
    problems = lockfile.differences(lock, plan)
    text = "; ".join(problems)
    assert "found None" not in text and "has none" not in text, text
    assert "the lock pins flashinfer 0.6.8, but profile moe here patches no flashinfer" in text
    assert "patch sglang.fusion-gate: in the lock, not in profile moe here" in text


def test_already_applied_by_the_lock_reads_whole(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    lock = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(sg), "-o", str(lock))[0] == 0
    assert cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")[0] == 0
    code, out, err = cli("apply", "--locked", str(lock), "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert "the bytes sm120patch wrote, the bytes the lock records" in out + err
