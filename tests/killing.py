"""Helpers for the tests that kill sm120patch: run it as a real process, and tell the states of
the trees apart (pristine, fully patched, or anything else)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from trees import git, tree_hash

from sm120patch.cli import main
from sm120patch.targets import procscan

KILL_ENV = "SM120PATCH_KILL_AT"
TRACE_ENV = "SM120PATCH_TRACE_STEPS"


def cli(*args: str) -> tuple[int, str, str]:
    """sm120patch in this process (fast: recover, status, the set-up applies)."""
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


# `python -m sm120patch` with the test hooks on (kill points, signal points, the step trace):
# they are honoured only when code switches them on (`interrupts.TEST_HOOKS`), never from the
# environment alone, so the child is started through this switch.
HOOKED = (
    "import sys, runpy\n"
    "import sm120patch.engine.interrupts as hooks\n"
    "hooks.TEST_HOOKS = True\n"
    "runpy.run_module('sm120patch', run_name='__main__', alter_sys=True)\n"
)


def command(*args: str) -> list[str]:
    """sm120patch as a process of its own, as `python -m sm120patch` with the test hooks on."""
    return [sys.executable, "-c", HOOKED, *args]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """sm120patch as a process of its own, with extra environment variables."""
    return subprocess.run(
        command(*args), env={**os.environ, **(env or {})}, capture_output=True, text=True
    )


def steps_of(tmp: Path, *args: str) -> list[str]:
    """Every kill point (`step:N`) one uninterrupted run passes, in order."""
    trace = tmp / "steps.txt"
    trace.unlink(missing_ok=True)
    proc = run(*args, env={TRACE_ENV: str(trace)})
    assert proc.returncode == 0, proc.stderr
    return trace.read_text().split() if trace.exists() else []


# How kill_after kills: "process" SIGKILLs sm120patch alone (an OOM kill); "group" SIGKILLs
# its process group (os.killpg: a closed terminal, `kill -9 -PGID`), which no longer holds its
# git children (they run in sessions of their own and finish their command); "tree" freezes
# the group, then SIGKILLs sm120patch and every process below it, git included (systemd's
# KillMode=control-group, `systemctl kill -s KILL`): that one leaves git's lock files.
KILLS = ("process", "group", "tree")


def kill_after(
    args: list[str], delay: float, how: str = "process", after_trace: Path | None = None
) -> tuple[int, float]:
    """Start sm120patch, kill it (`how`, above) after `delay` seconds if still running, then
    wait until its process group has ended. Its return code, and how long it ran.

    With `after_trace`, the run traces its kill points there and `delay` counts from the first
    one (the first journal write), however slow the machine is today."""
    assert how in KILLS, how
    env = None
    if after_trace is not None:
        after_trace.unlink(missing_ok=True)
        env = {**os.environ, TRACE_ENV: str(after_trace)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command(*args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # its own process group, as under a shell or a service
    )
    if after_trace is not None:
        while proc.poll() is None and not after_trace.exists():
            time.sleep(0.001)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        if how == "process":
            proc.send_signal(signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                if how == "tree":
                    # Frozen first, so that no child is started between the list and the kill.
                    os.killpg(proc.pid, signal.SIGSTOP)
                    for pid in procscan.descendants(proc.pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ran = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    return proc.returncode, ran


def work_hash(root: Path) -> str:
    """The work tree's files (bytes and modes) and, for a checkout, the current branch and the
    names of all branches: what "fully patched" means independently of commit ids, which
    change with the time of each apply."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel in (".git", ".sm120patch") or rel.startswith((".git/", ".sm120patch/")):
            continue
        if "__pycache__" in rel:
            continue
        if path.is_file() or path.is_symlink():
            h.update(rel.encode() + b"\0" + oct(path.lstat().st_mode).encode() + b"\0")
            h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    if (root / ".git").is_dir():
        h.update(git(root, "rev-parse", "--abbrev-ref", "HEAD").encode())
        h.update(git(root, "for-each-ref", "--format=%(refname)").encode())
    return h.hexdigest()


class States:
    """The pristine and the fully patched state of a set of trees, to classify any other."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self.pristine = [tree_hash(r) for r in roots]
        self.patched: list[str] | None = None

    def learn_patched(self) -> None:
        self.patched = [work_hash(r) for r in self.roots]

    def now(self) -> str:
        """ "pristine", "patched", or a description of the mixed state found."""
        if [tree_hash(r) for r in self.roots] == self.pristine:
            return "pristine"
        if [work_hash(r) for r in self.roots] == self.patched:
            return "patched"
        return "neither pristine nor patched: " + ", ".join(
            f"{r.name}={'pristine' if tree_hash(r) == p else 'changed'}"
            for r, p in zip(self.roots, self.pristine, strict=True)
        )


def write_patches(hook) -> list[tuple[str, object]]:
    """(what, replacement) pairs for `monkeypatch.setattr` that run `hook(path, data)` before
    every file sm120patch writes: a state file (`StateDir.write`), a cache or an output
    (`files.atomic_write`) and a target's file (`TreeHandle.replace`, through the tree's handle); `hook` raises to
    make that write fail (a full disk, a denied directory)."""
    from sm120patch.engine.statedir import StateDir
    from sm120patch.handle import TreeHandle
    from sm120patch.targets import files

    real_write, real_replace = files.atomic_write, TreeHandle.replace
    real_state = StateDir.write

    def state(self, rel, data, *args, **kwargs):
        hook(self.path / rel, data)
        return real_state(self, rel, data, *args, **kwargs)

    def write(path, data, *args, **kwargs):
        hook(Path(path), data)
        return real_write(path, data, *args, **kwargs)

    def replace(self, rel, data):
        hook(self.shown(rel), data)
        return real_replace(self, rel, data)

    return [("sm120patch.targets.files.atomic_write", write),
            ("sm120patch.handle.TreeHandle.replace", replace),
            ("sm120patch.engine.statedir.StateDir.write", state)]  # fmt: skip


def fail_writes(monkeypatch, hook) -> None:
    """`write_patches(hook)`, set on `monkeypatch`."""
    for what, replacement in write_patches(hook):
        monkeypatch.setattr(what, replacement)
