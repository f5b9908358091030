"""Helpers for the tests that kill sm120patch: run it as a real process, and tell the states of
the trees apart (pristine, fully patched, or anything else)."""

from __future__ import annotations

import contextlib
import hashlib
import json
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


# The fork server: one helper process that has imported the tool once and forks a child per
# run. The child is a real process (its own pid, killed by a real signal, its own process group
# where asked) that starts where a fresh `python -c HOOKED` would after its imports: about
# 0.3 s of imports saved per child, over the few hundred children the kill and signal tests
# start. SM120PATCH_TEST_FORK=0 starts a fresh interpreter per child instead.
FORK_ENV = "SM120PATCH_TEST_FORK"
SERVER = (
    "import json, os, runpy, sys\n"
    "import sm120patch.engine.interrupts as hooks\n"
    # What an apply, a revert and a recover import: loaded before any fork, never run.
    "import libcst, sm120patch.cli, sm120patch.engine.apply, sm120patch.engine.revert\n"
    "import sm120patch.engine.recover, sm120patch.plan.planner, sm120patch.plan.catalog\n"
    "def child(req):\n"
    "    if req['session']:\n"
    "        os.setsid()\n"
    "    os.chdir(req['cwd'])\n"
    "    os.environ.clear()\n"
    "    os.environ.update(req['env'])\n"
    "    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),\n"
    "                            (1, req['out'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),\n"
    "                            (2, req['err'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):\n"
    "        os.dup2(os.open(path, flags, 0o600), fd)\n"
    "    hooks.TEST_HOOKS = True\n"
    "    sys.argv = ['-c', *req['args']]\n"
    # As `python -c HOOKED` goes on: the exit status and any traceback are the interpreter's.
    "    runpy.run_module('sm120patch', run_name='__main__', alter_sys=True)\n"
    "    sys.exit(0)\n"
    "for line in sys.stdin:\n"
    "    req = json.loads(line)\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        child(req)\n"
    "    print(pid, flush=True)\n"
    "    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)\n"
)


def _line(fd: int, timeout: float | None) -> str | None:
    """One line from the server, unbuffered (a buffered reader could hold a status that select
    then never sees); None if none came within `timeout`."""
    import select

    got = b""
    while not got.endswith(b"\n"):
        if not got and not select.select([fd], [], [], timeout)[0]:
            return None
        byte = os.read(fd, 1)
        assert byte, "the fork server ended"
        got += byte
    return got.decode()


class Child:
    """A child of the fork server, read as a subprocess.Popen is: pid, poll, wait, returncode,
    send_signal, communicate (its output goes to files, read at the end)."""

    def __init__(self, fd: int, pid: int, out: Path, err: Path) -> None:
        self._fd, self.pid, self._out, self._err = fd, pid, out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        status = self._status(timeout)
        if status is None:
            raise subprocess.TimeoutExpired("sm120patch", timeout or 0)
        return status

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = _line(self._fd, timeout)
            if line is not None:
                self.returncode = int(line)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def communicate(self) -> tuple[str, str]:
        self.wait()
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")


_server: subprocess.Popen[bytes] | None = None
_pending: list[Child] = []  # the child the server is waiting for: its status comes first
_outputs: list[Path] = []  # one directory for every child's stdout and stderr


def _fork_server() -> subprocess.Popen[bytes]:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            bufsize=0, start_new_session=True,  # a group SIGINT is not its own
        )  # fmt: skip
    return _server


def popen(
    args: list[str], env: dict[str, str] | None = None, *, session: bool = False
) -> Child | subprocess.Popen[str]:
    """sm120patch started as a process of its own (the fork server's child), its stdout and
    stderr kept for `communicate`; `session`: in a process group of its own."""
    import tempfile

    if os.environ.get(FORK_ENV, "1") == "0":
        return subprocess.Popen(command(*args), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=session)  # fmt: skip
    if not _outputs:
        import atexit
        import shutil

        _outputs.append(Path(tempfile.mkdtemp(prefix="sm120kill-")))
        atexit.register(shutil.rmtree, _outputs[0], True)
    for earlier in _pending:  # a test that failed before it waited for its child
        earlier.wait()
    _pending.clear()
    n = len(list(_outputs[0].iterdir()))
    out, err = _outputs[0] / f"{n}.out", _outputs[0] / f"{n + 1}.err"
    server = _fork_server()
    assert server.stdin is not None and server.stdout is not None
    request = {"args": list(args), "env": dict(env if env is not None else os.environ),
               "session": session, "cwd": os.getcwd(), "out": str(out), "err": str(err)}
    server.stdin.write((json.dumps(request) + "\n").encode())
    server.stdin.flush()
    fd = server.stdout.fileno()
    child = Child(fd, int(_line(fd, None) or ""), out, err)
    _pending.append(child)
    return child


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """sm120patch as a process of its own, with extra environment variables."""
    proc = popen(list(args), {**os.environ, **(env or {})})
    out, err = proc.communicate()
    return subprocess.CompletedProcess(command(*args), proc.returncode or 0, out, err)


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
    proc = popen(args, env, session=True)  # its own process group, as under a shell or a service
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
