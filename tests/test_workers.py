"""Planning in forked workers (`plan.workers`): the same results as one process, whatever
happens to a worker, and no worker left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import libcst as cst
import pytest
from pytest_mock import MockerFixture

from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.model import Import, Patch, Result, already_applied, applied
from sm120patch.patchkit.runner import FileResult
from sm120patch.plan import workers

PARENT = os.getpid()
BIG = "import m\nfrom m import a\n\nx = 0\n" + "# padding\n" * (workers.MIN_CHARS // 10)


def edit(var: str, then: object = None) -> Patch:
    """`var = 0` to `var = 1`, requesting `from m import c` next to `a`; `then(module)` runs
    first (the ways a worker can go wrong)."""

    def transform(module: cst.Module) -> Result:
        if callable(then):
            then(module)
        [line] = [s for s in module.body if h.code(s) in (f"{var} = 0", f"{var} = 1")]
        need = Import("c", next_to="a", module="m")
        if h.code(line) == f"{var} = 1":
            return already_applied(var, "one").needing(need)
        new = module.deep_replace(line, cst.parse_statement(f"{var} = 1\n"))
        return applied(var, new, "one").needing(need)  # type: ignore[arg-type]

    return Patch(id=f"t.{var}", target="sglang", title="t", why="w", files=("f.py",),
                 marker=var, transform=transform)  # fmt: skip


def small(var: str) -> str:
    return f"from m import a\n{var} = 0\n"


def same(a: FileResult, b: FileResult) -> None:
    assert (a.file, a.before, a.after) == (b.file, b.before, b.after)
    assert a.outcomes == b.outcomes
    assert a.step_texts() == b.step_texts()
    assert a.imports_added() == b.imports_added()


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(workers.ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def jobs(*patches_and_texts: tuple[Patch, str]) -> list[workers.Job]:
    return [([p], f"f{i}.py", text) for i, (p, text) in enumerate(patches_and_texts)]


def test_a_worker_gives_what_this_process_gives(two_cpus: None, mocker: MockerFixture) -> None:
    work = jobs((edit("x"), BIG), (edit("y"), small("y")))
    fork = mocker.spy(os, "fork")
    got = workers.transform_all(work)
    assert fork.call_count == 1  # the big file went to a worker, the small one stayed here
    assert [type(r).__name__ for r in got] == ["TextFileResult", "FileResult"]
    alone = [workers.transform_text(*job) for job in work]
    for a, b in zip(got, alone, strict=True):
        same(a, b)
    assert got[0].imports_added() == {("m", "c")}
    assert got[0].after.startswith("import m\nfrom m import a, c\nx = 1\n# padding\n")


def test_a_worker_that_dies_is_done_again_here(two_cpus: None, mocker: MockerFixture) -> None:
    def die_in_a_worker(module: cst.Module) -> None:
        if os.getpid() != PARENT:
            os.kill(os.getpid(), signal.SIGKILL)

    work = jobs((edit("x", die_in_a_worker), BIG), (edit("y"), small("y")))
    fork = mocker.spy(os, "fork")
    got = workers.transform_all(work)
    assert fork.call_count == 1
    assert type(got[0]).__name__ == "FileResult"  # planned again in this process
    same(got[0], workers.transform_text(*work[0]))
    with pytest.raises(ChildProcessError):
        os.waitpid(fork.spy_return, os.WNOHANG)  # reaped: no zombie


def test_an_interrupt_leaves_no_worker_running(two_cpus: None, mocker: MockerFixture) -> None:
    def slow_in_a_worker(module: cst.Module) -> None:
        if os.getpid() != PARENT:
            time.sleep(120)

    def interrupted_here(module: cst.Module) -> None:
        if os.getpid() == PARENT:
            raise KeyboardInterrupt

    work = jobs((edit("x", slow_in_a_worker), BIG), (edit("y", interrupted_here), small("y")))
    fork = mocker.spy(os, "fork")
    with pytest.raises(KeyboardInterrupt):
        workers.transform_all(work)
    [pid] = [p for p in [fork.spy_return] if p]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left sleeping


@pytest.mark.parametrize("why", ["env", "one-cpu", "threads", "small", "alone"])
def test_no_worker_where_it_cannot_help(
    why: str, two_cpus: None, monkeypatch: pytest.MonkeyPatch, mocker: MockerFixture
) -> None:
    work = jobs((edit("x"), BIG), (edit("y"), small("y")))
    stop = threading.Event()
    if why == "env":
        monkeypatch.setenv(workers.ENV, "0")
    elif why == "one-cpu":
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    elif why == "threads":
        threading.Thread(target=stop.wait, daemon=True).start()
    elif why == "small":
        work = jobs((edit("x"), small("x")), (edit("y"), small("y")))
    else:
        work = work[:1]
    fork = mocker.spy(os, "fork")
    try:
        got = workers.transform_all(work)
    finally:
        stop.set()
    assert fork.call_count == 0
    for a, b in zip(got, [workers.transform_text(*job) for job in work], strict=True):
        same(a, b)


def test_started_workers_are_taken_for_the_same_job_only(
    two_cpus: None, mocker: MockerFixture
) -> None:
    work = jobs((edit("x"), BIG), (edit("y"), small("y")))
    fork = mocker.spy(os, "fork")
    with workers.start(work) as started:
        assert fork.call_count == 1 and len(started.children) == 1
        got = workers.transform_all(work, started)
        assert fork.call_count == 1  # the started worker was taken, none forked again
        assert not started.children
    assert type(got[0]).__name__ == "TextFileResult"
    for a, b in zip(got, [workers.transform_text(*job) for job in work], strict=True):
        same(a, b)
    # The file changed between the start and the plan: the worker's result is not used.
    edited = [(work[0][0], work[0][1], BIG.replace("# padding", "# edited")), work[1]]
    with workers.start(work) as started:
        [(pid, _)] = started.children.values()
        got = workers.transform_all(edited, started)
        assert len(started.children) == 1  # still running, for the old text
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # closed: killed and reaped
    assert type(got[0]).__name__ == "FileResult"
    same(got[0], workers.transform_text(*edited[0]))


def test_closing_started_workers_kills_them(two_cpus: None) -> None:
    def slow_in_a_worker(module: cst.Module) -> None:
        if os.getpid() != PARENT:
            time.sleep(120)

    work = jobs((edit("x", slow_in_a_worker), BIG), (edit("y"), small("y")))
    with workers.start(work) as started:
        [(pid, _)] = started.children.values()
        os.kill(pid, 0)  # running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
