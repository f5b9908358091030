"""Reading what others own and running git without anyone's configuration: the primitives
`targets/` (its package init included, which may import none of its own modules) stands on.

A file of a target or a state directory is opened without following a link at its name and
without blocking, then judged on the opened descriptor (`read_regular`); a git child gets an
environment of its own, not the caller's (`git_env`, `clean_command`): root run with a user's
HOME must not run that user's `~/.gitconfig`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch.errors import Refused

if TYPE_CHECKING:
    import subprocess


def user_name(uid: int) -> str:
    """A user's name for a message (`alice`, or `uid 1234` when it has none)."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return f"uid {uid}"


# The largest file sm120patch reads from a target or a state directory: a source file or a
# state document is far smaller; anything larger was put there to exhaust memory.
READ_LIMIT = 64 << 20
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotOwned(Refused):
    """`read_regular`'s refusal of a file owned by someone outside `owners` (the caller may
    say more: whose it should be, and the fix)."""


def read_regular(
    path: Path,
    *,
    limit: int = READ_LIMIT,
    owners: tuple[int, ...] | None = None,
    at: tuple[int, str] | None = None,
    what: str = "target or state file",
) -> bytes:
    """The bytes of the regular file at `path` (a target's file, a state file), judged on the
    file actually opened: opened without following a symbolic link at its name and without
    blocking (a FIFO would block the open until someone writes), then `fstat`-ed: a FIFO, a
    device, a socket, a file over `limit` bytes or, with `owners`, one owned by anyone else
    is refused in one line before a byte is read. A directory raises IsADirectoryError and a
    missing file FileNotFoundError, as `Path.read_bytes` does. `at` (a directory's descriptor
    and a name in it) opens that name relative to the descriptor, `path` naming it in
    messages (`handle.TreeHandle.read`); `what` names the kind of file in a refusal."""
    import errno

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        flags |= getattr(os, "O_CLOEXEC", 0)
        fd = os.open(at[1], flags, dir_fd=at[0]) if at is not None else os.open(path, flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise Refused(
            f"{path} is a symbolic link; sm120patch reads no {what} through one",
            f"replace {path} by the file itself (or move it aside), then run sm120patch again",
        ) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        problem = None
        if not stat.S_ISREG(st.st_mode):
            kind = next((w for test, w in _KINDS if test(st.st_mode)), "not a regular file")
            problem = f"{path} is {kind}, not a regular file; sm120patch reads regular files only"
        elif st.st_size > limit:
            problem = f"{path} is {st.st_size} bytes, more than sm120patch reads ({limit})"
        elif owners is not None and st.st_uid not in owners:
            raise NotOwned(f"{path} is owned by {user_name(st.st_uid)}", "move it aside")
        if problem:
            raise Refused(problem, f"move {path} aside, then run sm120patch again")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise Refused(f"{path} grew past {limit} bytes while read", f"move {path} aside")
    finally:
        os.close(fd)


# The largest file a user names that sm120patch reads whole (`--known`): far above any real
# one; a lock is capped lower (`LOCK_LIMIT`), the size of a profile's every diff several times.
NAMED_LIMIT = 16 << 20
LOCK_LIMIT = 1 << 20


def read_named(path: Path, what: str, *, limit: int = NAMED_LIMIT) -> bytes:
    """The bytes of a file the user named (`what`: "lock file", "--known file"), by
    `read_regular`'s rules: no link followed at its name (a link to a file the caller may not
    read would have its contents echoed in an error), no blocking on a FIFO, a regular file of
    at most `limit` bytes. Every failure is one line naming the file: a missing file or a
    directory is a usage error (exit 2), the rest a refusal (exit 1)."""
    from sm120patch.errors import UsageError

    try:
        return read_regular(path, limit=limit, what=what)
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist", "check the path") from None
    except NotADirectoryError:
        raise UsageError(
            f"{what} {path} does not exist (a file is on its way)", "check the path"
        ) from None
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a directory", "give the file's path") from None
    except Refused as exc:
        raise Refused(f"{what} {exc.message}", "give the path of the regular file itself") from None
    except OSError as exc:
        raise Refused(
            f"cannot read {what} {path} ({exc.strerror or exc})", "check that it is readable"
        ) from None


def walk(top: str | Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk(top)` (top-down, `dirs` prunable in place, a link to a directory listed in
    `dirs` but never entered, unreadable directories skipped) without recursion: Python
    3.11's recurses once per level, so 1,200 nested directories a user made ended a scan in
    RecursionError."""
    stack = [os.fspath(top)]
    while stack:
        here = stack.pop()
        try:
            with os.scandir(here) as listing:
                entries = list(listing)
        except OSError:
            continue
        dirs: list[str] = []
        names: list[str] = []
        links: set[str] = set()
        for entry in entries:
            try:
                is_dir = entry.is_dir()
                if is_dir and entry.is_symlink():
                    links.add(entry.name)
            except OSError:
                is_dir = False
            (dirs if is_dir else names).append(entry.name)
        yield here, dirs, names
        stack.extend(os.path.join(here, d) for d in reversed(dirs) if d not in links)


# The caller's variables git may see (values only: a locale or a time zone runs nothing).
_KEPT_ENV = ("PATH", "TZ")
ENV_BIN = "/usr/bin/env"


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a git child: no system or global configuration (and no HOME
    or XDG directory to find a user's in), no system attributes, no prompt, the C locale."""
    env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
    env.setdefault("PATH", os.defpath)
    env.update(
        HOME="/dev/null",  # ~/.gitconfig, ~/.config/git/*: never a file
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_SYSTEM="/dev/null",
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_ATTR_NOSYSTEM="1",
        GIT_TERMINAL_PROMPT="0",
        LANGUAGE="C",
        LC_ALL="C",
    )
    env.update(extra or {})
    return env


# What a pip child keeps of the caller's environment: its index configuration (PIP_*, the
# config files found through HOME, XDG_* and VIRTUAL_ENV, PIP_CONFIG_FILE among the PIP_*),
# how it reaches the index (proxies, certificates, .netrc), a temporary directory and the
# locale. Nothing that changes which code Python runs: the child also runs `-I` (no PYTHON*
# variable, no user site, no working directory on sys.path) in `/`.
_PIP_KEPT = (
    "PATH",
    "HOME",
    "TZ",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TMPDIR",
    "XDG_CONFIG_HOME",
    "XDG_CONFIG_DIRS",
    "XDG_CACHE_HOME",
    "XDG_DATA_HOME",
    "XDG_RUNTIME_DIR",
    "DBUS_SESSION_BUS_ADDRESS",  # keyring: the XDG variables and D-Bus
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NETRC",
)
_PROXIES = ("http_proxy", "https_proxy", "no_proxy", "all_proxy")
# Where a Python child the tool starts runs: the caller's working directory may be anyone's
# (`python -m` puts it first on sys.path; a relative path in the environment resolves in it).
CHILD_CWD = "/"


def pip_env() -> dict[str, str]:
    """The whole environment of a pip child (see `_PIP_KEPT`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k in _PIP_KEPT or k.startswith("PIP_") or k.lower() in _PROXIES
    }
    env.setdefault("PATH", os.defpath)
    return env


def python_command(python: str, *args: str) -> list[str]:
    """`python` run isolated (`-I`: no PYTHON* variable, no user site-packages, neither the
    working directory nor a script's directory on sys.path) with `args`."""
    return [python, "-I", *args]


def clean_command(command: list[str], env: dict[str, str]) -> list[str]:
    """`command` run with exactly `env` (see the module's docstring)."""
    if not os.path.exists(ENV_BIN):
        return command  # not Linux-like: the caller's environment, less safe but working
    return [ENV_BIN, "-i", *(f"{k}={v}" for k, v in env.items()), *command]


# `-c` options given to every git command sm120patch runs (they override every config file):
# a checkout's hooks and configuration are its owner's code, which must not run in
# sm120patch's process (often root's), reformat the files just verified, or block an
# unattended run on a prompt (`run_git`, the one way git is run).
_SAFE_SETTINGS = (
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "gc.auto=0",
    "maintenance.auto=false",
    "core.attributesFile=/dev/null",
)
SAFE_CONFIG = tuple(arg for setting in _SAFE_SETTINGS for arg in ("-c", setting))


def run_git(
    root: Path, *args: str, env: Mapping[str, str] | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Every git command sm120patch runs, in `root`: without hooks, fsmonitor, signing, gc or
    a pager (`SAFE_CONFIG`), with paths never read as pathspec magic, with nothing of the
    caller's environment (`git_env`, plus `env`: a repository's filters off, an identity), in
    a session of its own with terminal signals blocked around its start
    (`_terminal_signals_blocked`), its output captured. GitPython is not used: its import
    alone would double `status`'s start-up time, and one runner is one set of rules."""
    import subprocess  # only where there is a checkout: none for installed packages

    command = ["git", *SAFE_CONFIG, "--literal-pathspecs", "--no-pager", "-C", str(root), *args]
    try:
        with _terminal_signals_blocked():
            return subprocess.run(
                clean_command(command, git_env(dict(env or {}))),
                input=stdin,
                stdin=subprocess.DEVNULL if stdin is None else None,
                capture_output=True,
                check=False,
                start_new_session=True,  # a Ctrl-C to the terminal's group never kills it
            )
    except OSError as exc:
        raise Refused(
            f"cannot run git for {root} ({exc.strerror})",
            "install git, or point sm120patch at an installed package",
        ) from None


@contextlib.contextmanager
def _terminal_signals_blocked() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP blocked in this thread around a git command.

    The child is in the terminal's process group from the fork until its `setsid`; a Ctrl-C
    in that window stays pending in it and kills git once the child unblocks it, before the
    exec (a rollback's `git branch -D` died so, exit -2). The child inherits the mask, so the
    signal stays blocked in git, whose own session no terminal signal reaches anyway. Here it
    stays pending too, and reaches the handler (`interrupts.py`) when the command returns:
    deferred, never lost."""
    import signal

    signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
