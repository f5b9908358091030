"""Kill anywhere: SIGKILL sm120patch at every step boundary of apply, revert
and recover, on both layouts, then `recover`: the trees are byte-identical to pristine or to
fully patched (an interrupted revert always ends pristine), and the tool works on from there.

The boundaries are not listed here by hand: an uninterrupted run traces every kill point it
passes (`SM120PATCH_TRACE_STEPS`), and the test kills at each of them in turn. A slower test
kills at random moments instead (`-m slow`; a few random kills run by default), killing the
whole process group, or everything below sm120patch with git: `recover`
alone must settle each, a git lock left behind included.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from killing import KILL_ENV, TRACE_ENV, States, cli, kill_after, popen, run, steps_of
from trees import make_tree

LAYOUTS = ["git", "installed"]
# The boundaries of a run; each must be among the traced ones of its run.
APPLY_STEPS = {"after-journal", "after-write", "before-manifest", "after-manifest", "after-close"}
# A checkout's apply builds its commits in git's object database, moves the patch branch once,
# then checks it out once: three boundaries per target, whatever the number of patches.
GIT_APPLY_STEPS = {"after-objects", "after-branch"}
REVERT_STEPS = {"after-journal", "before-manifest", "after-manifest", "after-close"}
GIT_REVERT_STEPS = {"during-switch", "after-switch"}


@pytest.fixture(params=LAYOUTS)
def trees(request, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", request.param)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", request.param)
    return request.param, sg, fi


def targets_of(sg, fi) -> list[str]:
    return ["--sglang", str(sg), "--flashinfer", str(fi)]


def apply_args(sg, fi) -> list[str]:
    return ["apply", "all", *targets_of(sg, fi), "--no-gpu-check"]


def revert_args(sg, fi) -> list[str]:
    return ["revert", "--all", *targets_of(sg, fi)]


def learn(tmp_path, sg, fi) -> tuple[States, list[str], list[str]]:
    """Pristine and patched states, and the steps of one apply and one revert."""
    states = States([sg, fi])
    apply_steps = steps_of(tmp_path, *apply_args(sg, fi))
    states.learn_patched()
    revert_steps = steps_of(tmp_path, *revert_args(sg, fi))
    assert states.now() == "pristine"
    return states, apply_steps, revert_steps


def names(steps: list[str]) -> set[str]:
    return {s.split(":")[0] for s in steps}


def assert_settled(sg, fi, expected: str, states: States) -> None:
    """No journal left, status agrees with the bytes, and the state is the expected one."""
    assert states.now() == expected
    code, out, err = cli("status", *targets_of(sg, fi), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [t["unfinished"] for t in doc["targets"]] == [None, None]
    if expected == "pristine":
        assert [t["profile"] for t in doc["targets"]] == [None, None]
    else:
        assert {f["state"] for t in doc["targets"] for f in t["files"]} == {"patched"}


def kill_then_recover(args: list[str], step: str, sg, fi, killed: States | None = None) -> None:
    """Kill the run at `step`, then recover; with `killed`, the trees are pristine already
    before recover."""
    proc = run(*args, env={KILL_ENV: step})
    assert proc.returncode == -9, f"{step}: not killed ({proc.returncode}): {proc.stderr}"
    if killed is not None:
        assert killed.now() == "pristine", f"{step}: changed before recover"
    code, out, err = cli("status", *targets_of(sg, fi), "--json")
    assert code == 0, err
    if any(t["unfinished"] for t in json.loads(out)["targets"]):
        # Every writing command refuses until recover has run.
        for again in (apply_args(sg, fi), revert_args(sg, fi)):
            code, _, err = cli(*again)
            assert code == 1 and "sm120patch recover" in err, (step, err)
    code, out, err = cli("recover", *targets_of(sg, fi))
    assert code == 0, f"{step}: {err}"
    assert "Traceback" not in err


def test_kill_at_every_step_of_apply_then_recover(trees, tmp_path):
    layout, sg, fi = trees
    states, steps, _ = learn(tmp_path, sg, fi)
    assert APPLY_STEPS | (GIT_APPLY_STEPS if layout == "git" else set()) <= names(steps)
    if layout == "git":
        # One ref move and one checkout per target, not one commit per patch.
        for once in ("after-objects", "after-branch", "after-write"):
            assert [s for s in steps if s.startswith(once + ":")] == [f"{once}:1", f"{once}:2"]
        before_any_move = ["after-journal:1", "after-journal:2", "after-objects:1"]
        assert steps[: steps.index("after-branch:1")] == before_any_move
    # The apply is committed once the last manifest is written; before that, recover rolls
    # it back, from there on it keeps it.
    committed = steps.index(max(s for s in steps if s.startswith("after-manifest:")))
    # On a checkout nothing changes before the first patch branch moves (HEAD, refs and work
    # tree included): a kill there leaves nothing to undo.
    untouched = steps.index("after-branch:1") if layout == "git" else 0
    for i, step in enumerate(steps):
        kill_then_recover(apply_args(sg, fi), step, sg, fi, states if i < untouched else None)
        expected = "patched" if i >= committed else "pristine"
        assert states.now() == expected, step
        assert_settled(sg, fi, expected, states)
        # The tool works on from there (from a pristine tree, the next kill's run goes on).
        if expected == "patched":
            assert cli(*revert_args(sg, fi))[0] == 0, step
            assert states.now() == "pristine", step
    assert cli(*apply_args(sg, fi))[0] == 0
    assert cli(*revert_args(sg, fi))[0] == 0
    assert states.now() == "pristine"


def test_kill_at_every_step_of_revert_then_recover(trees, tmp_path):
    layout, sg, fi = trees
    states, _, steps = learn(tmp_path, sg, fi)
    assert REVERT_STEPS | (GIT_REVERT_STEPS if layout == "git" else {"after-write"}) <= names(steps)
    for step in steps:
        code, _, err = cli(*apply_args(sg, fi))
        assert code == 0, err
        kill_then_recover(revert_args(sg, fi), step, sg, fi)
        # A revert is decided once its first journal is written: recover finishes it.
        assert_settled(sg, fi, "pristine", states)


@pytest.mark.parametrize(
    "op",
    ["apply", pytest.param("revert", marks=pytest.mark.slow)],
)
def test_kill_recover_itself_then_recover_again(trees, op, tmp_path):
    """recover is idempotent: killed at any of its own steps, a second recover finishes."""
    layout, sg, fi = trees
    states, apply_steps, _ = learn(tmp_path, sg, fi)
    last_write = [s for s in apply_steps if s.startswith("after-write:")][-1]
    for interrupted, step, setup in (
        (apply_args(sg, fi), last_write, None)
        if op == "apply"
        else (revert_args(sg, fi), "after-journal:2", apply_args(sg, fi)),
    ):
        if setup:
            assert cli(*setup)[0] == 0
        assert run(*interrupted, env={KILL_ENV: step}).returncode == -9
        recover_steps = steps_of(tmp_path, "recover", *targets_of(sg, fi))
        assert recover_steps, "recover passed no kill point"
        # Back to the interrupted state (one more time), then kill recover at each step.
        for rstep in recover_steps:
            if setup:
                assert cli(*setup)[0] == 0
            assert run(*interrupted, env={KILL_ENV: step}).returncode == -9
            proc = run("recover", *targets_of(sg, fi), env={KILL_ENV: rstep})
            assert proc.returncode == -9, rstep
            code, _, err = cli("recover", *targets_of(sg, fi))
            assert code == 0, f"{rstep}: {err}"
            assert_settled(sg, fi, "pristine", states)


def test_revert_killed_before_its_second_journal_rolls_forward_both(trees, tmp_path):
    """The first journal decides the revert: recover journals and reverts the other target."""
    _, sg, fi = trees
    states = States([sg, fi])
    assert cli(*apply_args(sg, fi))[0] == 0
    assert run(*revert_args(sg, fi), env={KILL_ENV: "after-journal:1"}).returncode == -9
    # Both named (a journal's peer is written only when named): recover finishes both.
    code, out, err = cli("recover", "--sglang", str(sg), "--flashinfer", str(fi))
    assert code == 0, err
    assert_settled(sg, fi, "pristine", states)


def random_kills(
    sg, fi, layout: str, kills: int, seed: int, tmp: Path, hows: tuple[str, ...] = ("process",)
) -> dict[str, int]:
    """Alternate applies and reverts, each SIGKILLed after a random delay (killed as
    `hows` says, in turn: killing.KILLS), then `recover` alone and check the invariant, until
    `kills` runs were killed. Returns how the runs ended."""
    rng = random.Random(seed)
    states = States([sg, fi])
    # When a run passes its first and its last kill point, and when it ends: three kills in
    # four land between the first and the last kill point (timed from the moment the killed run
    # itself traces its first one: a busy machine slows runs down), the others anywhere in its
    # life.
    windows = {}
    trace = tmp / "kill-trace.txt"
    for op, args in (("apply", apply_args(sg, fi)), ("revert", revert_args(sg, fi))):
        windows[op] = timed_run(args, tmp)
        if op == "apply":
            states.learn_patched()
    tally = {
        "kills": 0,
        "ran-to-the-end": 0,
        "journal-left": 0,
        "git-lock-removed": 0,
        "pristine": 0,
        "patched": 0,
    }
    tally |= {"apply-killed": 0, "revert-killed": 0}
    current = "pristine"
    for run_no in range(3 * kills):
        if tally["kills"] >= kills:
            break
        # Applies and reverts in turn: the tree is brought to where the run starts first.
        op = "apply" if run_no % 2 == 0 else "revert"
        if (op, current) in (("apply", "patched"), ("revert", "pristine")):
            setup = revert_args(sg, fi) if op == "apply" else apply_args(sg, fi)
            assert cli(*setup)[0] == 0
        args = apply_args(sg, fi) if op == "apply" else revert_args(sg, fi)
        first, last, end = windows[op]
        how = hows[run_no % len(hows)]
        if rng.random() < 0.75:
            delay = rng.uniform(0.0, (last - first) * 1.05)
            rc, ran = kill_after(args, delay, how, after_trace=trace)
        else:
            delay = rng.uniform(0.0, end)
            rc, ran = kill_after(args, delay, how)
            if rc != -9 and ran < end:  # runs got faster than measured (a busy machine calmed)
                windows[op] = (first * ran / end, last * ran / end, ran)
        tally["kills" if rc == -9 else "ran-to-the-end"] += 1
        if rc == -9:
            tally[f"{op}-killed"] += 1
        code, out, err = cli("recover", *targets_of(sg, fi))
        assert code == 0, err
        if "nothing to recover" not in out:
            tally["journal-left"] += 1
        if "left by a killed git" in out:
            tally["git-lock-removed"] += 1
        current = states.now()
        assert current in ("pristine", "patched"), (layout, op, current)
        tally[current] += 1
        assert_settled(sg, fi, current, states)
    assert tally["kills"] >= kills
    if current == "patched":
        assert cli(*revert_args(sg, fi))[0] == 0
    assert cli(*apply_args(sg, fi))[0] == 0
    assert cli(*revert_args(sg, fi))[0] == 0
    assert states.now() == "pristine"
    return tally


def timed_run(args: list[str], tmp: Path) -> tuple[float, float, float]:
    """Seconds to the first kill point, to the last, and to the end of one uninterrupted run."""
    trace = tmp / "timing.txt"
    trace.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = popen(args, {**os.environ, TRACE_ENV: str(trace)})
    first = last = None
    size = 0
    while proc.poll() is None:
        now = trace.stat().st_size if trace.exists() else 0
        if now > size:
            size, last = now, time.monotonic() - t0
            first = first if first is not None else last
        time.sleep(0.002)
    end = time.monotonic() - t0
    assert proc.returncode == 0 and first is not None and last is not None
    return first, last, end


@pytest.mark.slow  # the every-step kill tests above reach each boundary these land between
def test_a_few_random_kills(trees, tmp_path):
    layout, sg, fi = trees
    tally = random_kills(sg, fi, layout, 3, int(os.environ.get("SEED", "6")), tmp_path)
    assert tally["kills"] == 3


def test_a_few_whole_group_random_kills(trees, tmp_path):
    """kill -9 of the whole process group, and of everything below sm120patch (git too)."""
    layout, sg, fi = trees
    seed = int(os.environ.get("SEED", "9"))
    tally = random_kills(sg, fi, layout, 3, seed, tmp_path, hows=("group", "tree"))
    assert tally["kills"] == 3


@pytest.mark.slow
def test_many_random_kills(trees, tmp_path, capsys):
    """At least 100 whole-group kills per layout (SM120PATCH_KILLS), in turn of the process
    group and of every process below sm120patch, git included; figures printed."""
    layout, sg, fi = trees
    t0 = time.monotonic()
    kills = int(os.environ.get("SM120PATCH_KILLS", "100"))
    seed = int(os.environ.get("SEED", "120"))
    tally = random_kills(sg, fi, layout, kills, seed, tmp_path, hows=("group", "tree"))
    with capsys.disabled():
        print(f"\nrandom kills on {layout}: {tally}, {time.monotonic() - t0:.0f}s")
