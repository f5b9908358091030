"""Two services sharing a venv start at once: both `ensure` must start. The second waits for
the first's lock (bounded, `--lock-wait`, saying so on stderr), then decides from the bytes as
a second apply would: applied as wanted is nothing to do. `apply` still refuses at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from killing import HOOKED
from test_states import status_of
from trees import make_tree

# A real sm120patch process that stops inside its transaction, holding the lock, until the
# test removes `gate` (it says where it is by creating `inside`).
HOLDING = (
    "import os, sys, time\n"
    "import sm120patch.engine.interrupts as hooks\n"
    "inside, gate = sys.argv[1], sys.argv[2]\n"
    "def hold():\n"
    "    open(inside, 'w').close()\n"
    "    end = time.monotonic() + 30\n"
    "    while os.path.exists(gate) and time.monotonic() < end:\n"
    "        time.sleep(0.02)\n"
    "hooks.HOOKS['before-copy'] = hold\n"
    "sys.argv[1:3] = []\n" + HOOKED
)


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip


def _holding(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    inside, gate = tmp_path / "inside", tmp_path / "gate"
    gate.touch()
    first = _start(HOLDING, str(inside), str(gate), *args)
    end = time.monotonic() + 60
    while not inside.exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < end
        time.sleep(0.02)
    return first, gate


def test_two_ensures_at_once_both_start(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    ensure = ["ensure", "moe", "--sglang", str(sg), "--no-gpu-check"]
    first, gate = _holding(tmp_path, *ensure)
    second = _start(HOOKED, *ensure)
    # The second says it waits, on stderr, while the first still holds the lock.
    deadline = time.monotonic() + 60
    assert second.stderr is not None
    line = second.stderr.readline()
    assert "waiting for it" in line and "at most 120 s" in line, line
    assert second.poll() is None and time.monotonic() < deadline
    gate.unlink()
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert "already applied" in out2 + err2, out2 + err2
    assert status_of("--sglang", str(sg))["sglang"]["state"] == "applied"


def test_apply_still_refuses_at_once_and_the_wait_is_bounded(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    first, gate = _holding(tmp_path, "apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    try:
        apply = subprocess.run(
            [sys.executable, "-c", HOOKED, "apply", "moe", "--sglang", str(sg), "--no-gpu-check"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert apply.returncode == 1 and "holds the lock" in apply.stderr, apply.stderr
        assert "waiting" not in apply.stderr
        started = time.monotonic()
        short = subprocess.run(
            [sys.executable, "-c", HOOKED, "ensure", "moe", "--sglang", str(sg),
             "--no-gpu-check", "--lock-wait", "0.5"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert short.returncode == 1, short.stderr
        assert "waiting for it (at most 0.5 s)" in short.stderr, short.stderr
        assert "for all of the 0.5 s waited" in short.stderr, short.stderr
        assert time.monotonic() - started < 30
    finally:
        gate.unlink()
        first.communicate(timeout=60)
    assert first.returncode == 0
