"""State-file safety: state is private (0700 directories, 0600 files), every
path read from it stays inside its target, nothing is written through a link leaving the
target or the state directory, and a damaged state file is one line saying what to do."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from killing import KILL_ENV, cli, run
from trees import make_tree, tree_hash

from sm120patch.engine import store
from sm120patch.errors import Refused
from sm120patch.targets import files, finding


def state_dir_of(root: Path) -> Path:
    t = finding.find("sglang", root)
    return store.state_dir_for(t.root, t.layout, t.kind)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def anchor_of(sg: Path, layout: str) -> Path:
    """The directory whose permissions the target's state takes: .git, or the site-packages."""
    return sg / ".git" if layout == "git" else sg


@pytest.mark.parametrize("layout", ["git", "installed"])
@pytest.mark.parametrize("anchor_mode, dirs_mode, files_mode", [
    (0o700, 0o700, 0o600),  # a private venv: private state
    (0o775, 0o755, 0o644),  # a group-shared install: the group reads the state, never writes it
    (0o777, 0o755, 0o644),  # writable by its owner only, whatever the target
])  # fmt: skip
def test_state_is_as_open_as_the_target_never_more(
    layout, anchor_mode, dirs_mode, files_mode, tmp_path
):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    anchor_of(sg, layout).chmod(anchor_mode)
    # Killed after its journal: manifest-less state with a journal (and pristine copies).
    assert run("apply", "moe", "--sglang", str(sg), "--no-gpu-check",
               env={KILL_ENV: "after-journal"}).returncode == -9  # fmt: skip
    d = state_dir_of(sg)
    assert (d / "journal.json").exists()
    assert (d / "pristine").is_dir() == (layout == "installed")  # git restores by itself
    assert cli("recover", "--sglang", str(sg))[0] == 0
    old = os.umask(0)  # a lax umask must not loosen anything either
    try:
        assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    finally:
        os.umask(old)
    assert (d / "manifest.json").exists()
    dirs = [d, d.parent, *[p for p in d.rglob("*") if p.is_dir()]]
    files = [p for p in d.rglob("*") if p.is_file() and p.name != "lock"]
    assert {p.name: mode(p) for p in dirs} == {p.name: dirs_mode for p in dirs}
    assert {p.name: mode(p) for p in files} == {p.name: files_mode for p in files}
    assert mode(d / "lock") == 0o600  # only its owner can hold it


def test_a_lax_state_directory_is_refused_with_the_fix(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    (sg / ".git").chmod(0o755)
    d = sg / ".git" / "sm120patch" / "sglang"
    d.mkdir(mode=0o777, parents=True)
    d.chmod(0o777)
    assert cli("status", "--sglang", str(sg))[0] == 0  # reading changes nothing
    assert mode(d) == 0o777
    before = tree_hash(sg)
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    # Anyone could have written what is in it: not tightened silently, refused with the fix.
    assert code == 1 and "writable by its group or by others" in err, err
    assert f"next: chown -R root {d.parent} && chmod -R go-w {d.parent}\n" in err, err
    assert err.count("\n") == 3, err  # the message, the command, the words
    assert tree_hash(sg) == before and mode(d) == 0o777
    d.chmod(0o755)
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0


def test_copies_are_never_written_through_a_link_leaving_the_state(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = sg / ".git" / "sm120patch" / "sglang"
    d.mkdir(parents=True)
    (d / "patched").symlink_to(elsewhere)  # the copies a checkout's apply keeps
    before = tree_hash(sg)
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 1 and "outside" in err and "Traceback" not in err, err
    assert list(elsewhere.iterdir()) == []
    assert tree_hash(sg) == before
    assert not (d / "journal.json").exists()


@pytest.mark.parametrize(
    "rel",
    ["/etc/passwd", "../outside.py", "python/../../outside.py", "", "a\\..\\b", "x\0y"],
)
def test_paths_from_state_stay_inside(rel, tmp_path):
    with pytest.raises(Refused, match="outside its target|not a plain relative path"):
        files.inside(tmp_path, rel)


def test_a_link_inside_the_target_leading_out_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    with pytest.raises(Refused, match="outside the target"):
        files.inside(tmp_path / "root", "out/secret.py")
    assert files.inside(tmp_path / "root", "pkg/mod.py") == tmp_path / "root" / "pkg" / "mod.py"


def interrupted(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A checkout with an apply killed after its first write: its journal and the journal."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    proc = run("apply", "moe", "--sglang", str(sg), "--no-gpu-check", env={KILL_ENV: "after-write"})
    assert proc.returncode == -9
    path = sg / ".git" / "sm120patch" / "sglang" / "journal.json"
    return sg, path, json.loads(path.read_text())


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda j: j["files"][0].update(path="../../escape.py"), "outside its target"),
        (lambda j: j["files"][0].update(path="/tmp/escape.py"), "outside its target"),
        (lambda j: j["files"][0].update(before="0" * 10), "before is not a sha256"),
        (lambda j: j["files"][0].update(mode="rwx"), "mode is not a permission mode"),
        (lambda j: j["git"].update(patch_branch="main"), "is not an sm120patch/<profile>"),
        (lambda j: j["git"].update(branch="-D"), "is not a branch name"),
        (lambda j: j["git"].update(head="HEAD~3"), "git.head is not a commit id"),
        (lambda j: j.update(peers=[{"kind": "sglang", "root": "rel", "layout": "git"}]), "peer"),
        (lambda j: j.pop("files"), "files is not a list"),
    ],
)
def test_a_damaged_journal_is_refused_before_anything_is_touched(damage, needle, tmp_path):
    sg, path, journal = interrupted(tmp_path)
    damage(journal)
    path.write_text(json.dumps(journal))
    before = tree_hash(sg)
    for args in (["recover"], ["status"], ["apply", "moe", "--no-gpu-check"]):
        code, _, err = cli(*args, "--sglang", str(sg))
        assert code == 1, err
        assert needle in err and "Traceback" not in err, err
        assert err.startswith("sm120patch: ") and err.count("\n") <= 4, err
    assert tree_hash(sg) == before
    assert path.read_text() == json.dumps(journal)


@pytest.mark.parametrize("cut", [0, 1, 10, -2])
def test_a_truncated_state_file_says_what_to_do(cut, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    d = sg / ".git" / "sm120patch" / "sglang"
    (d / "trials.json").write_text(json.dumps({"schema": 1, "trials": []}))
    for name in ("manifest.json", "trials.json"):
        path = d / name
        whole = path.read_bytes()
        path.write_bytes(whole[:cut])
        code, _, err = cli("status", "--sglang", str(sg))
        assert code == 1 and f"{name} is corrupt" in err and "Traceback" not in err, err
        assert f"move it aside ({path})" in err
        path.write_bytes(whole)
    assert cli("status", "--sglang", str(sg))[0] == 0


def test_two_state_directories_one_lock_one_state(tmp_path, monkeypatch):
    """Another user (or root with another SM120PATCH_STATE_DIR / HOME) sees the same state."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    monkeypatch.setenv("SM120PATCH_STATE_DIR", str(tmp_path / "root-state"))
    monkeypatch.setenv("HOME", str(tmp_path / "root-home"))
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    monkeypatch.setenv("SM120PATCH_STATE_DIR", str(tmp_path / "other-state"))
    monkeypatch.setenv("HOME", str(tmp_path / "other-home"))
    code, out, _ = cli("status", "--sglang", str(sg), "--json")
    assert json.loads(out)["targets"][0]["state"] == "applied"
    code, _, err = cli("apply", "all", "--sglang", str(sg), "--flashinfer",
                       str(make_tree(tmp_path, "flashinfer", "0.6.8", "installed")),
                       "--no-gpu-check")  # fmt: skip
    assert code == 1 and "profile moe is applied" in err
    # The lock is the target's, whatever the state directory: a second run is refused.
    with store.TargetState.of(sg, "installed", "sglang").locked():
        monkeypatch.setenv("SM120PATCH_STATE_DIR", str(tmp_path / "third-state"))
        code, _, err = cli("revert", "moe", "--sglang", str(sg))
        assert code == 1 and "another sm120patch run holds the lock" in err
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0


def test_a_manifest_reads_and_writes_back_as_it_was(tmp_path):
    """The target an apply found is a record now; the manifest it is written in is the same
    JSON as before, key for key."""
    from sm120patch.engine.records import Manifest, TargetRecord

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    doc = json.loads((state_dir_of(sg) / store.MANIFEST).read_text())
    manifest = Manifest.from_doc(doc)
    assert isinstance(manifest.target, TargetRecord) and manifest.target.kind == "sglang"
    assert {**manifest.to_doc(), "schema": store.SCHEMA} == doc  # the store adds the schema
    t = finding.find("sglang", sg)
    assert doc["target"] == t.to_dict() == TargetRecord.of(t).to_doc()


@pytest.mark.parametrize("target", [
    {"kind": "sglang", "layout": "installed", "version": "0.5.8"},  # before root and package
    {"kind": "sglang", "version": "0.5.8", "from_a_later_sm120patch": "x"},
])  # fmt: skip
def test_an_old_manifests_target_still_reads(target, tmp_path):
    """A state an older sm120patch wrote, with some of the target's keys: status reads it and
    revert undoes the apply."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    before = tree_hash(sg)
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    path = state_dir_of(sg) / store.MANIFEST
    doc = json.loads(path.read_text())
    doc["target"] = target
    path.write_text(json.dumps(doc))
    code, out, err = cli("status", "--sglang", str(sg), "--json")
    assert code == 0, err
    # only the SGLang named: a FlashInfer installed beside the tool (the README's quick start
    # installs one) is reported too, and is not this test's
    (found,) = [t for t in json.loads(out)["targets"] if t["kind"] == "sglang"]
    assert found["state"] == "applied"
    assert found["applied_version"] == "0.5.8"
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert tree_hash(sg) == before


def test_a_manifest_without_its_target_reads_as_of_an_unknown_release():
    from sm120patch.engine.records import Manifest, TargetRecord

    doc = {"profile": "moe", "patches": [], "files": []}
    manifest = Manifest.from_doc(doc)
    assert manifest.target == TargetRecord() and manifest.version == "unknown"
    assert manifest.to_doc()["target"] == {}
