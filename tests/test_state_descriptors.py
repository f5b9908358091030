"""The state directory is held like the tree (sm120patch/engine/statedir.py): made with mkdir
relative to a held parent and checked on its descriptor before root changes a bit of it, every
state write and removal relative to it and verified first, the lock made O_EXCL and an existing
one used only as the tool makes it, and a path the user names walked without following a link.

Each attack is planted by a second user made for the test (tests/attackers.py), who owns the
venv root runs on; the races are driven by the hook between the check and the use
(`interrupts.HOOKS`), as the attacker's inotify loop drove them. Afterwards the bytes, owners,
modes and link counts on disk are asserted.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from attackers import attacker_fixture, shared_fixture  # noqa: F401 (fixtures)
from killing import cli
from test_handles import digest, forked, once, one_line
from trees import make_tree, tree_hash

from sm120patch.engine import interrupts


def users_venv(shared: Path, attacker) -> Path:
    """An installed SGLang in a site-packages the attacker owns (their venv)."""
    site = make_tree(attacker.give(shared / "home"), "sglang", "0.5.8", "installed")
    for path in [site, *site.rglob("*")]:
        os.chown(path, attacker.uid, attacker.gid, follow_symlinks=False)
    return site


def root_file(where: Path, data: bytes, mode: int) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "victim"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def facts(path: Path) -> tuple[str, int, int, int, int]:
    """What the attack aimed to change: the bytes, owner, group, mode and link count."""
    st = path.lstat()
    return (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_uid, st.st_gid,
            stat.S_IMODE(st.st_mode), st.st_nlink)  # fmt: skip


# ---- 1. root's new state directory swapped before its chmod and chown ----------------------
def nth(n: int, fn):
    """A hook that acts at its `n`-th passage only."""
    seen = []

    def hook():
        seen.append(True)
        if len(seen) == n:
            fn()

    return hook


# The directories root makes on a first apply, in order: the hook's passage for each.
MADE = {".sm120patch": 1, ".sm120patch/sglang/pristine": 3}


@pytest.mark.parametrize("made", list(MADE))
@pytest.mark.parametrize("swap_for", ["link", "own-directory"])
def test_a_state_directory_swapped_as_root_makes_it_gives_nothing_away(
    swap_for, made, attacker, shared, monkeypatch
):
    """Between root's mkdir of a state directory (`.sm120patch`, or `pristine` in the state
    the venv's owner was given) and what follows, the owner renames it aside and puts there a
    link to a root-only file (or a directory of their own, mode 0777): root refuses in one
    line; the file keeps its bytes, owner (root), mode 0600 and single link, the user's
    directory its owner and mode 0777, and the tree keeps its bytes."""
    site = users_venv(shared, attacker)
    victim = root_file(shared / "rootonly", b"root's secret\n", 0o600)
    before, tree = facts(victim), tree_hash(site)
    state = site / made
    decoy = shared / "home" / "decoy"
    attacker.mkdir(decoy, 0o777)

    def swap() -> None:
        if swap_for == "link":
            attacker.ok("import os, sys\nos.rename(sys.argv[1], sys.argv[1] + '.aside')\n"
                        "os.symlink(sys.argv[2], sys.argv[1])", str(state), str(victim))  # fmt: skip
        else:
            attacker.ok("import os, sys\nos.rename(sys.argv[1], sys.argv[1] + '.aside')\n"
                        "os.rename(sys.argv[2], sys.argv[1])", str(state), str(decoy))  # fmt: skip

    monkeypatch.setitem(interrupts.HOOKS, "state-made", nth(MADE[made], swap))
    code, err = forked("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    monkeypatch.delitem(interrupts.HOOKS, "state-made")
    assert code in (1, 75) and one_line(err), err
    if swap_for == "link":
        assert "is in the way of sm120patch's state directory (a symbolic link" in err, err
    else:
        assert "was replaced while sm120patch made it" in err, err
        # The user's own directory, where root's new one was: never chowned nor chmod-ed
        # (an apply's rollback may drop it with the copies it stands for).
        if made == ".sm120patch" or state.exists():
            st = state.lstat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode), os.listdir(state)) == (
                attacker.uid, 0o777, [])
    assert facts(victim) == before
    assert tree_hash(site) == tree


# ---- 2. a hard link planted as the lock -------------------------------------------------------
def _protected_hardlinks() -> bool:
    try:
        return Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "0"
    except OSError:
        return False


@pytest.mark.parametrize("victim_mode", [0o600, 0o666])
def test_a_hard_linked_lock_is_refused_and_never_fchowned(victim_mode, attacker, shared):
    """After root's first apply and revert (the state is the venv owner's now), the owner
    replaces `lock` by a hard link to a root file: root's next apply refuses in one line, and
    the file keeps its owner root, its mode, its bytes and its two links. A world-writable
    file the kernel lets them link (protected_hardlinks allows a file they may read and
    write); a 0600 one only where that protection is off, so here, where it is on, root
    plants that link for them (the box the finding was made on)."""
    site = users_venv(shared, attacker)
    assert cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")[0] == 0
    assert cli("revert", "moe", "--sglang", str(site))[0] == 0
    lock = site / ".sm120patch" / "sglang" / "lock"
    assert lock.stat().st_uid == attacker.uid  # made by root, given to the owner
    victim = root_file(shared / "rootfiles", b"root's file\n", victim_mode)
    plant = "import os, sys\nos.unlink(sys.argv[1])\nos.link(sys.argv[2], sys.argv[1])"
    if victim_mode == 0o666 or not _protected_hardlinks():
        attacker.ok(plant, str(lock), str(victim))
    else:
        lock.unlink()
        os.link(victim, lock)
    before, tree = facts(victim), tree_hash(site)
    assert before[1:] == (0, 0, victim_mode, 2)
    code, _, err = cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    assert code == 1 and one_line(err), err
    if victim_mode == 0o600:
        assert "is not a lock sm120patch made (2 links to one file: a hard link)" in err, err
    else:  # also writable by others: refused as any state anyone could have written
        assert "lock is writable by its group or by others" in err, err
    assert facts(victim) == before and tree_hash(site) == tree


def test_a_lock_of_a_mode_the_tool_never_makes_is_refused_unchanged(attacker, shared):
    """A lock anyone may open is a lock anyone may hold (flock needs only a descriptor): one
    the owner made readable to all is refused as it is, never fchmod-ed (it was there)."""
    site = users_venv(shared, attacker)
    assert cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")[0] == 0
    lock = site / ".sm120patch" / "sglang" / "lock"
    attacker.ok("import os, sys\nos.chmod(sys.argv[1], 0o644)", str(lock))
    code, _, err = cli("revert", "moe", "--sglang", str(site))
    assert code == 1 and "mode 644, not 600" in err and one_line(err), err
    assert (stat.S_IMODE(lock.stat().st_mode), lock.stat().st_uid) == (0o644, attacker.uid)


# ---- 3. the state directory swapped mid-revert -------------------------------------------------
def test_a_state_directory_swapped_mid_revert_deletes_nothing_of_another_tree(
    attacker, shared, monkeypatch
):
    """Root applied moe on production (root's) and on the user's venv. During root's revert
    of the venv, once its journal is written, the user swaps `.sm120patch` for a link to
    production's: the revert refuses in one line, production's manifest and copies keep every
    byte, owner and mode, production still reads `applied`, and the user's journal stays in
    the directory root held."""
    site = users_venv(shared, attacker)
    prod = make_tree(shared / "prod", "sglang", "0.5.8", "installed")
    for tree in (prod, site):
        assert cli("apply", "moe", "--sglang", str(tree), "--no-gpu-check")[0] == 0
    prod_state = prod / ".sm120patch"
    prod_before = digest(prod)
    assert any(k.startswith(".sm120patch/sglang/pristine/") for k in prod_before)
    state = site / ".sm120patch"

    def swap() -> None:
        attacker.ok("import os, sys\nos.rename(sys.argv[1], sys.argv[1] + '.aside')\n"
                    "os.symlink(sys.argv[2], sys.argv[1])", str(state), str(prod_state))  # fmt: skip

    monkeypatch.setitem(interrupts.HOOKS, "after-journal", once(swap))
    code, err = forked("revert", "moe", "--sglang", str(site))
    monkeypatch.delitem(interrupts.HOOKS, "after-journal")
    assert code in (1, 75) and one_line(err), err
    assert "was replaced while sm120patch" in err, err
    assert digest(prod) == prod_before  # not a manifest, not a copy, not a mode
    code, out, err = cli("status", "--sglang", str(prod), "--json")
    assert code == 0 and json.loads(out)["targets"][0]["state"] == "applied", err
    held = site / ".sm120patch.aside" / "sglang"
    assert (held / "journal.json").is_file() and (held / "manifest.json").is_file()


# ---- 4. a link in the path the user names -------------------------------------------------------
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_link_in_the_named_path_is_refused_naming_where_it_points(
    kind, attacker, shared
):
    """`--sglang /home/u/venvA/...` where `venvA` is the user's link to root's production
    environment: refused in one line naming the link and its target (the real path in the
    hint); production gets no byte and no state directory."""
    prod = make_tree(shared / "opt" / "prod", kind, "0.5.8", "installed")
    home = attacker.give(shared / "home")
    attacker.symlink(prod.parent, home / "venvA")
    named = home / "venvA" / prod.name
    before = digest(prod)
    # No profile of the library writes vLLM with SGLang's moe: `status` is where --vllm is read.
    args = (["apply", "moe", "--no-gpu-check"] if kind == "sglang" else ["status"])
    code, _, err = cli(*args, f"--{kind}", str(named))
    assert code in (1, 2) and one_line(err), err
    assert f"{home / 'venvA'} is a symbolic link (to {prod.parent})" in err, err
    assert f"--{kind} {prod}" in err, err  # the real path, to name instead
    assert digest(prod) == before and not (prod / ".sm120patch").exists()


def test_a_relative_named_path_with_dotdot_still_works(tmp_path, monkeypatch):
    """Relative paths are made absolute from the working directory, `..` taken lexically."""
    site = make_tree(tmp_path / "envs", "sglang", "0.5.8", "installed")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    code, out, err = cli("status", "--sglang", f"../envs/{site.name}", "--json")
    assert code == 0, err
    assert json.loads(out)["targets"][0]["root"] == str(site)
