"""Signals during the critical section of apply, revert and recover.

From before the first journal write to the journal's close, SIGINT, SIGTERM and SIGHUP (Ctrl-C,
`kill`, a closed terminal) are deferred: the handler only records them. An apply then stops at
its next step boundary (`checkpoint`, from the engine's kill points) and rolls back; a revert
and a recover run to their end (both are rolled forward by design). When the section ends the
signal is raised again, as:
- `Interrupted` (exit 130): the run finished; the trees are pristine (the apply was rolled
  back, the revert or recover was finished) or, for a signal that came after the apply's
  commit point, fully applied, and the message says which;
- `Unfinished` (exit 75): the run could not finish (the rollback itself failed) and left its
  journal: `sm120patch recover` finishes it. Any run that leaves a journal behind exits 75,
  with or without a signal: exit 1 promises that nothing was changed.
Further signals while deferring are recorded and change nothing: a second Ctrl-C cannot cut a
rollback short. `kill -9` still can; the journal and `recover` cover that.

Python runs signal handlers in the main thread only: elsewhere a section defers nothing (the
signal interrupts the main thread, not the section). A signal the process ignores (`nohup`)
stays ignored.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from sm120patch.errors import Sm120Error

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_INTERRUPTED = 130
EXIT_UNFINISHED = 75
# The test hooks below (SIGNAL_ENV, KILL_ENV, TRACE_ENV) are honoured only when this switch is
# on, and only code can turn it on: the test harness does, in its own process (conftest) and in
# the children it starts (`python -c "...; interrupts.TEST_HOOKS = True; ..."`, tests/killing.py).
# An environment alone (a service's EnvironmentFile, a user's shell) cannot: a production run
# never kills itself, signals itself or writes a trace file because a variable says so.
TEST_HOOKS = False
# Test hook, like the engine's SM120PATCH_KILL_AT: `STEP[:N][=SIG[xK]]` makes this process
# send itself SIG (INT, TERM or HUP; default INT) K times at that kill point. (A terminal's
# Ctrl-C signals the whole foreground group; the tests send that one from outside, with killpg.)
SIGNAL_ENV = "SM120PATCH_SIGNAL_AT"
RECOVER_HINT = "run `sm120patch recover` to finish it"


class Interrupted(Sm120Error):
    """A signal came during a run, which finished first (trees pristine or fully applied)."""

    exit_code = EXIT_INTERRUPTED


class Unfinished(Sm120Error):
    """A run could not finish and left its journal: `recover` finishes it."""

    exit_code = EXIT_UNFINISHED


# Told of every deferred signal (its number, how many so far): the CLI's acknowledgment. Runs
# inside the signal handler: it must only write with os.write, never through sys.stderr.
notice: Callable[[int, int], None] | None = None


class Section:
    """One critical section: what it is, whether a signal may still abort it, and what came."""

    def __init__(self, op: str, profile: str | None, *, abortable: bool) -> None:
        self.op = op  # "apply", "revert", "recover"
        self.profile = profile
        self.abortable = abortable
        self.committed = False
        self.received: list[int] = []
        self.failed = False  # it ended with an error (a refusal, a rollback)
        self.unfinished: Callable[[], bool] = lambda: False

    def commit(self) -> None:
        """The apply's commit point: every manifest is written; a signal no longer aborts."""
        self.abortable = False
        self.committed = True

    def rolling_back(self) -> None:
        """Rolling back: nothing may abort that (a second Ctrl-C included)."""
        self.abortable = False

    def what(self) -> str:
        return f"the {self.op}" + (f" of {self.profile}" if self.profile else "")


_active: list[Section] = []
# The last outermost section this process ended: what a signal that comes outside every section
# (a KeyboardInterrupt, after the run or before it) finds the trees in (`after_interrupt`).
_last: list[Section] = []


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def _handler(signum: int, frame: FrameType | None) -> None:
    if not _active:  # the section just ended (`_end`): as the handler before it would
        raise KeyboardInterrupt
    section = _active[-1]
    section.received.append(signum)
    if notice is not None:
        try:
            notice(signum, len(section.received))
        except Exception:  # a closed terminal: the acknowledgment is not worth a failure
            pass


def checkpoint() -> None:
    """At a step boundary of an apply: stop here if a signal came (the caller rolls back)."""
    section = _active[-1] if _active else None
    if section is not None and section.abortable and section.received:
        section.abortable = False
        raise Interrupted(f"interrupted ({_name(section.received[0])})")


@contextmanager
def critical(
    op: str, profile: str | None, *, abortable: bool, unfinished: Callable[[], bool]
) -> Iterator[Section]:
    """Defer SIGINT/SIGTERM/SIGHUP over the block; raise them again at its end (see above).

    `abortable`: an apply (a signal stops it at the next `checkpoint`); a revert or recover
    is finished instead. `unfinished()`: whether a journal of this run is still open.
    """
    section = Section(op, profile, abortable=abortable)
    section.unfinished = unfinished
    main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if main and not _active:
        for signum in SIGNALS:
            old = signal.getsignal(signum)
            if old is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, _handler)
    outer = _active[-1] if _active else None
    _active.append(section)
    try:
        yield section
    except BaseException as exc:
        _end(section, previous, exc)
        if outer is not None:
            outer.received.extend(section.received)
            raise
        _raise_for(section, exc, unfinished)
        raise
    _end(section, previous)
    if outer is not None:
        outer.received.extend(section.received)
        return
    _raise_for(section, None, unfinished)


def _end(section: Section, previous: dict[int, Any], exc: BaseException | None = None) -> None:
    # The section is known ended before the handlers go back: a signal handled as before the
    # section (a KeyboardInterrupt) then finds it as the last one, whose state it reports.
    section.failed = exc is not None
    _active.remove(section)
    if not _active:
        _last[:] = [section]
    for signum, old in previous.items():
        signal.signal(signum, old)


def outside(signame: str = "SIGINT") -> Interrupted:
    """The error for a signal outside every section: one line saying the state it left."""
    state, hint = after_interrupt()
    return Interrupted(f"interrupted ({signame}): {state}", hint)


def after_interrupt() -> tuple[str, str]:
    """What a Ctrl-C outside every section leaves (it cut nothing of a run short): the state
    of the trees as the last run of this process left them, and what to do."""
    if not _last:
        return "no apply, revert or recover had started: nothing was changed", ""
    section = _last[0]
    try:
        left = section.unfinished()
    except Exception:
        left = True  # its journal cannot be read: recover says what it finds
    if left:
        return f"{section.what()} is unfinished: its journal is kept", RECOVER_HINT
    if section.op == "apply" and section.committed:
        return (
            f"{section.what()} had completed: it stays applied",
            f"`sm120patch revert {section.profile}` undoes it",
        )
    if section.op == "apply":
        return f"{section.what()} was rolled back: nothing was changed", ""
    if section.failed:
        return f"{section.what()} failed, leaving no journal: nothing was changed", ""
    return f"{section.what()} was finished first", "`sm120patch status` shows the trees"


def _raise_for(section: Section, exc: BaseException | None, unfinished: Callable[[], bool]) -> None:
    """The exit of a finished section: Unfinished, Interrupted, or nothing (exc goes on)."""
    if exc is not None and not isinstance(exc, Exception):
        return  # SystemExit and the like: not ours to rename
    if exc is not None or section.received:
        try:
            left = unfinished()
        except Exception:
            left = False  # the journal cannot even be read: the error in flight says why
        if left and (section.received or isinstance(exc, Sm120Error)):
            signame = _name(section.received[0]) if section.received else None
            cause = getattr(exc, "message", None) or (str(exc) if exc else "")
            if signame:
                message = f"interrupted ({signame}), and {section.what()} could not finish"
                message += f" ({cause}); its journal is kept" if cause else "; its journal is kept"
                raise Unfinished(message, RECOVER_HINT) from exc
            raise Unfinished(cause, getattr(exc, "hint", "") or RECOVER_HINT) from exc
    if not section.received:
        return
    signame = _name(section.received[0])
    if section.op == "apply" and not section.committed:
        raise Interrupted(
            f"interrupted ({signame}): {section.what()} was rolled back; nothing was changed",
            "apply again when you want it",
        ) from exc
    if section.op == "apply":
        raise Interrupted(
            f"interrupted ({signame}) after {section.what()} had completed: it stays applied",
            f"`sm120patch revert {section.profile}` undoes it",
        ) from exc
    if exc is not None:
        return  # a revert or recover that failed but left no journal: its error says more
    raise Interrupted(
        f"interrupted ({signame}): {section.what()} was finished first",
        "`sm120patch status` shows the trees",
    )


def at_step(step: str, count: int) -> None:
    """The engine's kill point `step` (its `count`-th passage): the test hook, then a
    checkpoint."""
    spec = os.environ.get(SIGNAL_ENV) if TEST_HOOKS else None
    if spec:
        where, _, how = spec.partition("=")
        if where in (step, f"{step}:{count}"):
            name, _, times = how.partition("x")
            signum = signal.Signals["SIG" + (name or "INT")]
            for _ in range(int(times or 1)):
                os.kill(os.getpid(), signum)
    checkpoint()


# Test hooks for the kill-anywhere tests: the step at which the process kills itself (`step`,
# or `step:N` for its N-th passage), and a file to which every step passed is appended as
# `step:N` (so that the tests learn every boundary of a run).
KILL_ENV = "SM120PATCH_KILL_AT"
TRACE_ENV = "SM120PATCH_TRACE_STEPS"
_passed: dict[str, int] = {}


# In-process test hooks: a callable the tests set for a step (a kill point's name, or a point
# between a check and its use such as "before-copy"), run there only with TEST_HOOKS on. The
# race tests swap a directory for a link there, as an attacker's inotify loop would.
HOOKS: dict[str, Callable[[], None]] = {}


def hook(step: str) -> None:
    """Run the test's callable for `step` (TEST_HOOKS only; never from the environment)."""
    if TEST_HOOKS and step in HOOKS:
        HOOKS[step]()


def kill_point(step: str) -> None:
    if not TEST_HOOKS:
        checkpoint()  # [signals] a deferred SIGINT stops an apply here
        return
    hook(step)
    count = _passed[step] = _passed.get(step, 0) + 1
    trace = os.environ.get(TRACE_ENV)
    if trace:
        from sm120patch.targets.files import append_output  # never through a link at its name

        with append_output(trace) as fh:
            fh.write(f"{step}:{count}\n")
    if os.environ.get(KILL_ENV) in (step, f"{step}:{count}"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    at_step(step, count)  # [signals] a deferred SIGINT stops an apply here
