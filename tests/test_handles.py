"""A target is resolved once, into a handle, and every read and write of its files goes
through that handle (sm120patch/handle.py). The races a user who owns a tree can run against
root are driven by a hook between the check and the use (`interrupts.HOOKS`, honoured only
with the test switch on), as the attacker's inotify loop drove them.

- A swap ABOVE the tree (the user's venv exchanged for a link to another environment after
  root's pristine copy was taken): refused in one line, nothing written into the other tree,
  the user's tree unchanged and its journal finished by `recover` where it now is.
- A directory INSIDE the tree (`sglang/`, `sglang/srt/`) swapped for a link mid-apply.
- The read race: `sglang/srt/` or `server_args.py` swapped for a link between the check of a
  file's bytes and the pristine copy: the copy never holds the other file's bytes.

The same user plays the attacker here (no root needed): what matters is which directory root's
writes land in, and the kernel lets the owner of a tree do every swap below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from attackers import add_record, attacker_fixture, shared_fixture  # noqa: F401 (fixtures)
from killing import cli, run
from trees import make_tree, tree_hash

from sm120patch.engine import interrupts
from sm120patch.errors import Refused
from sm120patch.handle import TreeHandle, TreeMoved

SERVER_ARGS = "sglang/srt/server_args.py"


def one_line(err: str) -> bool:
    lines = err.strip("\n").split("\n")
    return (lines[0].startswith("sm120patch: ") and all(x.startswith("  ") for x in lines[1:])
            and "Traceback" not in err and "internal error" not in err)  # fmt: skip


def digest(root: Path) -> dict[str, str]:
    """Every entry under `root`, its state directory and `.git` included: a file by its
    sha256, mode and owner, a link by where it points (nothing followed)."""
    out = {}
    for top, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            path = Path(top, name)
            st = path.lstat()
            rel = path.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                data = hashlib.sha256(path.read_bytes()).hexdigest()
                out[rel] = f"{oct(st.st_mode)}:{st.st_uid}:{st.st_gid}:{data}"
    return out


def once(fn):
    """A hook that acts at its first passage only (a step may be passed once per file)."""
    done = []

    def hook():
        if not done:
            done.append(True)
            fn()

    return hook


def parent_of(root: Path, layout: str) -> Path:
    """The directory holding the package: patch paths are relative to it."""
    return root / "python" if layout == "git" else root


def status(root: Path) -> dict:
    code, out, err = cli("status", "--sglang", str(root), "--json")
    assert code == 0, err
    return json.loads(out)["targets"][0]


def exchanger(tmp: Path):
    """renameat2(RENAME_EXCHANGE): two names trade places in one step (the attacker's move);
    the test skips where the C library or the filesystem has none."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("no renameat2 in this C library")

    def exchange(a: Path, b: Path) -> None:
        if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2):  # AT_FDCWD, EXCHANGE
            raise OSError(ctypes.get_errno(), "renameat2(RENAME_EXCHANGE)", str(a))

    (tmp / "probe-a").mkdir()
    (tmp / "probe-b").mkdir()
    try:
        exchange(tmp / "probe-a", tmp / "probe-b")
    except OSError as exc:
        pytest.skip(f"renameat2(RENAME_EXCHANGE) is refused here ({exc.strerror})")
    return exchange


def forked(*args: str) -> tuple[int, str]:
    """sm120patch in a child of this process (fork: the hooks set here go with it), so that
    the run is over, as a real one would be, when `recover` looks at its journal's pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, exit without pytest's teardown
        try:
            os.close(r)
            code, _, err = cli(*args)
            os.write(w, json.dumps([code, err]).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    code, err = json.loads(data)
    return code, err


# ---- a swap above the tree -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "how", "verb"),
    [
        ("installed", "link", "apply"),
        ("installed", "link", "ensure"),
        ("installed", "exchange-link", "apply"),
        ("installed", "exchange-directory", "apply"),
        ("git", "link", "apply"),
        ("git", "exchange-directory", "apply"),
    ],
)
def test_a_venv_swapped_for_another_tree_after_the_copy_gets_nothing_written(
    layout, how, verb, tmp_path, monkeypatch
):
    """The user's venv is exchanged for (a link to) another environment once root's journal
    and pristine copies are written: the command refuses in one line, the other environment's
    bytes (its state and git included) are unchanged, the user's tree has its own bytes, and
    `recover` pointed where the hint says finishes its journal."""
    venv = tmp_path / "home" / "venv"
    root = make_tree(venv, "sglang", "0.5.8", layout)
    other_env = tmp_path / "rootenv"
    make_tree(other_env, "sglang", "0.5.8", layout)
    aside = tmp_path / "home" / "venv.aside"
    if how == "link":
        def swap():
            venv.rename(aside)
            venv.symlink_to(other_env)
    elif how == "exchange-link":
        exchange = exchanger(tmp_path)

        def swap():
            aside.symlink_to(other_env)
            exchange(venv, aside)  # venv is the link now, aside the user's directory
    else:
        aside = other_env  # the two directories trade places
        exchange = exchanger(tmp_path)

        def swap():
            exchange(venv, other_env)
    other_before = digest(other_env / root.name)
    before = tree_hash(root)
    monkeypatch.setitem(interrupts.HOOKS, "after-journal", once(swap))
    code, err = forked(verb, "moe", "--sglang", str(root), "--no-gpu-check")
    monkeypatch.delitem(interrupts.HOOKS, "after-journal")
    assert code == 1 and one_line(err), err
    assert "was replaced while sm120patch" in err and "nothing was written" in err, err
    other = (venv if how == "exchange-directory" else other_env) / root.name
    assert digest(other) == other_before  # not a byte, not a state file, not a ref
    mine = aside / root.name
    assert tree_hash(mine) == before, "the user's tree was left changed"
    assert str(mine) in err, err  # the hint says where the journal is now
    done = run("recover", "--sglang", str(mine))  # another process: the run is over
    assert done.returncode == 0, done.stderr
    assert status(mine)["unfinished"] is None and tree_hash(mine) == before
    assert digest(other) == other_before


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_a_swap_between_two_writes_is_rolled_back_through_the_handle(
    layout, tmp_path, monkeypatch
):
    """The venv is swapped once the first of several files is written: the next write is
    refused, the file already written is put back through the handle (installed) or stays on
    the patch branch for `recover` there (a checkout), and the other tree keeps every byte."""
    venv = tmp_path / "home" / "venv"
    root = make_tree(venv, "sglang", "0.5.8", layout)
    fi = make_tree(tmp_path / "fi", "flashinfer", "0.6.8", layout)
    other_env = tmp_path / "rootenv"
    make_tree(other_env, "sglang", "0.5.8", layout)
    other_before, before = digest(other_env / root.name), tree_hash(root)
    aside = tmp_path / "home" / "venv.aside"

    def swap():
        venv.rename(aside)
        venv.symlink_to(other_env)

    monkeypatch.setitem(interrupts.HOOKS, "after-write", once(swap))
    code, err = forked("apply", "all", "--sglang", str(root), "--flashinfer", str(fi),
                       "--no-gpu-check")  # fmt: skip
    monkeypatch.delitem(interrupts.HOOKS, "after-write")
    assert code == 1 and one_line(err) and "was replaced while sm120patch" in err, err
    assert digest(other_env / root.name) == other_before
    mine = aside / root.name
    if layout == "installed":
        assert "was put back" in err and tree_hash(mine) == before, err
    else:
        assert "stays on its patch branch" in err and tree_hash(mine) != before, err
    done = run("recover", "--sglang", str(mine), "--flashinfer", str(fi))
    assert done.returncode == 0, done.stderr
    assert tree_hash(mine) == before and status(mine)["unfinished"] is None


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_a_revert_whose_venv_is_swapped_after_its_journal_touches_nothing_else(
    layout, tmp_path, monkeypatch
):
    """Both trees applied; the user's venv is swapped for a link to the other once the
    revert's journal is written: the revert refuses in one line, the other tree (its
    manifest and copies included) keeps every byte, and `recover` where the user's tree is now
    finishes the revert there."""
    venv = tmp_path / "home" / "venv"
    root = make_tree(venv, "sglang", "0.5.8", layout)
    other_env = tmp_path / "rootenv"
    other = make_tree(other_env, "sglang", "0.5.8", layout)
    pristine = tree_hash(root)
    for tree in (root, other):
        assert cli("apply", "moe", "--sglang", str(tree), "--no-gpu-check")[0] == 0
    other_before = digest(other)
    aside = tmp_path / "home" / "venv.aside"

    def swap():
        venv.rename(aside)
        venv.symlink_to(other_env)

    monkeypatch.setitem(interrupts.HOOKS, "after-journal", once(swap))
    code, err = forked("revert", "moe", "--sglang", str(root))
    monkeypatch.delitem(interrupts.HOOKS, "after-journal")
    assert code == 1 and one_line(err) and "was replaced while sm120patch" in err, err
    assert digest(other) == other_before
    mine = aside / root.name
    done = run("recover", "--sglang", str(mine))
    assert done.returncode == 0, done.stderr
    assert tree_hash(mine) == pristine and status(mine)["state"] == "pristine"


# ---- a directory inside the tree -----------------------------------------------------------
@pytest.mark.parametrize("layout", ["installed", "git"])
@pytest.mark.parametrize("component", ["sglang", "sglang/srt"])
def test_a_directory_inside_the_tree_swapped_for_a_link_mid_apply(
    layout, component, tmp_path, monkeypatch
):
    """A group member exchanges `sglang/` (or `sglang/srt/`) with a link into another
    environment during the apply: the write is refused in one line (no link inside a target
    is followed), the other environment is unchanged, and once the directory is back the tree
    is as it was, with no journal left."""
    root = make_tree(tmp_path / "shared", "sglang", "0.5.8", layout)
    other_root = make_tree(tmp_path / "rootenv", "sglang", "0.5.8", layout)
    inner = parent_of(root, layout) / component
    moved = inner.with_name(inner.name + ".aside")
    other_before = digest(other_root)
    before = tree_hash(root)

    def swap():
        inner.rename(moved)
        inner.symlink_to(parent_of(other_root, layout) / component)

    monkeypatch.setitem(interrupts.HOOKS, "after-journal", once(swap))
    code, _, err = cli("apply", "moe", "--sglang", str(root), "--no-gpu-check")
    monkeypatch.delitem(interrupts.HOOKS, "after-journal")
    assert code == 1 and one_line(err), err
    assert f"{inner} is a symbolic link; sm120patch follows no link inside a target" in err, err
    assert digest(other_root) == other_before
    inner.unlink()
    moved.rename(inner)
    assert tree_hash(root) == before
    assert status(root)["unfinished"] is None and status(root)["state"] == "pristine"


# ---- the read race -------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["sglang/srt", SERVER_ARGS])
def test_the_pristine_copy_never_holds_a_file_swapped_in_after_the_check(
    what, tmp_path, monkeypatch
):
    """Between the check of server_args.py's bytes and the pristine copy, `sglang/srt/` (or
    the file itself) is swapped for a link to a private file of the same name elsewhere: the
    copy holds the bytes checked, never the private file's, and nothing of it is left in the
    state; the apply refuses in one line and the private file is unchanged."""
    site = make_tree(tmp_path / "shared", "sglang", "0.5.8", "installed")
    private = tmp_path / "private"
    (private / "srt").mkdir(parents=True)
    secret = private / "srt" / "server_args.py"
    secret.write_bytes(b"ROOT-ONLY SECRET\n")
    secret.chmod(0o600)
    checked = (site / SERVER_ARGS).read_bytes()
    here = site / what
    copy = site / ".sm120patch" / "sglang" / "pristine" / SERVER_ARGS
    copies: list[bytes] = []

    def swap():
        here.rename(here.with_name(here.name + ".aside"))
        here.symlink_to(secret if here.name.endswith(".py") else secret.parent)

    def look():
        if copy.exists() and not copies:
            copies.append(copy.read_bytes())

    monkeypatch.setitem(interrupts.HOOKS, "before-copy", once(swap))
    monkeypatch.setitem(interrupts.HOOKS, "after-copy", look)
    code, _, err = cli("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    monkeypatch.delitem(interrupts.HOOKS, "before-copy")
    monkeypatch.delitem(interrupts.HOOKS, "after-copy")
    assert copies == [checked], "the pristine copy is not the bytes checked"
    assert code == 1 and one_line(err), err
    for path in (site / ".sm120patch").rglob("*"):
        assert not path.is_file() or b"SECRET" not in path.read_bytes(), path
    assert secret.read_bytes() == b"ROOT-ONLY SECRET\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600


# ---- the handle itself ---------------------------------------------------------------------
def test_the_handle_refuses_a_link_on_its_path_and_sees_a_swap(tmp_path):
    real = tmp_path / "real"
    (real / "pkg").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(Refused, match="is a symbolic link; sm120patch opens a target"):
        TreeHandle(tmp_path / "link")
    handle = TreeHandle(real)
    assert handle.moved() is None
    real.rename(tmp_path / "aside")
    (tmp_path / "other").mkdir()
    (tmp_path / "other").rename(real)
    assert handle.moved() == f"{real} is another directory"
    with pytest.raises(TreeMoved, match="was replaced while sm120patch worked on it"):
        handle.verify()
    assert handle.where_now() == tmp_path / "aside"
    import copy
    import pickle

    with pytest.raises(TypeError, match="not copied"):
        pickle.dumps(handle)
    with pytest.raises(TypeError, match="not copied"):
        copy.deepcopy(handle)


def test_a_replace_keeps_mode_and_owner_and_never_follows_or_creates(tmp_path):
    root = tmp_path / "t"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    mod = root / "pkg" / "mod.py"
    mod.write_text("old\n")
    mod.chmod(0o4751)  # setuid and world-executable: the bits kept, less setuid
    (root / "pkg" / "__pycache__" / "mod.cpython-312.pyc").write_bytes(b"stale")
    (root / "pkg" / "__pycache__" / "other.cpython-312.pyc").write_bytes(b"kept")
    stale = root / "pkg" / ".mod.py.abcdef.sm120patch-tmp"
    stale.write_bytes(b"left by a kill")
    handle = TreeHandle(root)
    handle.replace("pkg/mod.py", b"new\n")
    handle.drop_pycache("pkg/mod.py")
    handle.remove_temps("pkg/mod.py")
    assert mod.read_bytes() == b"new\n" and stat.S_IMODE(mod.stat().st_mode) == 0o751
    assert sorted(p.name for p in (root / "pkg" / "__pycache__").iterdir()) == [
        "other.cpython-312.pyc"
    ]
    assert not stale.exists()
    with pytest.raises(Refused, match="sm120patch never creates a file in a target"):
        handle.replace("pkg/new.py", b"x")
    (root / "pkg" / "link.py").symlink_to(mod)
    with pytest.raises(Refused, match="not a regular file"):
        handle.replace("pkg/link.py", b"x")
    assert mod.read_bytes() == b"new\n"
    with pytest.raises(Refused, match="not a plain relative path"):
        handle.read("../t/pkg/mod.py")


# ---- the same, planted by another user (root runs sm120patch; skipped without root) --------
def test_roots_environment_gets_nothing_when_a_users_venv_is_swapped_for_a_link(
    attacker, shared, monkeypatch
):
    """As the attack was run: a user owns ~/venv, which root is asked to patch; once root's
    journal and pristine copy are written, the user's own process swaps ~/venv for a link to
    root's environment. Root refuses in one line; root's environment keeps every byte, mode
    and owner; the user's files keep their bytes and their owner."""
    home = attacker.give(shared / "home")
    venv = home / "venv"
    site = make_tree(venv, "sglang", "0.5.8", "installed")
    add_record(site, "sglang", "0.5.8")
    for path in [venv, *venv.rglob("*")]:
        os.lchown(path, attacker.uid, attacker.gid)
    theirs = make_tree(shared / "rootenv", "sglang", "0.5.8", "installed")
    add_record(theirs, "sglang", "0.5.8")
    root_before, before = digest(theirs), tree_hash(site)
    swap = ("import os, sys\nos.rename(sys.argv[1], sys.argv[1] + '.aside')\n"
            "os.symlink(sys.argv[2], sys.argv[1])")  # fmt: skip
    monkeypatch.setitem(
        interrupts.HOOKS, "after-journal",
        once(lambda: attacker.ok(swap, str(venv), str(shared / "rootenv"))),
    )  # fmt: skip
    code, err = forked("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    monkeypatch.delitem(interrupts.HOOKS, "after-journal")
    assert code == 1 and one_line(err) and "was replaced while sm120patch" in err, err
    assert digest(theirs) == root_before
    mine = home / "venv.aside" / site.name
    assert tree_hash(mine) == before
    assert {p.stat().st_uid for p in (mine / "sglang").rglob("*.py")} == {attacker.uid}


def test_a_group_member_swapping_sglang_for_a_link_gets_nothing_written(
    attacker, shared, monkeypatch
):
    """A group-writable site-packages that root owns: a member of the group exchanges
    `sglang/` for a link to another environment's during root's apply. Root refuses in one
    line and writes nothing there; once the member puts the directory back, the tree is as it
    was and no journal is left."""
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    add_record(site, "sglang", "0.5.8")
    for d in [site, *[p for p in site.rglob("*") if p.is_dir()]]:
        os.chown(d, 0, attacker.group_gid)
        d.chmod(0o2775)
    other = make_tree(shared / "rootenv", "sglang", "0.5.8", "installed")
    other_before, before = digest(other), tree_hash(site)
    swap = ("import os, sys\nos.rename(sys.argv[1], sys.argv[1] + '.aside')\n"
            "os.symlink(sys.argv[2], sys.argv[1])")  # fmt: skip
    monkeypatch.setitem(
        interrupts.HOOKS, "after-journal",
        once(lambda: attacker.ok(swap, str(site / "sglang"), str(other / "sglang"))),
    )  # fmt: skip
    code, err = forked("apply", "moe", "--sglang", str(site), "--no-gpu-check")
    monkeypatch.delitem(interrupts.HOOKS, "after-journal")
    assert code == 1 and one_line(err), err
    assert "sglang is a symbolic link; sm120patch follows no link inside a target" in err, err
    assert digest(other) == other_before
    attacker.ok("import os, sys\nos.unlink(sys.argv[1])\nos.rename(sys.argv[1] + '.aside', "
                "sys.argv[1])", str(site / "sglang"))  # fmt: skip
    assert tree_hash(site) == before
    assert status(site)["unfinished"] is None and status(site)["state"] == "pristine"
