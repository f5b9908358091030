"""The trial loop: apply a profile, run a command under it, judge it, keep or revert.

The command is an argument vector, never run through a shell. Its output goes line by line to
the `on_line` callback (the CLI echoes it) and to a log file; the engine never prints. A crash
is an exit, or no readiness (a 2xx from `ready_url`, or a line matching `ready_pattern`) within
the timeout. On a crash the profile is reverted and the output is matched against the known
failure signatures (patches/signatures.toml). Every trial is recorded in the target's state.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sm120patch.engine import apply, revert, trials
from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import Refused, Sm120Error, TrialCrashed, UsageError
from sm120patch.targets.resolved import Given, owned

TAIL_LINES = 60
PROGRESS_EVERY = 5.0  # seconds between two `on_wait` calls while a server is not ready
# ANSI escape sequences (CSI: colours, cursor moves; OSC: titles, links). vLLM colours its
# level, time and file fields where FORCE_COLOR or VLLM_LOGGING_COLOR=1 says so, even into a
# pipe (vllm/logging_utils/formatter.py, ColoredFormatter); a line is matched (readiness,
# wiring, crash signatures) and kept without them.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def plain(line: str) -> str:
    """`line` without its ANSI escape sequences."""
    return _ANSI.sub("", line) if "\x1b" in line else line


def new_id() -> str:
    """A trial's id: when it started, plus a few random digits for two in one second."""
    import secrets

    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass(frozen=True)
class Signature:
    id: str
    pattern: str
    diagnosis: str
    action: str


def signatures() -> list[Signature]:
    from sm120patch import patches  # type: ignore[attr-defined]  # shipped from patches/ (package-dir)
    from sm120patch.plan import catalog

    path = Path(patches.__file__ or "").parent / "signatures.toml"
    doc = catalog.parse_toml(path.read_text(encoding="utf-8"), path)
    try:
        return [Signature(**raw) for raw in doc["signature"]]
    except (KeyError, TypeError) as exc:
        raise UsageError(
            f"{path}: not a list of [[signature]] tables ({exc})", catalog.DAMAGED_HINT
        ) from None


def diagnose(lines: Sequence[str]) -> Signature | None:
    text = "\n".join(lines)
    for sig in signatures():
        if re.search(sig.pattern, text):
            return sig
    return None


@dataclass
class TrialResult:
    profile: str
    command: list[str]
    verdict: str  # "ready", "exited-ok", "crashed", "timeout", "interrupted"
    started: float
    ended: float
    exit_code: int | None
    time_to_ready_s: float | None
    reverted: bool
    log: str | None
    tail: list[str] = field(default_factory=list)
    signature: dict[str, str] | None = None
    power_samples: list[dict[str, Any]] = field(default_factory=list)
    id: str = field(default_factory=lambda: new_id())

    @property
    def ok(self) -> bool:
        return self.verdict in ("ready", "exited-ok")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def record(self) -> TrialRecord:
        """What the trial history keeps of it (checked as every record read back is)."""
        return TrialRecord.from_json(self.to_dict())

    def summary(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        what = " ".join(self.command)
        extra = f", ready in {self.time_to_ready_s:.1f}s" if self.time_to_ready_s else ""
        code = f", exit {self.exit_code}" if self.exit_code is not None else ""
        return f"{when} {self.profile}: {self.verdict}{extra}{code}: {what}"


class _Watcher:
    """Reads the child's output, keeps the tail, notices the ready pattern. The log and
    `on_line` get each line as printed; the tail and the pattern get it `plain`. Lines are split as
    text mode splits them (universal newlines: vLLM continues a multi-line message after
    `\\r\\n` and its prefix, each part a line of its own here)."""

    def __init__(
        self,
        proc: subprocess.Popen[str],
        pattern: re.Pattern[str] | None,
        on_line: Callable[[str], None],
        log: Any,
    ) -> None:
        self.proc = proc
        self.pattern = pattern
        self.on_line = on_line
        self.log = log
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if self.log is not None:
                self.log.write(line + "\n")
                self.log.flush()
            self.on_line(line)  # as printed: the terminal shows its escapes, never obeys them
            line = plain(line)
            self.tail.append(line)
            if self.pattern is not None and self.pattern.search(line):
                self.ready.set()


def spawn(command: Sequence[str]) -> subprocess.Popen[str]:
    """Start the command in its own session, so that stopping it stops its whole group."""
    try:
        return subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
    except OSError as exc:
        raise Refused(
            f"cannot start {command[0]}: {exc.strerror}",
            "check the command; the profile was reverted",
        ) from None


def _url_ready(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - user's URL
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _stop(proc: subprocess.Popen[str], grace: float = 10.0) -> None:
    """Stop the whole process group: servers fork workers that must not outlive the trial."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class _PowerSampler:
    def __init__(self, every: float = 1.0) -> None:
        self.samples: list[dict[str, Any]] = []
        self.every = every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from sm120patch.trial import gpu

        start = time.monotonic()
        while not self.stop.is_set():
            found = gpu.read_gpus()
            self.samples.append(
                {
                    "t": round(time.monotonic() - start, 2),
                    "gpus": [
                        {"index": g.index, "power_w": g.power_w, "limit_w": g.power_limit_w}
                        for g in found.gpus
                    ],
                }
            )
            self.stop.wait(self.every)

    def finish(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.thread.join(timeout=5)
        return self.samples


def open_log(log_path: Path | None) -> Any:
    """The trial's log, opened for appending; one clear line when it cannot be."""
    if log_path is None:
        return None
    from sm120patch.targets.files import append_output

    try:
        return append_output(log_path)  # never through a symbolic link at its name
    except Sm120Error as exc:
        why = exc.details.get("reason") or exc.message
        raise UsageError(f"--log {log_path}: cannot write there ({why})", exc.hint) from None


def run(
    profile: str,
    paths: Given,
    command: Sequence[str],
    *,
    ready_url: str | None = None,
    ready_pattern: str | None = None,
    timeout: float = 600.0,
    leave_running: bool = False,
    sample_power: bool = False,
    log_path: Path | None = None,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    on_line: Callable[[str], None] = lambda line: None,
    on_wait: Callable[[float, str | None], None] | None = None,
) -> TrialResult:
    """Run one trial. Raises TrialCrashed (after reverting) when the command crashed.
    `on_wait(elapsed, last_line)` is called every few seconds until the command is ready."""
    from sm120patch.plan import catalog
    from sm120patch.trial import engines

    # The targets found once, for the apply, the revert and the record.
    with owned(paths) as paths:
        engine = engines.of_profile(profile, catalog.load(paths.config))  # unknown: usage error
        if not command:
            raise UsageError("give the command to run after `--`", f"e.g. -- {engine.example}")
        try:
            pattern = re.compile(ready_pattern) if ready_pattern else None
        except re.error as exc:
            raise UsageError(
                f"--ready-pattern is not a valid regular expression: {exc}",
                f"quote it for the shell, e.g. --ready-pattern '{engine.ready_line}'",
            ) from None
        # Before anything is applied: an unwritable log is a usage error, not a patched tree left
        # behind by a crash.
        log = open_log(log_path)
        report = apply.apply(profile, paths, force=force, preconditions=preconditions)
        we_applied = report.action == "applied"
        started = time.time()
        try:
            proc = spawn(command)
        except Refused:
            if log:
                log.close()
            if we_applied:
                revert.revert(profile, paths)
            raise
        watcher = _Watcher(proc, pattern, on_line, log)
        sampler = _PowerSampler() if sample_power else None
        verdict, ready_at = _judge(
            proc, watcher, ready_url, pattern is not None, timeout, started, on_wait
        )
        samples = sampler.finish() if sampler else []
        if verdict != "ready" or not leave_running:
            _stop(proc)
        watcher.thread.join(timeout=5)
        if log:
            log.close()
        result = TrialResult(
            profile=profile,
            command=list(command),
            verdict=verdict,
            started=started,
            ended=time.time(),
            exit_code=proc.poll() if verdict != "ready" else None,
            time_to_ready_s=None if ready_at is None else round(ready_at - started, 2),
            reverted=False,
            log=str(log_path) if log_path else None,
            tail=list(watcher.tail),
            power_samples=samples,
        )
        if not result.ok:
            sig = diagnose(result.tail)
            result.signature = asdict(sig) if sig else None
            if we_applied:
                revert.revert(profile, paths, force=False)
                result.reverted = True
        record = result.record()
        trials.record_trial(paths, profile, record)
        if verdict == "interrupted":
            raise KeyboardInterrupt
        if not result.ok:
            crash = TrialCrashed(crash_message(result), crash_hint(result))
            crash.record = record.to_json()  # `--json` still prints the verdict and signature
            raise crash
        return result


def waiting_line(elapsed: float, last: str | None) -> str:
    """One progress line while a server loads: how long, and the last thing it printed."""
    head = f"waiting for readiness: {elapsed:.0f} s"
    if last is None:
        return head + ", no output yet"
    last = last.strip()
    return head + f", last line: {last[:117] + '...' if len(last) > 120 else last}"


def _judge(
    proc: subprocess.Popen[str],
    watcher: _Watcher,
    ready_url: str | None,
    has_pattern: bool,
    timeout: float,
    started: float,
    on_wait: Callable[[float, str | None], None] | None = None,
) -> tuple[str, float | None]:
    """Wait for readiness, an exit or the timeout; `on_wait(elapsed, last line)` every
    PROGRESS_EVERY seconds meanwhile."""
    begun = time.monotonic()
    deadline = begun + timeout
    next_progress = begun + PROGRESS_EVERY
    try:
        while True:
            if watcher.ready.is_set():
                return "ready", time.time()
            code = proc.poll()
            if code is not None:
                watcher.thread.join(timeout=5)  # the last lines may hold the ready line
                if watcher.ready.is_set():
                    return "ready", time.time()
                if code == 0 and not (ready_url or has_pattern):
                    return "exited-ok", None
                return "crashed", None
            if ready_url and _url_ready(ready_url):
                return "ready", time.time()
            now = time.monotonic()
            if now >= deadline:
                return "timeout", None
            if on_wait is not None and now >= next_progress:
                next_progress = now + PROGRESS_EVERY
                on_wait(now - begun, watcher.tail[-1] if watcher.tail else None)
            watcher.ready.wait(0.25)
    except KeyboardInterrupt:
        return "interrupted", None


def crash_message(result: TrialResult) -> str:
    what = {
        "crashed": f"exited with code {result.exit_code}",
        "timeout": "was not ready before the timeout",
        "interrupted": "was interrupted",
    }.get(result.verdict, result.verdict)
    head = f"trial of {result.profile}: the command {what}"
    if result.reverted:
        head += "; the profile was reverted"
    if result.signature:
        head += f". Diagnosis: {result.signature['diagnosis']}"
    return head


def crash_hint(result: TrialResult) -> str:
    """Where to look: the signature's action, else where the command's output is."""
    if result.signature:
        return result.signature["action"]
    if result.tail:
        seen = (
            f"its last {len(result.tail)} line(s) are printed above and kept in "
            f"`sm120patch trial show {result.id}`"
        )
    else:
        seen = "the command printed nothing; run it by hand to see why it stops"
    if result.log:
        return f"{seen}; all of its output is in {result.log}"
    return f"{seen}; `--log FILE` keeps all of its output"
