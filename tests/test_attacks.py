"""Attacks on what sm120patch reads: its state, lock files, packs, git, output paths. Each is
planted as another user on the box would plant it (a user made for the test, whose own process
writes what it plants; a group-writable environment; a crafted journal, manifest, lock, pack,
hook or symlink), and each test checks the bytes and modes
on disk after the command: every byte written into a target is what the loaded patches make
from the file's current bytes, or the release's own bytes.

Where the tests cannot make another user (not root), the attacker's tests skip and say why.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from attackers import Attacker, add_record, attacker_fixture, journal, sha, shared_fixture, upgrade  # noqa: F401 (fixtures)
from killing import KILL_ENV, TRACE_ENV, cli, command, fail_writes
from trees import git, make_tree, tree_hash

from sm120patch.engine import store
from sm120patch.plan import catalog, lockfile
from sm120patch.plan.diffs import apply_diff, diff_texts
from sm120patch.targets import files

SERVER_ARGS = "sglang/srt/server_args.py"
ID = Path("/usr/bin/id")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def one_line(err: str) -> bool:
    """A refusal: `sm120patch: ...` and what to do (`  next: ...` commands, words), nothing
    else (no traceback)."""
    lines = err.strip("\n").split("\n")
    return (lines[0].startswith("sm120patch: ") and len(lines) >= 2
            and all(x.startswith("  ") for x in lines[1:]) and "internal error" not in err)


def sm(*args: str, env: dict[str, str | None] | None = None, cwd: str | None = None):
    """sm120patch as a process of its own; `env` values of None are removed."""
    full = {**os.environ}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run(command(*args), env=full, capture_output=True, text=True, cwd=cwd)


def group_site(base: Path, who: Attacker) -> Path:
    """An installed SGLang 0.5.8 (with its RECORD) in a site-packages that root owns and the
    attacker's group may write: a shared environment."""
    site = make_tree(base, "sglang", "0.5.8", "installed")
    add_record(site, "sglang", "0.5.8")
    for d in [site, *[p for p in site.rglob("*") if p.is_dir()]]:
        os.chown(d, 0, who.group_gid)
        d.chmod(0o2775)
    return site


# ---- state: evidence, never instruction --------------------------------------------------
def test_a_forged_journal_in_a_state_directory_the_attacker_made_is_refused(attacker, shared):
    """The attacker makes `.sm120patch/` in a group-writable site-packages, with a journal that
    restores a copy of /usr/bin/id as a setuid file: root's recover, apply and revert refuse."""
    site = group_site(shared, attacker)
    evil = ID.read_bytes()
    state = site / ".sm120patch" / "sglang"
    attacker.write(state / "pristine" / "sglang" / "evil_id", evil, 0o755)
    attacker.write(state / "journal.json", journal([{
        "path": "sglang/evil_id", "module": "sglang/evil_id", "before": sha(evil),
        "after": sha(b"x"), "mode": 0o4755}]))  # fmt: skip
    before = tree_hash(site)
    for args in (["recover"], ["apply", "moe", "--no-gpu-check"], ["revert", "moe"]):
        code, _, err = cli(*args, "--sglang", str(site))
        assert code == 1 and f"is owned by {attacker.name}" in err and one_line(err), err
        assert "chown -R root" in err  # the fix, in the refusal
    assert not (site / "sglang" / "evil_id").exists()
    assert tree_hash(site) == before


def test_the_state_of_a_group_writable_install_is_its_owners_alone(attacker, shared):
    """Root applies on a group-writable install: the group can no longer write the state (its
    bits were copied from the site-packages before), and a state directory the attacker swaps
    in (the site-packages is theirs to rename in) with a replaced pristine copy and the
    manifest's before-hash set to match is refused: nothing is restored from it."""
    site = group_site(shared, attacker)
    assert cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")[0] == 0
    state = site / ".sm120patch" / "sglang"
    assert (mode(state.parent), mode(state)) == (0o755, 0o755)
    assert mode(state / "manifest.json") == 0o644 and mode(state / "lock") == 0o600
    copy = state / "pristine" / SERVER_ARGS
    for path in (state, copy.parent, copy, state / "manifest.json", state / "lock"):
        assert not attacker.can_write(path), path
    evil = b"import os\nos.system('id')\n"
    attacker.ok("import os, sys\nos.rename(sys.argv[1], sys.argv[2])",
                str(site / ".sm120patch"), str(site / ".moved"))  # fmt: skip
    manifest = json.loads((site / ".moved" / "sglang" / "manifest.json").read_text())
    manifest["files"][0]["before"] = sha(evil)
    attacker.write(site / ".sm120patch" / "sglang" / "manifest.json", json.dumps(manifest))
    attacker.write(site / ".sm120patch" / "sglang" / "pristine" / SERVER_ARGS, evil)
    patched = (site / SERVER_ARGS).read_bytes()
    code, _, err = cli("revert", "moe", "--sglang", str(site))
    assert code == 1 and f"owned by {attacker.name}" in err and one_line(err), err
    assert (site / SERVER_ARGS).read_bytes() == patched and mode(site / SERVER_ARGS) == 0o644


def killed_apply(site: Path, profile: str = "moe", step: str = "after-write", *more: str) -> Path:
    proc = sm("apply", profile, "--sglang", str(site), *more, "--no-gpu-check",
              env={KILL_ENV: step})  # fmt: skip
    assert proc.returncode == -9, proc.stderr
    return site / ".sm120patch" / "sglang" / "journal.json"


def test_state_names_only_the_files_of_its_profiles_patches(tmp_path):
    """Even in a state directory root trusts (its own), a journal naming a file no patch of
    its profile touches moves no byte: no setuid copy of /usr/bin/id appears."""
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    path = killed_apply(site)
    doc = json.loads(path.read_text())
    evil = ID.read_bytes()
    doc["files"].append({"path": "sglang/evil_id", "module": "sglang/evil_id",
                         "before": sha(evil), "after": sha(b"x"), "mode": 0o4755})  # fmt: skip
    path.write_text(json.dumps(doc))
    files.atomic_write(path.parent / "pristine" / "sglang" / "evil_id", evil, 0o755)
    code, _, err = cli("recover", "--sglang", str(site))
    assert code == 1 and "sglang/evil_id, which no patch of profile moe touches" in err, err
    assert one_line(err)
    assert not (site / "sglang" / "evil_id").exists()


def test_a_restore_never_sets_a_mode_nor_creates_a_file(tmp_path):
    """The journal's mode is not a mode to set: the restored file keeps its own (no setuid);
    and a patched file deleted after the kill is reported, not created again."""
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    add_record(site, "sglang", "0.5.8")
    pristine = (site / SERVER_ARGS).read_bytes()
    path = killed_apply(site)
    doc = json.loads(path.read_text())
    doc["files"][0]["mode"] = 0o6777
    path.write_text(json.dumps(doc))
    assert (site / SERVER_ARGS).read_bytes() != pristine  # the kill left it patched
    code, out, err = cli("recover", "--sglang", str(site))
    assert code == 0, err
    assert (site / SERVER_ARGS).read_bytes() == pristine and mode(site / SERVER_ARGS) == 0o644
    path = killed_apply(site)
    (site / SERVER_ARGS).unlink()
    code, out, err = cli("recover", "--sglang", str(site))
    assert code == 0 and "does not create it again" in out + err, out + err
    assert not (site / SERVER_ARGS).exists()


def test_a_pristine_copy_is_restored_only_as_the_releases_own_bytes(tmp_path):
    """A pristine copy replaced, with the manifest's before-hash set to match it: revert writes
    it only when it is the file's RECORD hash, so it refuses and changes nothing."""
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    add_record(site, "sglang", "0.5.8")
    assert cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")[0] == 0
    state = site / ".sm120patch" / "sglang"
    evil = b"import os\nos.system('id')\n"
    doc = json.loads((state / "manifest.json").read_text())
    doc["files"][0]["before"] = sha(evil)
    (state / "manifest.json").write_text(json.dumps(doc))
    (state / "pristine" / SERVER_ARGS).write_bytes(evil)
    patched = (site / SERVER_ARGS).read_bytes()
    for args in (["revert", "moe"], ["revert", "moe", "--force"]):
        code, _, err = cli(*args, "--sglang", str(site))
        assert code == 1 and "RECORD lists another sha256" in err and one_line(err), err
        assert (site / SERVER_ARGS).read_bytes() == patched


@pytest.mark.parametrize("via", ["HOME", "SM120PATCH_STATE_DIR"])
def test_no_state_is_migrated_from_another_users_directory(via, attacker, shared, monkeypatch):
    """0.1.0's per-user state of the attacker's (root run with their HOME, or pointed at their
    directory) is neither read nor moved: nothing is recovered from it."""
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    home = shared / "home"
    attacker.give(home)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    if via == "HOME":
        monkeypatch.delenv(store.LEGACY_ENV, raising=False)
        monkeypatch.setenv("HOME", str(home))
    else:
        monkeypatch.setenv(store.LEGACY_ENV, str(home / "state"))
    legacy = store.legacy_state_dir_for(site, "sglang")
    assert legacy is not None and home in legacy.parents
    evil = ID.read_bytes()
    attacker.write(legacy / "pristine" / "sglang" / "evil_id", evil, 0o755)
    attacker.write(legacy / "journal.json", journal([{
        "path": "sglang/evil_id", "module": "sglang/evil_id", "before": sha(evil),
        "after": sha(b"x"), "mode": 0o4755}]))  # fmt: skip
    code, out, err = cli("recover", "--sglang", str(site))
    assert code == 0 and "nothing to recover" in out, out + err
    code, out, _ = cli("status", "--sglang", str(site), "--json")
    assert json.loads(out)["targets"][0]["state"] == "pristine"
    assert not (site / "sglang" / "evil_id").exists()
    assert (legacy / "journal.json").exists()  # not moved either
    assert not (site / ".sm120patch" / "sglang" / "journal.json").exists()


def test_recover_after_an_upgrade_writes_nothing_of_the_old_release(tmp_path):
    """A killed apply of `all`, then pip installs SGLang 0.5.9: recover writes none of 0.5.8's
    bytes into 0.5.9 (the target is replaced) and rolls FlashInfer back as usual."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    add_record(sg, "sglang", "0.5.8")
    add_record(fi, "flashinfer", "0.6.8")
    fi_pristine = tree_hash(fi)
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]
    proc = sm("apply", "all", *where, "--no-gpu-check", env={KILL_ENV: "after-write:2"})
    assert proc.returncode == -9
    new = upgrade(sg, "sglang", "0.5.8", "0.5.9")
    code, out, err = cli("recover", *where)
    assert code == 0, err
    assert "nothing of 0.5.8 was written back" in out and "`sm120patch apply all " in out, out
    for rel, data in new.items():
        assert (sg / rel).read_bytes() == data, rel
    assert tree_hash(fi) == fi_pristine
    code, out, _ = cli("status", *where, "--json")
    assert {t["kind"]: t["state"] for t in json.loads(out)["targets"]} == {
        "sglang": "pristine", "flashinfer": "pristine"}  # fmt: skip


def test_recover_after_an_upgrade_finishes_no_revert_with_the_old_bytes(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    add_record(sg, "sglang", "0.5.8")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    proc = sm("revert", "moe", "--sglang", str(sg), env={KILL_ENV: "after-journal"})
    assert proc.returncode == -9
    new = upgrade(sg, "sglang", "0.5.8", "0.5.9")
    code, out, err = cli("recover", "--sglang", str(sg))
    assert code == 0 and "nothing of 0.5.8 was written back" in out, out + err
    for rel, data in new.items():
        assert (sg / rel).read_bytes() == data, rel
    assert not (sg / ".sm120patch" / "sglang" / "manifest.json").exists()


# ---- the lock of a run --------------------------------------------------------------------
def test_only_the_owner_can_hold_the_lock(attacker, shared):
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")[0] == 0
    lock = site / ".sm120patch" / "sglang" / "lock"
    assert mode(lock) == 0o600 and lock.stat().st_uid == 0
    proc = attacker.run(
        "import fcntl, os, sys\n"
        "try:\n    fd = os.open(sys.argv[1], os.O_RDONLY)\nexcept PermissionError:\n"
        "    sys.exit(3)\nfcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n",
        str(lock),
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert cli("revert", "moe", "--sglang", str(site))[0] == 0


# ---- packs -------------------------------------------------------------------------------
PACK_MODULE = '''
import libcst as cst
from sm120patch.patchkit.model import Patch, already_applied, applied

MARK = {mark!r}


def transform(module):
    {body}
    if "PACK_MARK" in module.code:
        return already_applied("<module>", "marked")
    line = cst.parse_statement(f"PACK_MARK = {{MARK!r}}\\n")
    return applied("<module>", module.with_changes(body=[*module.body, line]), "marked")


PATCH = Patch(id="flashinfer.packmark", target="flashinfer", title="t", why="w",
              files=("flashinfer/jit/__init__.py",), marker="", transform=transform)
'''
PACK_PROFILES = '''schema = 1

[profiles.packmark]
patches = ["flashinfer.packmark"]

[profiles.packmark.pins]
flashinfer = ">=0.6"
'''


def write_pack(root: Path, mark: str, body: str = "pass", on_import: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "packmark.py").write_text(on_import + PACK_MODULE.format(mark=mark, body=body))
    (root / "profiles.toml").write_text(PACK_PROFILES)
    return root


def test_an_apply_runs_a_packs_code_as_it_is_now(tmp_path):
    """A pack edited after the dry run: apply writes what the edited code makes; a pack whose
    transform now raises applies nothing (nothing of the dry run's plan is kept)."""
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    pack = write_pack(tmp_path / "pack", "v1")
    env: dict[str, str | None] = {"SM120PATCH_CACHE": str(tmp_path / "cache")}
    args = ["--patches", str(pack), "apply", "packmark", "--flashinfer", str(fi), "--no-gpu-check"]
    assert sm(*args, "--dry-run", env=env).returncode == 0
    write_pack(pack, "v2")
    proc = sm(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (fi / "flashinfer/jit/__init__.py").read_text().strip() == "PACK_MARK = 'v2'"
    assert sm("--patches", str(pack), "revert", "packmark", "--flashinfer", str(fi),
              env=env).returncode == 0  # fmt: skip
    assert sm(*args, "--dry-run", env=env).returncode == 0
    write_pack(pack, "v2", body='raise RuntimeError("broken")')
    proc = sm(*args, env=env)
    assert proc.returncode == 1 and "RuntimeError: broken" in proc.stderr, proc.stderr
    assert (fi / "flashinfer/jit/__init__.py").read_text() == ""


@pytest.mark.parametrize("how", ["owned by the attacker", "group-writable", "a module of theirs",
                                 "a directory above it theirs"])  # fmt: skip
@pytest.mark.parametrize("via", ["--patches", "SM120PATCH_PATCHES"])
def test_a_pack_anyone_else_could_write_is_refused_before_it_runs(how, via, attacker, shared):
    marker = shared / "pwned"
    on_import = f"open({str(marker)!r}, 'w').write('ran')\n"
    if how == "owned by the attacker":
        pack = shared / "pack"
        attacker.give(pack)
        attacker.write(pack / "packmark.py", on_import + PACK_MODULE.format(mark="x", body="pass"))
        attacker.write(pack / "profiles.toml", PACK_PROFILES)
    elif how == "group-writable":
        pack = write_pack(shared / "pack", "x", on_import=on_import)
        os.chown(pack, 0, attacker.group_gid)
        pack.chmod(0o775)
    elif how == "a module of theirs":
        pack = write_pack(shared / "pack", "x")
        pack.chmod(0o777)
        attacker.write(pack / "helper.py", on_import)
        pack.chmod(0o755)
    else:
        above = shared / "above"
        attacker.give(above)
        pack = above / "pack"
        pack.mkdir()  # root's own, but the attacker may rename it away and put theirs there
        write_pack(pack, "x", on_import=on_import)
    if via == "--patches":
        proc = sm("--patches", str(pack), "list")
    else:
        proc = sm("list", env={catalog.PACKS_ENV: str(pack)})
    assert proc.returncode == 2 and "runs with your privileges" in proc.stderr, proc.stderr
    assert one_line(proc.stderr), proc.stderr
    assert not marker.exists()


def test_python_m_does_not_load_an_entry_point_from_the_working_directory(attacker, shared):
    here = shared / "work"
    attacker.give(here)
    marker = shared / "pwned"
    attacker.write(here / "evilpack.py", f"open({str(marker)!r}, 'w').write('ran')\n")
    attacker.write(here / "evilpack-1.0.dist-info" / "METADATA", "Name: evilpack\nVersion: 1.0\n")
    attacker.write(here / "evilpack-1.0.dist-info" / "entry_points.txt",
                   "[sm120patch.patches]\nevil = evilpack\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "sm120patch", "list"], cwd=here,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


def test_the_ansible_module_runs_the_tool_with_a_clean_environment(monkeypatch):
    import importlib.util

    path = (Path(__file__).resolve().parents[1] / "ansible_collections" / "sm120" / "sm120patch"
            / "plugins" / "modules" / "sm120patch.py")  # fmt: skip
    spec = importlib.util.spec_from_file_location("sm120patch_ansible_module", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}

    def fake_run(argv, **kwargs):
        seen.update(kwargs)
        return subprocess.CompletedProcess(argv, 0, "{}", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    for name, value in (("SM120PATCH_PATCHES", "/tmp/evil"), ("PYTHONPATH", "/tmp/evil"),
                        ("PATH", "/tmp/evil/bin:/usr/bin"), ("SM120PATCH_CACHE", "/tmp/c")):
        monkeypatch.setenv(name, value)  # fmt: skip

    class Fake:
        params = {"python": sys.executable, "sglang": None, "flashinfer": None, "vllm": None}

    tool = module.Tool(Fake())
    tool.call("status")
    env = seen["env"]
    assert set(env) == {"PATH", "HOME", "LC_ALL", "LANG"}, env
    assert "/tmp/evil" not in env["PATH"] and seen["cwd"] == "/"


# ---- lock files --------------------------------------------------------------------------------
def edit_lock(lock: lockfile.Lock, how: str, before: str) -> lockfile.Lock:
    """What an attacker makes of a genuine lock."""
    step = lock.steps[0]
    if how == "a line added to a diff, after-hashes edited":
        text = apply_diff(before, step.diff)
        assert text is not None
        evil = text + "import os; os.system('id')\n"
        lock.steps[0] = replace(step, diff=diff_texts(step.path, before, evil),
                                after=sha(evil.encode()))  # fmt: skip
        lock.files[0] = replace(lock.files[0], after=sha(evil.encode()))
    elif how == "its diff text alone edited":
        lines = step.diff.split("\n")
        idx = next(i for i, line in enumerate(lines)
                   if line.startswith("+") and not line.startswith("+++"))  # fmt: skip
        lines[idx] += "  # as reviewed"
        lock.steps[0] = replace(step, diff="\n".join(lines))
    elif how == "its diff made to name another file":
        head, sep, rest = step.diff.partition("@@ ")
        lock.steps[0] = replace(step, diff=head.replace(step.path, "sglang/version.py") + sep + rest)
    else:
        text = "import os\n"
        lock.files.append(lockfile.LockedFile("sglang", "sglang/__init__.py", sha(b""),
                                              sha(text.encode())))  # fmt: skip
        lock.steps.append(lockfile.LockedStep("sglang", "sglang/__init__.py", step.patch,
                                              sha(text.encode()),
                                              diff_texts("sglang/__init__.py", "", text)))  # fmt: skip
    return lock


@pytest.mark.parametrize("how", ["a line added to a diff, after-hashes edited",
                                 "its diff text alone edited", "its diff made to name another file",
                                 "a file no patch touches"])  # fmt: skip
def test_a_lock_is_a_claim_to_verify_never_a_source_of_bytes(how, attacker, shared, tmp_path):
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    genuine = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(site), "-o", str(genuine))[0] == 0
    planted = attacker.give(shared / "drop") / "moe.lock"
    lock = edit_lock(lockfile.read(genuine), how, (site / SERVER_ARGS).read_text())
    attacker.write(planted, lock.to_toml())
    before = tree_hash(site)
    for verb in ("apply", "ensure"):
        code, _, err = cli(verb, "--locked", str(planted), "--sglang", str(site), "--no-gpu-check")
        assert code == 1 and "nothing was changed" in err and one_line(err), err
        assert tree_hash(site) == before
    if how == "a file no patch touches":
        assert "sglang/__init__.py, which no patch of profile moe touches" in err, err
    assert cli("apply", "--locked", str(genuine), "--sglang", str(site), "--no-gpu-check")[0] == 0


def test_a_lock_whose_diffs_show_the_same_change_another_way_is_accepted(tmp_path):
    """A lock's diff is checked by applying it: a reviewer's diff with more context (what
    `git diff -U5` shows) turns the same text into the same bytes, so the lock holds; one
    that does not is refused."""
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    lock_path = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(site), "-o", str(lock_path))[0] == 0
    lock = lockfile.read(lock_path)
    step = lock.steps[0]
    before = (site / step.path).read_text()
    after = apply_diff(before, step.diff)
    assert after is not None
    import difflib

    wide = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"a/{step.path}", f"b/{step.path}", n=5))  # fmt: skip
    assert wide != step.diff.split("\n", 1)[1]  # another text of the same change
    lock.steps[0] = replace(step, diff=f"diff --git a/{step.path} b/{step.path}\n" + wide)
    lock_path.write_text(lock.to_toml())
    before_tree = tree_hash(site)
    code, _, err = cli("apply", "--locked", str(lock_path), "--sglang", str(site), "--no-gpu-check")
    assert code == 0, err
    assert tree_hash(site) != before_tree
    assert cli("revert", "--all", "--sglang", str(site))[0] == 0
    # One context line of the wide diff changed: it no longer gives those bytes.
    lines = lock.steps[0].diff.split("\n")
    idx = next(i for i, line in enumerate(lines) if line.startswith(" "))
    lines[idx] = " # not what the file says"
    lock.steps[0] = replace(lock.steps[0], diff="\n".join(lines))
    lock_path.write_text(lock.to_toml())
    code, _, err = cli("apply", "--locked", str(lock_path), "--sglang", str(site), "--no-gpu-check")
    assert code == 1 and "the lock's diff is not the change these patches make" in err, err
    assert tree_hash(site) == before_tree


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "sglang/../../x.py",
                                 "flashinfer/x.py"])  # fmt: skip
def test_a_lock_naming_a_bad_path_is_a_usage_error(rel, tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    lock_path = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(site), "-o", str(lock_path))[0] == 0
    lock = lockfile.read(lock_path)
    lock.files[0] = replace(lock.files[0], path=rel)
    lock_path.write_text(lock.to_toml())
    code, _, err = cli("apply", "--locked", str(lock_path), "--sglang", str(site), "--no-gpu-check")
    assert code == 2 and "not a path inside a sglang package" in err and one_line(err), err
    code, _, err = cli("apply", "--locked", str(tmp_path), "--sglang", str(site), "--no-gpu-check")
    assert code == 2 and "is a directory" in err, err


# ---- git ------------------------------------------------------------------------------------------
HOOKS = ("pre-commit", "prepare-commit-msg", "commit-msg", "post-commit", "post-checkout",
         "reference-transaction", "post-rewrite", "pre-auto-gc")  # fmt: skip


def plant_hooks(directory: Path, marker: Path, write=None) -> None:
    for hook in HOOKS:
        text = f"#!/bin/sh\necho {hook} >> {marker}\n"
        if write is None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / hook).write_text(text)
            (directory / hook).chmod(0o755)
        else:
            write(directory / hook, text, 0o755)


def test_git_runs_no_hook_for_sm120patchs_own_commits_and_checkouts(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    marker = tmp_path / "hooks-ran"
    plant_hooks(sg / ".git" / "hooks", marker)
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    git(sg, "config", "core.hooksPath", str(tmp_path / "hooks"))
    plant_hooks(tmp_path / "hooks", marker)
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert not marker.exists(), marker.read_text()


def test_a_checkout_owned_by_another_user_is_refused_without_safe_directory(
    attacker, shared, tmp_path, monkeypatch
):
    sg = make_tree(shared, "sglang", "0.5.8", "git")
    for path in [sg, *sg.rglob("*")]:
        os.lchown(path, attacker.uid, attacker.gid)
    marker = shared / "hooks-ran"
    attacker.give(shared / "out", 0o777)
    marker = shared / "out" / "hooks-ran"
    plant_hooks(sg / ".git" / "hooks", marker, write=attacker.write)
    # Root trusting every directory, as the old refusal's hint told it to.
    config = tmp_path / "gitconfig"
    config.write_text("[safe]\n\tdirectory = *\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    before = tree_hash(sg)
    for args in (["apply", "moe", "--no-gpu-check"], ["status"]):
        code, _, err = cli(*args, "--sglang", str(sg))
        assert code == 1 and f"owned by another user ({attacker.name})" in err, err
        assert one_line(err) and "safe.directory" not in err
    assert tree_hash(sg) == before and not marker.exists()


FILTER = "[filter \"evil\"]\n\tclean = {s} clean\n\tsmudge = {s} smudge\n\trequired = true\n" \
         "[filter \"evil2\"]\n\tprocess = {s} process\n"


@pytest.mark.parametrize("where", ["a global config", "the environment", "info/attributes",
                                   "a .gitattributes"])  # fmt: skip
def test_git_runs_no_filter_driver_from_anywhere(where, attacker, shared, tmp_path, monkeypatch):
    """root runs apply and revert on its own checkout with a user's HOME (sudo keeping HOME):
    a filter driver that user defines in ~/.gitconfig (assigned through core.attributesFile),
    or one the repository's own config defines and `$GIT_DIR/info/attributes` or an in-tree
    `.gitattributes` assigns, never runs; the bytes are the patches' and then the branch's."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    marker = attacker.give(shared / "out", 0o777) / "filter-ran"
    script = attacker.give(shared / "bin") / "filter.sh"
    attacker.write(script, f"#!/bin/sh\necho \"$1 $(id -u)\" >> {marker}\ncat\n", 0o755)
    drivers = FILTER.format(s=script)
    if where == "a global config":
        home = attacker.give(shared / "home")
        attacker.write(home / "attributes", "* filter=evil\n*.py filter=evil2\n")
        attacker.write(home / ".gitconfig", drivers + f"[core]\n\tattributesFile = {home}/attributes\n")
        attacker.write(home / ".config" / "git" / "config", drivers)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
        monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    elif where == "the environment":  # an EnvironmentFile's GIT_CONFIG_* (git >= 2.31)
        attrs = attacker.give(shared / "env") / "attributes"
        attacker.write(attrs, "* filter=evil\n")
        for i, (key, value) in enumerate([("core.attributesFile", str(attrs)),
                                          ("filter.evil.clean", f"{script} clean"),
                                          ("filter.evil.smudge", f"{script} smudge")]):  # fmt: skip
            monkeypatch.setenv(f"GIT_CONFIG_KEY_{i}", key)
            monkeypatch.setenv(f"GIT_CONFIG_VALUE_{i}", value)
        monkeypatch.setenv("GIT_CONFIG_COUNT", "3")
    else:
        if where == "a .gitattributes":
            (sg / ".gitattributes").write_text("* filter=evil\n*.py filter=evil2\n")
            git(sg, "add", ".gitattributes")
            git(sg, "commit", "-q", "-m", "attributes")
        else:
            (sg / ".git" / "info").mkdir(exist_ok=True)
            (sg / ".git" / "info" / "attributes").write_text("* filter=evil\n*.py filter=evil2\n")
        with (sg / ".git" / "config").open("a") as fh:
            fh.write(drivers)
    pristine = (sg / "python" / SERVER_ARGS).read_bytes()
    assert not marker.exists()
    code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    patched = (sg / "python" / SERVER_ARGS).read_bytes()
    assert patched != pristine
    committed = subprocess.run(["git", "-C", str(sg), "-c", "filter.evil.process=", "-c",
                                "filter.evil2.process=", "show", f"HEAD:python/{SERVER_ARGS}"],
                               capture_output=True, check=True).stdout  # fmt: skip
    assert committed == patched  # what was committed is what the patches wrote
    code, _, err = cli("revert", "moe", "--sglang", str(sg))
    assert code == 0, err
    assert (sg / "python" / SERVER_ARGS).read_bytes() == pristine
    assert not marker.exists(), marker.read_text()


# ---- outputs ----------------------------------------------------------------------------------
@pytest.fixture
def victim(shared):
    """A file of root's that an attacker would like overwritten or deleted."""
    d = shared / "victim"
    d.mkdir()
    path = d / "0001-precious.patch"
    path.write_text("precious\n")
    return path


def sticky(shared: Path) -> Path:
    d = shared / "tmp"
    d.mkdir()
    d.chmod(0o1777)  # a /tmp
    return d


def test_pin_and_trial_outputs_replace_a_symlink_never_follow_it(attacker, shared, victim):
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    out = sticky(shared)
    for name in ("moe.lock", "report.html", "known.toml"):
        attacker.symlink(victim, out / name)
    # --force: `pin -o` replaces an existing name only when asked (a link too)
    assert cli("pin", "moe", "--sglang", str(site), "-o", str(out / "moe.lock"), "--force")[0] == 0
    assert cli("trial", "moe", "--sglang", str(site), "--no-gpu-check", "--", "true")[0] == 0
    code, _, err = cli("trial", "show", "--sglang", str(site), "--html", str(out / "report.html"))
    assert code == 0, err
    files.write_output(out / "known.toml", "[x]\n")  # what `--export` writes through
    assert victim.read_text() == "precious\n"
    for name in ("moe.lock", "report.html", "known.toml"):
        assert not (out / name).is_symlink() and (out / name).stat().st_uid == 0
    assert (out / "moe.lock").read_text().startswith("# sm120patch lock file")
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_a_log_or_trace_at_a_symlink_is_refused(attacker, shared, victim):
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    out = sticky(shared)
    attacker.symlink(victim, out / "trial.log")
    attacker.symlink(victim, out / "steps.txt")
    code, _, err = cli("trial", "moe", "--sglang", str(site), "--no-gpu-check",
                       "--log", str(out / "trial.log"), "--", "true")  # fmt: skip
    assert code == 2 and "symbolic link" in err and one_line(err), err
    proc = sm("apply", "moe", "--sglang", str(site), "--no-gpu-check",
              env={TRACE_ENV: str(out / "steps.txt")})  # fmt: skip
    assert proc.returncode == 2 and "symbolic link" in proc.stderr, proc.stderr
    assert victim.read_text() == "precious\n"
    assert (site / ".sm120patch" / "sglang" / "journal.json").exists() is False


def test_export_overwrite_deletes_nothing_through_a_symlink(attacker, shared, victim):
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    out = shared / "series"
    attacker.give(out, 0o777)
    attacker.symlink(victim.parent, out / "sglang")
    code, _, err = cli("export", "moe", "--sglang", str(site), "-o", str(out), "--overwrite")
    assert code == 1 and "symbolic link" in err and one_line(err), err
    assert victim.read_text() == "precious\n"
    os.unlink(out / "sglang")
    attacker.symlink(shared / "elsewhere", out / "flashinfer")
    code, _, err = cli("export", "moe", "--sglang", str(site), "-o", str(out))
    assert code == 1 and "symbolic link" in err, err
    assert not (shared / "elsewhere").exists()


# ---- one line, never an internal error ------------------------------------------------------
@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(applied_at="yesterday"), "applied_at is not a time"),
    (lambda m: m.update(target=[]), "target is not a table"),
    (lambda m: m["target"].update(layout="svn"), "target.layout 'svn' is neither git nor"),
    (lambda m: m.update(patches=5), "patches is not a list"),
    (lambda m: m.update(tool_version=1), "tool_version is not a string"),
    (lambda m: m["files"][0].update(module=["x"]), "module is not a path"),
])  # fmt: skip
def test_a_mistyped_manifest_is_one_line(edit, needle, tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")[0] == 0
    path = site / ".sm120patch" / "sglang" / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    before = tree_hash(site)
    for args in (["status"], ["revert", "moe"], ["apply", "moe", "--no-gpu-check"]):
        code, _, err = cli(*args, "--sglang", str(site))
        assert code == 1 and needle in err and one_line(err), (args, err)
    assert tree_hash(site) == before


@pytest.mark.parametrize("edit, needle", [
    (lambda j: j.update(started="now"), "started is not a time"),
    (lambda j: j.update(pid="1"), "pid is not a process id"),
    (lambda j: j.update(keep_branch="yes"), "keep_branch is not true or false"),
    (lambda j: j.update(target={"kind": 1}), "target is not a table of strings"),
])  # fmt: skip
def test_a_mistyped_journal_is_one_line(edit, needle, tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    path = killed_apply(site)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    code, _, err = cli("recover", "--sglang", str(site))
    assert code == 1 and needle in err and one_line(err), err


@pytest.mark.parametrize("trial, needle", [
    ({"command": 5}, "a trial's command is not a list of words"),
    ({"id": ["x"]}, "a trial's id is not a string"),
    ({"kind": "measured", "runs": [{"side": "patched", "round": 0, "figures":
                                    {"output_tok_s": "fast"}}]}, "figures that are not numbers"),
])  # fmt: skip
def test_a_mistyped_trial_record_is_one_line(trial, needle, tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    state = site / ".sm120patch" / "sglang"
    state.mkdir(parents=True)
    (state / "trials.json").write_text(json.dumps({"schema": 1, "trials": [trial]}))
    for args in (["status"], ["trial", "show"]):
        code, _, err = cli(*args, "--sglang", str(site))
        assert code == 1 and needle in err and one_line(err), (args, err)


def _full_disk_at(n: int, monkeypatch) -> list[int]:
    calls = [0]

    def write(path, data):
        calls[0] += 1
        if calls[0] == n:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    fail_writes(monkeypatch, write)
    return calls


@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_a_full_disk_at_any_write_is_one_line_and_leaves_the_trees_whole(verb, tmp_path,
                                                                         monkeypatch):
    def trees(n: int) -> list[str]:
        base = tmp_path / f"run{n}"
        sg = make_tree(base, "sglang", "0.5.8", "installed")
        fi = make_tree(base, "flashinfer", "0.6.8", "installed")
        where = ["--sglang", str(sg), "--flashinfer", str(fi)]
        if verb == "revert":
            assert cli("apply", "all", *where, "--no-gpu-check")[0] == 0
        return where

    def whole(where: list[str]) -> str:
        code, out, err = cli("status", *where, "--json")
        assert code == 0, err
        states = {t["state"] for t in json.loads(out)["targets"]}
        assert len(states) == 1 and states <= {"pristine", "applied"}, states
        return states.pop()

    args = {"apply": ["apply", "all", "--no-gpu-check"], "revert": ["revert", "--all"]}[verb]
    where = trees(0)
    calls = _full_disk_at(0, monkeypatch)
    assert cli(*args, *where)[0] == 0
    writes = calls[0]
    monkeypatch.undo()
    assert writes >= 4
    for n in range(1, writes + 1):
        where = trees(n)
        _full_disk_at(n, monkeypatch)
        code, _, err = cli(*args, *where)
        monkeypatch.undo()
        monkeypatch.setenv("SM120PATCH_STATE_DIR", str(tmp_path / "legacy"))
        assert code in (0, 1, 75) and "internal error" not in err, (n, err)
        if code != 0:
            assert "No space left on device" in err and one_line(err), (n, err)
        if code == 75:
            assert cli("recover", *where)[0] == 0
        whole(where)



# ---- test hooks ---------------------------------------------------------------------------------
def test_the_test_hooks_cannot_be_driven_from_the_environment(tmp_path):
    """SM120PATCH_KILL_AT, SM120PATCH_SIGNAL_AT and SM120PATCH_TRACE_STEPS in a service's
    EnvironmentFile: a plain `python -m sm120patch` neither kills nor signals itself, nor
    writes the trace file; the same variables with the harness's switch on do."""
    from sm120patch.engine import interrupts

    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    trace = tmp_path / "steps.txt"
    env = {**os.environ, KILL_ENV: "after-write", TRACE_ENV: str(trace),
           interrupts.SIGNAL_ENV: "after-journal=TERM"}  # fmt: skip
    plain = [sys.executable, "-m", "sm120patch", "apply", "moe", "--sglang", str(site),
             "--no-gpu-check"]  # fmt: skip
    proc = subprocess.run(plain, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "applied" in proc.stdout, proc.stdout + proc.stderr
    assert not trace.exists()
    assert not (site / ".sm120patch" / "sglang" / "journal.json").exists()
    assert cli("revert", "moe", "--sglang", str(site))[0] == 0
    hooked = subprocess.run(command(*plain[3:]), env=env, capture_output=True, text=True)
    assert hooked.returncode == 130 and "interrupted (SIGTERM)" in hooked.stderr, hooked.stderr
    assert "after-journal:1" in trace.read_text().split()


# ---- reads: regular files only ------------------------------------------------------------------
def users_site(base: Path, who: Attacker) -> Path:
    """An installed SGLang 0.5.8 in a site-packages of the attacker's own (root is asked to
    look at or patch it: the security model lets root make its state theirs)."""
    site = make_tree(base, "sglang", "0.5.8", "installed")
    add_record(site, "sglang", "0.5.8")
    for path in [site, *site.rglob("*")]:
        os.lchown(path, who.uid, who.gid)
    return site


def test_a_fifo_in_state_or_in_a_scanned_tree_blocks_nothing(attacker, shared):
    """The attacker makes a FIFO of `.sm120patch/sglang/journal.json` in their environment:
    root's status and ensure refuse in one line at once (they used to wait forever on the
    open); a FIFO among the package's modules is skipped by scan, with a note."""
    site = users_site(shared, attacker)
    fifo = site / ".sm120patch" / "sglang" / "journal.json"
    attacker.mkdir(fifo.parent)
    attacker.ok("import os, sys\nos.mkfifo(sys.argv[1], 0o644)", str(fifo))
    before = tree_hash(site)
    for args in (["status"], ["ensure", "moe", "--no-gpu-check"]):
        proc = subprocess.run(command(*args, "--sglang", str(site)), capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 1 and "is a FIFO, not a regular file" in proc.stderr, proc
        assert one_line(proc.stderr), proc.stderr
    assert tree_hash(site) == before and stat.S_ISFIFO(fifo.lstat().st_mode)
    os.unlink(fifo)
    record = next(site.glob("*.dist-info")) / "METADATA"  # read for the version
    os.unlink(record)
    attacker.ok("import os, sys\nos.mkfifo(sys.argv[1], 0o644)", str(record))
    proc = subprocess.run(command("status", "--sglang", str(site)), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and "METADATA is a FIFO" in proc.stderr, proc
    assert one_line(proc.stderr), proc.stderr
    os.unlink(record)
    attacker.write(record, "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.8\n")
    module = site / "sglang" / "srt" / "evil_fifo.py"
    attacker.ok("import os, sys\nos.mkfifo(sys.argv[1], 0o644)", str(module))
    proc = subprocess.run(command("scan", "--sglang", str(site)), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "evil_fifo.py" in proc.stdout and "a FIFO" in proc.stdout, proc.stdout


def test_a_target_file_swapped_for_a_link_or_grown_huge_is_never_read(attacker, shared,
                                                                     monkeypatch):
    """The attacker, who owns `sglang/srt/`, swaps server_args.py for a link to a root-only
    file between root's check of the path and its read (their inotify race, driven here by a
    hook after every check: the check sees the regular file, the read the link). The link
    leads to a root-only file with the release's bytes (root's own copy elsewhere, 0600):
    root's apply refuses in one line and keeps no copy of it in the attacker's state. A 65 MiB
    server_args.py is refused before it is read."""
    site = users_site(shared, attacker)
    target = site / SERVER_ARGS
    private = shared / "root-only"
    private.mkdir(mode=0o700)
    secret = private / "server_args.py"
    secret.write_bytes(target.read_bytes())
    secret.chmod(0o600)
    swap = "import os, sys\nos.rename(sys.argv[1], sys.argv[1] + '.real')\nos.symlink(sys.argv[2], sys.argv[1])"
    back = "import os, sys\nos.unlink(sys.argv[1])\nos.rename(sys.argv[1] + '.real', sys.argv[1])"

    def racing(check):
        def checked(*args, **kwargs):
            if target.is_symlink():
                attacker.ok(back, str(target))
            out = check(*args, **kwargs)  # the check sees the regular file ...
            attacker.ok(swap, str(target), str(secret))  # ... the use finds the link
            return out

        return checked

    from sm120patch.engine import apply as engine_apply

    monkeypatch.setattr(files, "inside", racing(files.inside))
    monkeypatch.setattr(engine_apply, "check_writable", racing(engine_apply.check_writable))
    code, _, err = cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    monkeypatch.undo()
    assert code == 1 and "reads no target or state file through one" in err and one_line(err), err
    assert not (site / ".sm120patch" / "sglang" / "pristine" / SERVER_ARGS).exists()
    assert mode(secret) == 0o600 and secret.stat().st_uid == 0
    attacker.ok(back, str(target))
    attacker.ok("import os, sys\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC)\n"
                "os.ftruncate(fd, 65 << 20)", str(target))  # fmt: skip
    code, _, err = cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    assert code == 1 and "more than sm120patch reads" in err and one_line(err), err
    assert target.stat().st_size == 65 << 20 and target.stat().st_uid == attacker.uid


# ---- targets come from the command line ---------------------------------------------------------
def test_recover_writes_no_peer_it_was_not_given(attacker, shared):
    """A journal in the attacker's environment names root's production FlashInfer as the peer
    of a killed revert: root's `recover --sglang <theirs>` finishes the attacker's SGLang and
    only reports the FlashInfer; its patched bytes, manifest, owner and modes stay as they
    were (root reverts it by naming it)."""
    theirs = make_tree(shared / "user", "sglang", "0.5.8", "installed")
    prod = make_tree(shared / "prod", "flashinfer", "0.6.8", "installed")
    add_record(prod, "flashinfer", "0.6.8")
    where = ["--sglang", str(theirs), "--flashinfer", str(prod)]
    assert cli("apply", "all", *where, "--no-gpu-check")[0] == 0
    proc = sm("revert", "--all", *where, env={KILL_ENV: "after-journal:1"})
    assert proc.returncode == -9, proc.stderr
    journal_path = theirs / ".sm120patch" / "sglang" / "journal.json"
    assert json.loads(journal_path.read_text())["peers"], "the revert journals its peer"
    for path in [theirs, *theirs.rglob("*")]:
        os.lchown(path, attacker.uid, attacker.gid)  # the attacker's environment, their journal
    prod_before = {p: (p.read_bytes(), mode(p), p.stat().st_uid)
                   for p in prod.rglob("*") if p.is_file()}  # fmt: skip
    code, out, err = cli("recover", "--sglang", str(theirs))
    assert code == 0, err
    assert f"names flashinfer at {prod} too, which you did not name" in out + err, out + err
    assert {p: (p.read_bytes(), mode(p), p.stat().st_uid)
            for p in prod.rglob("*") if p.is_file()} == prod_before  # fmt: skip
    assert not journal_path.exists()
    code, out, _ = cli("status", "--flashinfer", str(prod), "--json")
    assert json.loads(out)["targets"][0]["state"] == "applied"  # root's, reverted by root
    assert cli("revert", "--all", "--flashinfer", str(prod))[0] == 0


# ---- the release cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["the user's HOME", "a shared SM120PATCH_CACHE"])
def test_a_release_cache_of_someone_elses_is_ignored(where, attacker, shared, monkeypatch,
                                                     capsys):  # fmt: skip
    """A release cache the attacker could write (root with their HOME, or a shared directory)
    with a planted tree and a lock symlink to a root-only file: it is ignored with one
    warning, nothing in it is read or opened, and the root-only file keeps its bytes and mode."""
    from sm120patch.maintain import releases, trees

    victim = shared / "root-only"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    if where == "the user's HOME":
        home = attacker.give(shared / "home")
        cache = home / ".cache" / "sm120patch"
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("SM120PATCH_CACHE", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        cache = shared / "cache"
        cache.mkdir()
        cache.chmod(0o1777)
        monkeypatch.setenv("SM120PATCH_CACHE", str(cache))
    attacker.write(cache / "trees" / "sglang-0.5.8" / SERVER_ARGS, "import os; os.system('id')\n")
    attacker.mkdir(cache / "dist")
    attacker.symlink(victim, cache / "dist" / ".sglang-0.5.8.lock")
    monkeypatch.setattr(releases, "_judged", {}, raising=False)
    monkeypatch.setattr(releases, "warn", lambda text: print(f"WARN {text}"), raising=False)
    for _ in range(2):
        used = releases.cache_dir()
        assert cache not in (used, *used.parents) and used.stat().st_uid == 0
        assert releases.trees_dir() == used / "trees"
    out = capsys.readouterr().out
    assert out.count("WARN ignoring the release cache") == 1, out
    with releases.locked(releases.dist_dir() / ".sglang-0.5.8.lock"):
        pass
    assert not trees._tree_covers(releases.trees_dir() / "sglang-0.5.8", (SERVER_ARGS,))
    assert victim.read_text() == "precious\n" and mode(victim) == 0o600


def test_a_lock_link_in_the_release_cache_is_never_followed(tmp_path, monkeypatch):
    from sm120patch.maintain import releases

    monkeypatch.setenv("SM120PATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(releases, "_judged", {}, raising=False)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    lock = releases.dist_dir() / ".sglang-0.5.8.lock"
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)
    with pytest.raises(releases.ReleaseError, match="cannot open the lock"):
        with releases.locked(lock):
            pass
    assert victim.read_text() == "precious\n" and mode(victim) == 0o600


# ---- explain's interpreter ----------------------------------------------------------------------
@pytest.mark.parametrize("how", ["a pyvenv.cfg above a pip --target tree",
                                 "a venv whose bin/ the group may write", "--python theirs"])  # fmt: skip
def test_explain_runs_no_interpreter_someone_else_could_choose(how, attacker, shared):
    """explain runs the target environment's own interpreter (its pyvenv.cfg at the root of
    `lib/pythonX.Y/site-packages`) or --python, and refuses one that anyone but its owner or
    root could change: the attacker's planted `bin/python` never runs as root."""
    marker = attacker.give(shared / "out", 0o777) / "ran"
    evil = f"#!/bin/sh\necho \"$(id -u)\" >> {marker}\nexit 3\n"
    if how == "a pyvenv.cfg above a pip --target tree":
        above = shared / "ww"
        above.mkdir()
        above.chmod(0o777)  # two levels above root's `pip install --target` tree
        site = make_tree(above / "deps", "sglang", "0.5.8", "installed")
        attacker.write(above / "pyvenv.cfg", "home = /usr/bin\n")
        attacker.write(above / "bin" / "python", evil, 0o755)
        args = ["--sglang", str(site)]
        code_wanted, needle = 2, "pass --python PATH"
    elif how == "a venv whose bin/ the group may write":
        env = shared / "venv"
        site = make_tree(env / "lib" / "python3.11", "sglang", "0.5.8", "installed")
        site = site.rename(site.with_name("site-packages"))
        (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
        (env / "bin").mkdir()
        os.chown(env / "bin", 0, attacker.group_gid)
        (env / "bin").chmod(0o775)
        attacker.write(env / "bin" / "python", evil, 0o755)
        args = ["--sglang", str(site)]
        code_wanted, needle = 1, "writable by its group or by others"
    else:
        site = make_tree(shared, "sglang", "0.5.8", "installed")
        attacker.write(shared / "out" / "python", evil, 0o755)
        args = ["--sglang", str(site), "--python", str(shared / "out" / "python")]
        code_wanted, needle = 1, "refusing to run"
    code, _, err = cli("explain", *args, "--simulate", "sm120")
    assert code == code_wanted and needle in err and one_line(err), err
    assert not marker.exists(), marker.read_text()
