"""Large files transformed in forked worker processes while this process does the others.

A cold plan is mostly libcst parsing: SGLang's server_args.py (5,000 lines) alone is about
three quarters of the parse of every file a profile touches. A child forked after the patches
are loaded parses and transforms such a file while this process plans the rest, and sends back
its result as text (`FileResult.as_text`: the text after each step, the outcomes, the imports
added), never a tree.

A worker is only an accelerator: one that fails in any way (cannot fork, dies, sends nothing)
is done again here, so the plan is the same with or without workers. Nothing runs in a worker
but the runner's pure text-in, outcomes-out transform, and a worker writes nothing but its pipe.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence

from sm120patch.patchkit.model import Patch
from sm120patch.patchkit.runner import FileResult, TextFileResult, transform_text

# (patches, file, text): one call of `transform_text`.
Job = tuple[Sequence[Patch], str, str]

# A file under this size parses in a few tens of milliseconds: forking, copying the result and
# collecting the child would cost much of what it saves.
MIN_CHARS = 64 * 1024

# Set to "0" to plan every file in this process (for comparisons and for debugging).
ENV = "SM120PATCH_WORKERS"


class Started:
    """Workers started on some jobs ahead of their plan (`start`), so that they parse while
    the caller does other work; `transform_all` takes their results for the same jobs (the
    same patches on the same file and text). Closing kills and reaps those not taken."""

    def __init__(self) -> None:
        self.children: dict[tuple[tuple[str, ...], str, str], tuple[int, int]] = {}

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self.children:
            _, (pid, fd) = self.children.popitem()
            _abandon(pid, fd)

    def take(self, job: Job) -> tuple[int, int] | None:
        return self.children.pop(_key(job), None)


def _key(job: Job) -> tuple[tuple[str, ...], str, str]:
    patches, file, text = job
    return tuple(p.id for p in patches), file, text


def start(jobs: Sequence[Job]) -> Started:
    """Workers forked now for the jobs `transform_all` would give them."""
    started = Started()
    try:
        for i in _forked(jobs):
            child = _start(jobs[i])
            if child is not None:
                started.children[_key(jobs[i])] = child
    except BaseException:
        started.close()
        raise
    return started


def transform_all(jobs: Sequence[Job], started: Started | None = None) -> list[FileResult]:
    """`transform_text` of each job, in order: the largest files in forked workers when there
    are CPUs to spare (those of `started` where it holds the same job), the others here
    meanwhile."""
    if started is None and _forked(jobs):
        # Imported once, before the fork, so that a worker inherits it instead of paying for
        # it again: libcst's import is as long as the parse of a middling file.
        import libcst  # noqa: F401
    own = start(jobs) if started is None else started
    children: dict[int, tuple[int, int]] = {}
    results: dict[int, FileResult] = {}
    try:
        for i, job in enumerate(jobs):
            if (child := own.take(job)) is not None:
                children[i] = child
        for i, job in enumerate(jobs):
            if i not in children:
                results[i] = transform_text(*job)
        for i in list(children):
            pid, fd = children.pop(i)
            got = _collect(pid, fd, jobs[i])
            results[i] = got if got is not None else transform_text(*jobs[i])
    finally:
        for pid, fd in children.values():  # interrupted: leave no child behind
            _abandon(pid, fd)
        if started is None:
            own.close()
    return [results[i] for i in range(len(jobs))]


def _forked(jobs: Sequence[Job]) -> list[int]:
    """The jobs to give to workers: the largest ones over `MIN_CHARS`, one fewer than the CPUs
    this process may use, always leaving this process at least one job of its own."""
    if os.environ.get(ENV) == "0" or not hasattr(os, "fork") or len(jobs) < 2:
        return []
    if threading.active_count() > 1:
        return []  # a fork copies one thread of a process whose locks others may hold
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    by_size = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][2]))
    big = [i for i in by_size if len(jobs[i][2]) >= MIN_CHARS]
    return big[: min((cpus or 1) - 1, len(jobs) - 1)]


def _start(job: Job) -> tuple[int, int] | None:
    """(pid, read end of its pipe) of a child transforming `job`, or None (do it here)."""
    try:
        read, write = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the child: transform, send, and leave without running any of the parent's
        code = 1  # exit handlers or flushing its buffers
        try:
            import pickle

            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            os.close(read)
            result = transform_text(*job).as_text()
            payload = (result.after, result.outcomes, result.texts, result.added)
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _collect(pid: int, fd: int, job: Job) -> FileResult | None:
    """The child's result, or None when it did not finish cleanly."""
    import pickle

    try:
        with os.fdopen(fd, "rb") as pipe:
            data = pipe.read()
    except BaseException:
        _abandon(pid, None)
        raise
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not data:
        return None
    try:
        after, outcomes, texts, added = pickle.loads(data)  # our own child, over our own pipe
    except Exception:
        return None
    _, file, text = job
    return TextFileResult(
        file=file, before=text, after=after, outcomes=outcomes, texts=texts, added=added
    )


def _abandon(pid: int, fd: int | None) -> None:
    """Kill and reap a child whose result is no longer wanted, and close its pipe (None: the
    pipe is closed already)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass
    if fd is not None:
        os.close(fd)
