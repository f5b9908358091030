"""The engine's contract on fixture trees: apply, status, revert, recover, on git and installed
layouts; every failure leaves both trees byte-identical (hashed before and after)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from killing import command, fail_writes
from trees import FLASHINFER_FILES, git, make_tree, tree_hash

from sm120patch.cli import main

LAYOUTS = ["git", "installed"]


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(params=LAYOUTS)
def trees(request, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", request.param)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", request.param)
    return request.param, sg, fi


def targets(sg: Path, fi: Path) -> list[str]:
    return ["--sglang", str(sg), "--flashinfer", str(fi)]


def hashes(*roots: Path) -> list[str]:
    return [tree_hash(r) for r in roots]


def test_apply_status_revert_roundtrip(trees):
    layout, sg, fi = trees
    before = hashes(sg, fi)
    code, out, err = cli("apply", "all", *targets(sg, fi), "--no-gpu-check")
    assert code == 0, err
    assert hashes(sg, fi) != before

    code, out, _ = cli("status", *targets(sg, fi), "--json")
    assert code == 0
    doc = json.loads(out)
    states = {f["state"] for t in doc["targets"] for f in t["files"]}
    assert states == {"patched"}
    assert {t["profile"] for t in doc["targets"]} == {"all"}

    if layout == "git":
        assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/all"
        log = git(sg, "log", "--format=%B%x00", "main..sm120patch/all").split("\0")
        messages = [m for m in log if m.strip()]
        # sm120-flag, fusion-gate, fusion-autoenable, moe-backend, moe-backend-qwen3
        assert len(messages) == 5
        for message in messages:
            assert "Sm120patch-Profile: all" in message
            assert "Sm120patch-Version: " in message
        patch_ids = {
            line.split(": ")[1]
            for m in messages
            for line in m.splitlines()
            if line.startswith("Sm120patch-Patch:")
        }
        assert patch_ids == {
            "sglang.sm120-flag",
            "sglang.fusion-gate",
            "sglang.fusion-autoenable",
            "sglang.moe-backend",
            "sglang.moe-backend-qwen3",
        }

    code, out, err = cli("revert", "--all", *targets(sg, fi))
    assert code == 0, err
    assert hashes(sg, fi) == before
    if layout == "git":
        assert "sm120patch/all" not in git(sg, "branch", "--list")


def test_apply_and_revert_json_name_each_file_written(tmp_path):
    """What `--json` says of each file is a path and a state, nothing more: scripts read it."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    sglang = ["sglang/srt/layers/communicator.py", "sglang/srt/server_args.py"]
    for verb, state in (("apply", "patched"), ("revert", "pristine")):
        args = ["all", "--no-gpu-check"] if verb == "apply" else ["--all"]
        code, out, err = cli(verb, *args, *targets(sg, fi), "--json")
        assert code == 0, err
        found = {t["kind"]: t["files"] for t in json.loads(out)["targets"]}
        assert found == {
            "sglang": [{"path": p, "state": state} for p in sglang],
            "flashinfer": [{"path": "flashinfer/jit/comm.py", "state": state}],
        }, verb


def test_second_apply_is_a_noop(trees):
    _, sg, fi = trees
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    after = hashes(sg, fi)
    code, out, _ = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0
    assert "already applied" in out
    assert hashes(sg, fi) == after


def test_dirty_touched_file_refuses_and_changes_nothing(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    (sg / "python/sglang/srt/server_args.py").write_text("# my edit\n", encoding="utf-8")
    (sg / "notes.txt").write_text("untracked, unrelated\n")
    before = tree_hash(sg)
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 1
    assert "uncommitted changes" in err and "server_args.py" in err
    assert tree_hash(sg) == before


def test_other_dirty_files_stay_as_they_are(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    other = sg / "python/sglang/srt/layers/communicator.py"
    other.write_text(other.read_text() + "# mine\n")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert other.read_text().endswith("# mine\n")
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert other.read_text().endswith("# mine\n")
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"


def test_drift_refuses_revert_then_force_discards(trees):
    _, sg, fi = trees
    before = hashes(sg)
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    server_args = next(p for p in sg.rglob("server_args.py") if not {".git", ".sm120patch"} & set(p.parts))
    server_args.write_text(server_args.read_text() + "# user edit after apply\n")
    drifted = hashes(sg)
    code, _, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 1
    assert "+# user edit after apply" in err
    assert hashes(sg) == drifted
    code, out, _ = cli("status", "--sglang", str(sg), "--json")
    assert [f["state"] for f in json.loads(out)["targets"][0]["files"]] == ["drifted"]
    code, _, err = cli("revert", "moe", "--sglang", str(sg), "--force")
    assert code == 0, err
    assert hashes(sg) == before


def test_keep_branch(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert cli("revert", "moe", "--sglang", str(sg), "--keep-branch")[0] == 0
    assert "sm120patch/moe" in git(sg, "branch", "--list")
    assert git(sg, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"


def test_failure_in_second_target_rolls_back_the_first(trees, mocker):
    _, sg, fi = trees
    before = hashes(sg, fi)
    def failing(path, data):
        if path.name == "comm.py":
            raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        fail_writes(mp, failing)
        code, _, err = cli("apply", "all", *targets(sg, fi), "--no-gpu-check")
    assert code != 0
    assert "Traceback" not in err
    assert hashes(sg, fi) == before
    code, out, _ = cli("status", *targets(sg, fi), "--json")
    assert [(t["profile"], t["unfinished"]) for t in json.loads(out)["targets"]] == [
        (None, None)
    ] * 2


@pytest.mark.parametrize(
    "step",
    [
        "after-journal",
        "after-objects",
        "after-branch",
        "after-write",
        "before-manifest",
        "after-manifest",
    ],
)
def test_kill_during_apply_then_recover(trees, step):
    layout, sg, fi = trees
    if step in ("after-objects", "after-branch") and layout != "git":
        pytest.skip("no commit or branch on an installed target")
    before = hashes(sg, fi)
    env = {**os.environ, "SM120PATCH_KILL_AT": step}
    proc = subprocess.run(
        command("apply", "all", *targets(sg, fi), "--no-gpu-check"),
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -9, proc.stderr
    code, _, err = cli("apply", "all", *targets(sg, fi), "--no-gpu-check")
    assert code == 1 and "recover" in err
    code, out, err = cli("recover", *targets(sg, fi))
    assert code == 0, err
    assert hashes(sg, fi) == before
    # The tool works on from there.
    assert cli("apply", "all", *targets(sg, fi), "--no-gpu-check")[0] == 0
    assert cli("revert", "--all", *targets(sg, fi))[0] == 0
    assert hashes(sg, fi) == before


def test_lock_held_refuses(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    from sm120patch.engine import store
    from sm120patch.targets import finding

    t = finding.find("sglang", sg)
    st = store.TargetState(store.state_dir_for(t.root, t.layout, t.kind), t.root)
    before = tree_hash(sg)
    with st.locked():
        code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 1
    assert "another sm120patch run holds the lock on" in err
    assert tree_hash(sg) == before


def test_newer_manifest_schema_is_refused(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    state_dir = sg / ".git" / "sm120patch" / "sglang"
    state_dir.mkdir(parents=True)
    (state_dir / "manifest.json").write_text(json.dumps({"schema": 99, "profile": "moe"}))
    code, _, err = cli("status", "--sglang", str(sg))
    assert code == 1
    assert "schema 99" in err and "Traceback" not in err


def test_corrupt_manifest_is_one_line(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    state_dir = sg / ".git" / "sm120patch" / "sglang"
    state_dir.mkdir(parents=True)
    (state_dir / "manifest.json").write_text('{"schema": 1, "prof')
    code, _, err = cli("revert", "--all", "--sglang", str(sg))
    assert code == 1
    assert "corrupt" in err and "Traceback" not in err


def test_dry_run_diff_applies_with_git_apply(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    before = hashes(sg, fi)
    code, out, err = cli("apply", "all", *targets(sg, fi), "--dry-run")
    assert code == 0, err
    assert hashes(sg, fi) == before
    chunks = ["diff --git" + c for c in out.split("diff --git")[1:]]
    assert chunks
    for root in (sg, fi):
        mine = [c for c in chunks if (root / c.split()[2][2:]).exists()]
        assert mine
        proc = subprocess.run(
            ["git", "-C", str(root), "apply", "--check", "-"],
            input="".join(mine),
            text=True,
            capture_output=True,
        )
        assert proc.returncode == 0, proc.stderr


def test_commits_use_the_users_identity_or_a_clear_fallback(tmp_path, monkeypatch):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert git(sg, "log", "-1", "--format=%an <%ae>").strip() == "Test User <test@example.com>"
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0

    # No identity anywhere: commits still happen, as sm120patch, and nothing prompts.
    git(sg, "config", "--unset", "user.name")
    git(sg, "config", "--unset", "user.email")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL",
                "EMAIL"):
        monkeypatch.delenv(var, raising=False)
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert git(sg, "log", "-1", "--format=%an <%ae>").strip() == "sm120patch <sm120patch@localhost>"


def test_both_targets_in_one_repository_refuses_up_front(tmp_path):
    root = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi_parent = root / "third_party"
    for rel, text in FLASHINFER_FILES.items():
        path = fi_parent / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (fi_parent / "flashinfer" / "version.py").write_text('__version__ = "0.6.1"\n')
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "vendored flashinfer")
    before = tree_hash(root)
    code, _, err = cli("apply", "fusion", "--sglang", str(root), "--flashinfer", str(fi_parent),
                       "--no-gpu-check")
    assert code == 1
    assert "in the same git repository" in err
    assert tree_hash(root) == before
