"""Who is alive, and who works in a directory: read from Linux's /proc, nothing else.

Two questions `recover` asks before it removes a git lock a killed run left behind:
- is the run that wrote the journal dead? A pid alone does not say (pids are reused), so the
  journal records the process's start time (field 22 of /proc/PID/stat, clock ticks since
  boot) and the boot id; the same pid with another start time, or another boot, is another
  process.
- does any live process still work in the repository? Every process's cwd and open file
  descriptors (/proc/PID/cwd, /proc/PID/fd/*) are compared with the repository's paths.

Without /proc (not Linux) every answer is "unknown" (None), and the caller refuses rather than
guesses. No dependency beyond the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    start: int  # clock ticks since boot
    name: str  # /proc/PID/comm: the executable's name, 15 characters at most
    state: str  # R, S, D, ...; Z: a zombie (dead, not yet reaped by its parent)

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")


@dataclass(frozen=True)
class Use:
    """A live process found working in a directory: how (cwd, an open file, or unknown when
    /proc would not show it to us) and which path."""

    process: Process
    how: str  # "cwd", "open", "hidden"
    path: str

    def describe(self) -> str:
        what = {"cwd": "works in", "open": "has open", "hidden": "may be using (hidden from us)"}
        return f"pid {self.process.pid} ({self.process.name}) {what[self.how]} {self.path}"


def available() -> bool:
    return (PROC / "self" / "stat").is_file()


def _stat(pid: int | str) -> Process | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split at the last
    # ')'. After it, field 3 (state) is index 0: ppid is index 1, starttime (field 22) index 19.
    head, _, rest = raw.rpartition(")")
    fields = rest.split()
    try:
        name = head.split("(", 1)[1]
        return Process(int(pid), int(fields[1]), int(fields[19]), name, fields[0])
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    """A process's start time as a journal records it (clock ticks since boot, as text)."""
    found = _stat(pid)
    return None if found is None else str(found.start)


def identity() -> dict[str, object]:
    """This process, as a journal records its owner: pid, start time and boot."""
    return {"pid": os.getpid(), "pid_start": start_time(os.getpid()), "boot_id": boot_id()}


def alive(pid: int, start: str | int | None, boot: str | None) -> bool | None:
    """Whether the process a journal names (its pid, start time and boot) is still running.

    True/False when /proc can tell; None when it cannot (no /proc, no pid recorded). Without a
    recorded start time (journals of sm120patch 0.1.0), a live pid is None: it may be reused.
    """
    if pid <= 0 or not available():
        return None
    if boot and boot_id() not in (None, boot):
        return False  # written before a reboot: that process is gone
    found = _stat(pid)
    if found is None or found.dead:
        return False  # gone, or a zombie: killed, its parent has not reaped it yet
    if start is None or not str(start).isdigit():
        return None
    return found.start == int(start)


def processes() -> Iterator[Process]:
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            found = _stat(entry.name)
            if found is not None:
                yield found


def descendants(pid: int, among: Iterable[Process] | None = None) -> set[int]:
    """Every process below `pid` (children, their children, ...), by parent pid."""
    table = list(processes() if among is None else among)
    children: dict[int, list[int]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p.pid)
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def users_of(git_dirs: Iterable[Path], work_tree: Path | None = None) -> list[Use]:
    """Live processes (other than this one and its children) using a repository.

    A process counts when its cwd is inside one of `git_dirs` or it has a file open there, or
    when it is git itself (its name starts with "git": git, git-remote-http, ...)
    with its cwd or an open file inside `work_tree`. Other processes merely sitting in the
    work tree (the user's shell, an editor) do not count. A git process whose cwd and files
    /proc hides from us (another user's) is reported as "hidden": it may be there.
    """
    dirs = tuple(os.path.realpath(d) for d in git_dirs)
    tree = (os.path.realpath(work_tree),) if work_tree is not None else ()
    table = list(processes())
    skip = {os.getpid(), *descendants(os.getpid(), table)}
    found: list[Use] = []
    for proc in table:
        if proc.pid in skip or proc.dead:
            continue
        is_git = proc.name.startswith("git")
        roots = dirs + tree if is_git else dirs
        use = _use(proc, roots, hidden_counts=is_git)
        if use is not None:
            found.append(use)
    return found


def _use(proc: Process, roots: tuple[str, ...], *, hidden_counts: bool) -> Use | None:
    base = PROC / str(proc.pid)
    hidden = False
    try:
        cwd = os.readlink(base / "cwd")
        if _inside(cwd, roots):
            return Use(proc, "cwd", cwd)
    except PermissionError:
        hidden = True
    except OSError:
        return None  # ended meanwhile, or a kernel thread
    try:
        fds = os.listdir(base / "fd")
    except PermissionError:
        hidden = True
        fds = []
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(base / "fd" / fd)
        except OSError:
            continue
        if _inside(target.removesuffix(" (deleted)"), roots):
            return Use(proc, "open", target)
    if hidden and hidden_counts:
        return Use(proc, "hidden", "?")
    return None
