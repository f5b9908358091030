"""Signals and kills: SIGINT/SIGTERM/SIGHUP during apply, revert and recover,
git children out of reach of the terminal's Ctrl-C, and stale git locks that `recover` removes
once it can show that nobody holds them.

Every run here is a real `python -m sm120patch` process, signalled either by itself at a named
step (`SM120PATCH_SIGNAL_AT`, deterministic) or from outside with `os.killpg` at a moment of
the run, as a terminal's Ctrl-C does to its foreground process group. After each, `status`
and `recover` must agree with the bytes of the trees.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from killing import KILL_ENV, States, cli, command, fail_writes, popen, run
from test_reliability_kill import (
    apply_args,
    assert_settled,
    learn,
    revert_args,
    targets_of,
    timed_run,
    trees,  # noqa: F401  (the fixture: both layouts)
)
from trees import make_tree

from sm120patch.engine import interrupts
from sm120patch.targets import git, procscan

SIGNAL_ENV = interrupts.SIGNAL_ENV


def signalled(args: list[str], spec: str) -> subprocess.CompletedProcess[str]:
    """sm120patch signalling itself at a step (`STEP[:N][=SIG[xK]]`)."""
    return run(*args, env={SIGNAL_ENV: spec})


def nothing_to_recover(sg, fi) -> None:
    code, out, err = cli("recover", *targets_of(sg, fi))
    assert code == 0 and "nothing to recover" in out, (code, out, err)


def moments(steps: list[str], layout: str) -> list[str]:
    """Several moments of a run, first to last, the git ones on a checkout."""

    def first(name: str) -> list[str]:
        return [s for s in steps if s.startswith(name + ":")][:1]

    writes = [s for s in steps if s.startswith("after-write:")]
    picked = first("after-journal") + writes[len(writes) // 2 : len(writes) // 2 + 1]
    if layout == "git":
        picked += first("after-objects") + first("after-branch") + first("during-switch")
    picked += [s for s in steps if s.startswith("after-manifest:")][-1:] + first("after-close")
    return [s for s in steps if s in picked]


def test_sigint_at_moments_of_apply(trees, tmp_path):  # noqa: F811
    """Before the commit point the apply rolls back (exit 130, pristine); after it, the apply
    has completed and stays (exit 130, saying so). No journal either way."""
    layout, sg, fi = trees
    states, steps, _ = learn(tmp_path, sg, fi)
    committed = steps.index([s for s in steps if s.startswith("after-manifest:")][-1])
    for step in moments(steps, layout):
        proc = signalled(apply_args(sg, fi), step)
        assert proc.returncode == 130, (step, proc.stderr)
        assert "Traceback" not in proc.stderr and "failed too" not in proc.stderr, proc.stderr
        if steps.index(step) > committed:
            assert "had completed: it stays applied" in proc.stderr, proc.stderr
            assert_settled(sg, fi, "patched", states)
            nothing_to_recover(sg, fi)
            assert cli(*revert_args(sg, fi))[0] == 0
        else:
            assert "was rolled back; nothing was changed" in proc.stderr, (step, proc.stderr)
            assert_settled(sg, fi, "pristine", states)
            nothing_to_recover(sg, fi)
    # The tool works on from there.
    assert cli(*apply_args(sg, fi))[0] == 0
    assert_settled(sg, fi, "patched", states)


def test_sigint_at_moments_of_revert(trees, tmp_path):  # noqa: F811
    """A revert is finished, never cut short: exit 130, pristine, no journal."""
    layout, sg, fi = trees
    states, _, steps = learn(tmp_path, sg, fi)
    for step in moments(steps, layout) + ["after-journal:2"]:
        assert cli(*apply_args(sg, fi))[0] == 0
        proc = signalled(revert_args(sg, fi), step)
        assert proc.returncode == 130, (step, proc.stderr)
        assert "the revert was finished first" in proc.stderr, proc.stderr
        assert_settled(sg, fi, "pristine", states)
        nothing_to_recover(sg, fi)


@pytest.mark.parametrize(
    ("layout", "spec"), [("git", "INTx3"), ("installed", "TERMx2"), ("git", "HUP")]
)
def test_repeated_and_other_signals_cut_nothing_short(tmp_path, layout, spec):
    """A second (and third) Ctrl-C, SIGTERM, a closed terminal: the same clean end."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", layout)
    states = States([sg, fi])
    proc = signalled(apply_args(sg, fi), f"after-write:1={spec}")
    assert proc.returncode == 130, proc.stderr
    name = "SIG" + spec.split("x")[0]
    assert f"interrupted ({name}): the apply of all was rolled back" in proc.stderr
    if "x" in spec:
        assert f"{name} again: still finishing safely" in proc.stderr
    assert_settled(sg, fi, "pristine", states)
    nothing_to_recover(sg, fi)


def test_sigint_during_recover_finishes_it(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    states = States([sg, fi])
    assert run(*apply_args(sg, fi), env={KILL_ENV: "after-write:1"}).returncode == -9
    proc = signalled(["recover", *targets_of(sg, fi)], "during-switch:1=INTx2")
    assert proc.returncode == 130, proc.stderr
    assert "the recover was finished first" in proc.stderr
    assert_settled(sg, fi, "pristine", states)


def sigint_after(args: list[str], delay: float, times: int) -> subprocess.CompletedProcess[str]:
    """Start sm120patch in a process group of its own and, after `delay` seconds, send SIGINT
    to that whole group `times` times (30 ms apart), as a terminal's Ctrl-C does."""
    proc = popen(args, session=True)
    time.sleep(delay)
    for _ in range(times):
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.03)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(command(*args), proc.returncode or 0, out, err)


def test_sigint_to_the_whole_group_at_real_moments(trees, tmp_path):  # noqa: F811
    """Ctrl-C at moments of real runs, git children in the group's reach: every run ends with
    the trees pristine or fully applied and no journal; status and recover agree. (Before
    as once seen: "rolling back ... failed too ([Errno 32] Broken pipe)", exit 1, both targets
    unfinished: the Ctrl-C had killed GitPython's git cat-file.)"""
    layout, sg, fi = trees
    states, _, _ = learn(tmp_path, sg, fi)
    rng = random.Random(int(os.environ.get("SEED", "4")))
    windows = {"apply": timed_run(apply_args(sg, fi), tmp_path)}
    states.learn_patched()
    windows["revert"] = timed_run(revert_args(sg, fi), tmp_path)
    current = "pristine"
    for i in range(4):
        op = "apply" if current == "pristine" else "revert"
        first, last, _ = windows[op]
        args = apply_args(sg, fi) if op == "apply" else revert_args(sg, fi)
        proc = sigint_after(args, rng.uniform(first * 0.9, last), times=1 + i % 2)
        # 0: the run had ended; -SIGINT: the signal came as it exited, after everything.
        assert proc.returncode in (0, 130, -signal.SIGINT), (op, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "failed too" not in proc.stderr, proc.stderr
        current = states.now()
        assert current in ("pristine", "patched"), (op, current, proc.stderr)
        # Once its first journal is written a revert is finished; a Ctrl-C before that (or
        # an apply's before its own journal) stops it with nothing changed.
        if "the revert was finished first" in proc.stderr or "rolled back" in proc.stderr:
            assert current == "pristine", proc.stderr
        if "had completed" in proc.stderr:
            assert current == "patched", proc.stderr
        assert_settled(sg, fi, current, states)
        nothing_to_recover(sg, fi)


def test_a_failing_rollback_after_sigint_keeps_its_journal_and_exits_75(tmp_path, monkeypatch):
    """When the rollback itself cannot finish (a full disk), the run says `recover`, exit 75,
    and `recover` finishes once the cause is gone."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    states = States([sg, fi])
    comm = fi / "flashinfer/jit/comm.py"
    pristine = comm.read_bytes()

    def full_on_rollback(path, data):
        if path == comm and data == pristine:  # the restore, not the patch nor a copy
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with monkeypatch.context() as mp:
        fail_writes(mp, full_on_rollback)
        # In this process: the hook signals this process only, and the engine defers it.
        mp.setenv(SIGNAL_ENV, "after-write:3")  # the last write: FlashInfer's comm.py
        mp.setattr("sm120patch.engine.interrupts._passed", {})  # count the steps of this run only
        code, _, err = cli(*apply_args(sg, fi))
    assert code == interrupts.EXIT_UNFINISHED == 75, err
    assert "interrupted (SIGINT), and the apply of all could not finish" in err, err
    assert "its journal is kept" in err and "sm120patch recover" in err, err
    code, out, _ = cli("status", *targets_of(sg, fi), "--json")
    assert "apply" in [t["unfinished"] for t in json.loads(out)["targets"]]
    code, out, err = cli("recover", *targets_of(sg, fi))
    assert code == 0, err
    assert_settled(sg, fi, "pristine", states)


# ---- stale git locks ---------------------------------------------------------------------


def killed_apply_with_a_lock(tmp_path) -> tuple[Path, Path, States, Path]:
    """An apply killed with git: its journal open and .git/index.lock left, as git's lockfile
    code leaves it when SIGKILLed (an empty file nobody holds)."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    states = States([sg, fi])
    assert run(*apply_args(sg, fi), env={KILL_ENV: "after-write:1"}).returncode == -9
    lock = sg / ".git" / "index.lock"
    lock.write_bytes(b"")
    return sg, fi, states, lock


def test_recover_removes_a_stale_index_lock_and_finishes(tmp_path):
    sg, fi, states, lock = killed_apply_with_a_lock(tmp_path)
    journal = json.loads((sg / ".git/sm120patch/sglang/journal.json").read_text())
    # The journal names its run well enough to tell it from a process that reuses its pid.
    assert int(journal["pid_start"]) > 0 and journal["boot_id"] == procscan.boot_id()
    assert procscan.alive(journal["pid"], journal["pid_start"], journal["boot_id"]) is False
    code, out, err = cli("recover", *targets_of(sg, fi))
    assert code == 0, err
    assert f"removed {lock}, left by a killed git" in out
    assert not lock.exists()
    assert_settled(sg, fi, "pristine", states)
    assert cli(*apply_args(sg, fi))[0] == 0 and cli(*revert_args(sg, fi))[0] == 0
    assert states.now() == "pristine"


def test_recover_refuses_while_a_git_process_works_there(tmp_path, monkeypatch):
    """A live git in the repository (not a child of ours): recover waits, then refuses (exit
    75, the journal kept) naming it; once it has ended, recover removes the lock and finishes."""
    sg, fi, states, lock = killed_apply_with_a_lock(tmp_path)
    fifo = tmp_path / "stdin"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # the git below reads until this closes
    # setsid -f: git is reparented away from us, so recover cannot count it as its own child.
    subprocess.run(
        [
            "setsid",
            "-f",
            "sh",
            "-c",
            'cd "$1" && exec git cat-file --batch < "$2"',
            "-",
            str(sg),
            str(fifo),
        ],
        check=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not (holders := procscan.users_of([sg / ".git"], sg)):
            assert time.monotonic() < deadline, "the git process did not start"
            time.sleep(0.02)
        monkeypatch.setattr(git, "SETTLE_WAIT_S", 0.3)
        code, _, err = cli("recover", *targets_of(sg, fi))
        assert code == 75, err
        assert "a git command is still running in" in err and "(index.lock is there)" in err
        assert f"pid {holders[0].process.pid} (git) works in {sg}" in err, err
        assert lock.exists()
        assert (sg / ".git/sm120patch/sglang/journal.json").exists()
    finally:
        os.close(writer)
    deadline = time.monotonic() + 10
    while procscan.users_of([sg / ".git"], sg):
        assert time.monotonic() < deadline, "the git process did not end"
        time.sleep(0.02)
    code, out, err = cli("recover", *targets_of(sg, fi))
    assert code == 0, err
    assert not lock.exists()
    assert_settled(sg, fi, "pristine", states)


def test_procscan_tells_a_live_run_from_a_reused_pid_and_a_zombie():
    me = procscan.identity()
    pid, start, boot = me["pid"], me["pid_start"], me["boot_id"]
    assert procscan.alive(pid, start, boot) is True
    assert procscan.alive(pid, str(int(start) + 1), boot) is False  # the pid reused
    assert procscan.alive(pid, start, "another-boot") is False
    assert procscan.alive(pid, None, boot) is None  # a 0.1.0 journal: cannot tell
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while (found := procscan._stat(child.pid)) is not None and found.state != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert found is not None and found.dead  # exited, not reaped yet: dead all the same
        assert procscan.alive(child.pid, str(found.start), boot) is False
    finally:
        child.wait()
    assert procscan.alive(child.pid, str(found.start), boot) is False


# ---- git children ------------------------------------------------------------------------


def test_git_children_run_in_sessions_of_their_own(tmp_path):
    """Every git command (`targets.run_git`, the one runner) starts in a session of its own,
    so the terminal's Ctrl-C (or SIGHUP) never reaches it; and nothing of git outlives it."""
    from sm120patch import targets

    root = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    sid = f"alias.sid=!{sys.executable} -c 'import os; print(os.getsid(0))'"
    proc = targets.run_git(root, "-c", sid, "sid")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) != os.getsid(0)
    repo = git.Repo(root)
    assert repo.head()[1] == repo._read("rev-parse", "rev-parse", "HEAD")
