"""Concurrent runs: one sm120patch run per target at a time, through an OS
lock that a killed holder releases with its process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from killing import cli
from trees import git, make_tree, tree_hash

LOCKED = "another sm120patch run holds the lock on"
# `python -m sm120patch ARGS` once the file argv[1] appears: started and imported first, then
# all at once, so that the runs overlap however slowly the processes start.
AT_ONCE = textwrap.dedent(
    """
    import os, sys, time
    from sm120patch.cli import main
    open(f"{sys.argv[1]}.{os.getpid()}", "w").close()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.001)
    main(sys.argv[2:], prog_name="sm120patch")
    """
)


@pytest.mark.parametrize("layout", ["git", "installed"])
def test_four_simultaneous_applies_one_wins(layout, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", layout)
    args = ["apply", "all", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check"]
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AT_ONCE, str(go), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.*"))) < 4:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    results = [(p.wait(), *p.communicate()) for p in procs]
    # One run applies. Each other run either met the lock (exit 1, the lock's line) or, where
    # the winner was done before it started (an apply on small fixture files is that quick),
    # found the profile applied from the bytes and changed nothing (exit 0).
    won = [r for r in results if r[0] == 0 and "applied all;" in r[1]]
    later = [r for r in results if r[0] == 0 and "applied all;" not in r[1]]
    lost = [r for r in results if r[0] != 0]
    assert len(won) == 1, results
    for _, out, _ in later:
        assert "profile all is already applied" in out, out
    assert len(later) + len(lost) == 3
    for code, _, err in lost:
        assert code == 1, err
        assert err.startswith(f"sm120patch: {LOCKED} ") and "Traceback" not in err, err
    # Fully patched, once.
    code, out, _ = cli("status", "--sglang", str(sg), "--flashinfer", str(fi), "--json")
    doc = json.loads(out)
    assert [t["unfinished"] for t in doc["targets"]] == [None, None]
    assert {f["state"] for t in doc["targets"] for f in t["files"]} == {"patched"}
    if layout == "git":
        log = git(sg, "log", "--format=%s", "main..sm120patch/all").splitlines()
        # One commit per applied SGLang patch, not four times that.
        applied = re.findall(r"^\s*applied\s+(sglang\.\S+)", won[0][1] + won[0][2], re.M)
        assert len(applied) >= 4 and len(log) == len(applied) == len(set(log)), (applied, log)
        assert git(fi, "rev-list", "--count", "main..sm120patch/all").strip() == "1"


HOLDER = textwrap.dedent(
    """
    import sys, time
    from sm120patch.engine import store
    from sm120patch import targets
    from sm120patch.targets import finding
    t = finding.find("sglang", sys.argv[1])
    with store.TargetState(store.state_dir_for(t.root, t.layout, t.kind), t.root).locked():
        print("held", flush=True)
        time.sleep(120)
    """
)


@pytest.mark.parametrize("layout", ["git", "installed"])
def test_lock_of_a_killed_holder_is_taken_over(layout, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    before = tree_hash(sg)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(sg)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, _, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
        assert code == 1 and LOCKED in err, err
        assert tree_hash(sg) == before
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    # The lock file is still there; the dead holder's OS lock is not.
    from sm120patch.engine import store
    from sm120patch.targets import finding

    t = finding.find("sglang", sg)
    assert (store.state_dir_for(t.root, t.layout, t.kind) / "lock").exists()
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    assert cli("revert", "moe", "--sglang", str(sg))[0] == 0
    assert tree_hash(sg) == before
