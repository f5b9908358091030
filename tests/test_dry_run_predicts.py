"""A dry run refuses wherever its command would, permissions and the state's lock included:
a state directory that is a symbolic link, a lock file this user cannot open, a state
directory that cannot be made, a package directory the revert cannot write back into.

The tests run as root, who may write anywhere; `chattr +i` (immutable) makes a file or a
directory unwritable for root too, as a read-only tree is for any other user. They skip where
the file system or the container does not allow it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_states import cli, error_lines, everything, pair, where  # noqa: F401
from trees import make_tree

from sm120patch.engine import store
from sm120patch.targets import finding


def state_of(root: Path, kind: str = "sglang") -> Path:
    t = finding.find(kind, root)
    return store.state_dir_for(t.root, t.layout, kind)


@pytest.fixture
def immutable(tmp_path) -> Iterator:
    """`immutable(path)` makes path unwritable, for root too, until the test ends."""
    made: list[Path] = []
    probe = tmp_path / "chattr-probe"
    probe.mkdir()
    if (
        shutil.which("chattr") is None
        or subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode
    ):
        pytest.skip("chattr +i is not available here (needs root on ext4 or a like file system)")
    subprocess.run(["chattr", "-i", str(probe)], check=True)

    def make(path: Path) -> None:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        made.append(path)

    yield make
    for path in reversed(made):
        subprocess.run(["chattr", "-i", str(path)], check=True)


def assert_same_refusal(dry, real, *, exact: bool = True) -> None:
    assert dry[0] == real[0] == 1, (dry, real)
    ours, theirs = error_lines(dry[2]), error_lines(real[2])
    assert ours, dry
    if exact:
        assert ours == theirs, (ours, theirs)
    else:  # the reason in parentheses is the OS's (EACCES predicted, EPERM met on chattr +i)
        assert [line.split(" (")[0] for line in ours] == [line.split(" (")[0] for line in theirs]


def test_apply_dry_run_refuses_a_symlinked_state_directory(pair, tmp_path):  # noqa: F811
    layout, sg, fi = pair
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = state_of(sg)
    state.parent.mkdir(parents=True, exist_ok=True)
    state.symlink_to(elsewhere, target_is_directory=True)
    before = everything(tmp_path)
    dry = cli("apply", "moe", "--sglang", str(sg), "--dry-run")
    assert everything(tmp_path) == before
    assert dry[1] == ""  # no diff for an apply that would refuse
    real = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert_same_refusal(dry, real)
    assert "symbolic link" in error_lines(dry[2])[0]


def test_revert_dry_run_refuses_a_symlinked_state_directory(pair, tmp_path):  # noqa: F811
    layout, sg, fi = pair
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    state = state_of(sg)
    moved = tmp_path / "moved-state"
    shutil.move(state, moved)
    state.symlink_to(moved, target_is_directory=True)
    before = everything(tmp_path)
    dry = cli("revert", "moe", "--sglang", str(sg), "--dry-run")
    assert everything(tmp_path) == before and dry[1] == ""
    real = cli("revert", "moe", "--sglang", str(sg))
    assert_same_refusal(dry, real)


def test_revert_dry_run_refuses_a_lock_this_user_cannot_open(immutable, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    immutable(state_of(sg) / "lock")
    dry = cli("revert", "moe", "--sglang", str(sg), "--dry-run")
    real = cli("revert", "moe", "--sglang", str(sg))
    assert_same_refusal(dry, real)
    assert "cannot open the lock" in error_lines(dry[2])[0]


def test_revert_dry_run_refuses_a_package_it_cannot_write_back_into(immutable, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    immutable(sg / "sglang" / "srt")  # server_args.py's directory; the state stays writable
    dry = cli("revert", "moe", "--sglang", str(sg), "--dry-run")
    real = cli("revert", "moe", "--sglang", str(sg))
    assert_same_refusal(dry, real)
    assert "cannot write in" in error_lines(dry[2])[0]
    assert not (state_of(sg) / "journal.json").exists()  # refused before the journal


def test_apply_dry_run_notes_a_state_directory_it_cannot_make(immutable, tmp_path):
    """A dry run needs only read access: what only keeps the apply from writing is a note,
    in the apply's words, and the diff is printed."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    immutable(sg)  # the site-packages: no .sm120patch can be made in it
    dry = cli("apply", "moe", "--sglang", str(sg), "--dry-run")
    assert dry[0] == 0 and "+++ b/sglang/srt/server_args.py" in dry[1], dry
    real = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert real[0] == 1
    refusal = error_lines(real[2])[0].split(" (")[0].removeprefix("sm120patch: ")
    assert refusal.startswith("cannot create sm120patch's state directory"), real
    assert f"the apply would refuse: {refusal}" in dry[2], dry
