"""Every interruption ends in one line that says the state: applied, rolled back, or unfinished
with the `recover` to run, also for a Ctrl-C that lands just outside the engine's critical
section (its handlers already given back); and a Ctrl-C handled right after a descriptor was
closed never closes it a second time (once: "internal error: OSError: [Errno 9] Bad file
descriptor", exit 4, on an interrupted apply)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from killing import HOOKED
from test_states import status_of
from trees import make_tree

from sm120patch import handle
from sm120patch.engine import interrupts

# sm120patch as a process of its own that receives a SIGINT right after a critical section
# ended (the default handler back): the moment the three "only 'interrupted'" applies met.
AFTER_SECTION = (
    "import os, signal\n"
    "import sm120patch.engine.interrupts as hooks\n"
    "real = hooks._end\n"
    "def end(*args, **kwargs):\n"
    "    real(*args, **kwargs)\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "hooks._end = end\n" + HOOKED
)


def test_ctrl_c_just_after_the_apply_says_it_stays_applied(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    proc = subprocess.run(
        [sys.executable, "-c", AFTER_SECTION, "apply", "moe", "--sglang", str(sg),
         "--no-gpu-check"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip().splitlines()
    said = [line for line in lines if line.startswith("sm120patch: ")]
    assert said == ["sm120patch: interrupted (SIGINT): the apply of moe had completed: it stays "
                    "applied"], proc.stderr  # fmt: skip
    assert f"  next: sm120patch revert moe --sglang {sg}" in lines, proc.stderr
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "applied"


def _ended(op: str, *, committed: bool = False, failed: bool = False, left: bool = False) -> None:
    section = interrupts.Section(op, "moe", abortable=op == "apply")
    section.committed, section.failed = committed, failed
    section.unfinished = lambda: left
    interrupts._last[:] = [section]


@pytest.mark.parametrize(
    "ended, state, hint",
    [
        ({"op": "apply", "committed": True}, "had completed: it stays applied", "revert moe"),
        ({"op": "apply", "failed": True}, "was rolled back: nothing was changed", ""),
        ({"op": "apply", "left": True}, "is unfinished: its journal is kept", "recover"),
        ({"op": "revert"}, "the revert of moe was finished first", "status"),
        ({"op": "revert", "left": True}, "is unfinished", "recover"),
    ],
)
def test_each_state_a_late_ctrl_c_can_find_is_said(ended, state, hint, monkeypatch):
    monkeypatch.setattr(interrupts, "_last", [])
    said, todo = interrupts.after_interrupt()
    assert said.endswith("nothing was changed") and todo == ""
    _ended(**ended)
    said, todo = interrupts.after_interrupt()
    assert state in said and hint in todo, (said, todo)


class _CtrlCAfterClose:
    """`os` for handle.py, whose close is followed by a Ctrl-C handled as soon as it returns
    (Python runs a signal handler between two bytecodes, here the close and what follows)."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def close(self, fd: int) -> None:
        os.close(fd)
        raise KeyboardInterrupt


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_a_ctrl_c_right_after_a_close_closes_nothing_twice(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c.py").write_text("x = 1\n")
    tree = handle.TreeHandle(tmp_path)
    before = _open_fds()
    monkeypatch.setattr(handle, "os", _CtrlCAfterClose())
    with pytest.raises(KeyboardInterrupt):  # not OSError: [Errno 9] Bad file descriptor
        tree.read("a/b/c.py")
    with pytest.raises(KeyboardInterrupt):
        tree.close()
    monkeypatch.undo()
    assert tree.fd == -1
    assert _open_fds() <= before, "a descriptor was left open"
    tree.close()  # already closed: nothing is closed a second time
