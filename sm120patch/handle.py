"""A target's tree held once it is found: its root directory opened without following a link,
and every later read, write, rename, fsync and delete in it made relative to that descriptor,
with O_NOFOLLOW on each component: never a path string resolved again.

Root patches trees that others own (the security model lets root make a user's venv its own).
A check by path and a use by path are two lookups, and a user who owns a directory on the way
can swap it for a symbolic link between them (an inotify wake-up, then
renameat2(RENAME_EXCHANGE)): root then writes whatever the link names. Here the root is opened
once, one component at a time from `/` (as systemd's chase() and CPython's `shutil.rmtree` fd
walk do), and each file is reached from it the same way, so a link swapped in anywhere is a
refusal, not a redirection. `TreeHandle.verify` walks the path again and compares the device and
inode with the held root: a run refuses to go on once its path names another tree (git still
goes by path; the engine calls `verify` right before each git write). The state directory is
held the same way (`engine/statedir.py`, which uses `walk_dir`).

Below `targets/` (whose package init, which imports none of its own modules, makes the handle
when it finds a target); imports only `errors` and `safeio`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import TracebackType

from sm120patch.errors import Refused
from sm120patch.safeio import READ_LIMIT, read_regular

# The suffix of an atomic write's temp file (targets/files.py names them the same way), so
# that `remove_temps` finds what a killed write left.
TMP_SUFFIX = ".sm120patch-tmp"
# Bits a write never sets, whatever the file says: setuid, setgid, sticky, world-writable.
NEVER_SET = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR = os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC
# O_PATH: a directory we only pass through needs search permission, not read (Linux).
_SEARCH = getattr(os, "O_PATH", os.O_RDONLY)


class TreeMoved(Refused):
    """The path a target was found at names another tree now (a component swapped for a
    symbolic link or another directory): nothing more is written through it."""


class LinkInTree(Refused):
    """A directory inside the tree is a symbolic link: never followed."""


def _kind(parent: int, name: str) -> str:
    """What stands at `name` in `parent`, for a message."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return "gone"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    return "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"


def _open_dir(name: str, parent: int | None, *, readable: bool) -> int:
    """`name` in `parent` opened as a directory, never through a link at `name`; `readable`
    (the tree's own directories: listed, fsync-ed) falls back to a search-only descriptor
    where reading is not allowed."""
    if not readable:
        return os.open(name, _DIR | _SEARCH, dir_fd=parent)
    try:
        return os.open(name, _DIR | os.O_RDONLY, dir_fd=parent)
    except PermissionError:
        if _SEARCH == os.O_RDONLY:
            raise
        return os.open(name, _DIR | _SEARCH, dir_fd=parent)


def _walk(path: Path) -> tuple[int, str | None]:
    """The directory at the absolute `path`, opened one component at a time from `/` with
    O_NOFOLLOW; (-1, why) naming the first component that is not a plain directory."""
    fd = os.open("/", _DIR | (os.O_RDONLY if len(path.parts) == 1 else _SEARCH))
    parts = path.parts[1:]
    for i, part in enumerate(parts):
        try:
            nxt = _open_dir(part, fd, readable=i == len(parts) - 1)
        except OSError as exc:
            here = Path("/", *parts[: i + 1])
            why = (
                f"{here} is {_kind(fd, part)}"
                if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT)
                else f"{here} cannot be opened ({exc.strerror})"
            )
            os.close(fd)
            return -1, why
        old, fd = fd, nxt  # held before the close, as in `_parent`
        os.close(old)
    return fd, None


def write_at(
    dir_fd: int,
    name: str,
    data: bytes,
    mode: int,
    *,
    owner: tuple[int, int] | None = None,
    durable: bool = True,
) -> None:
    """The one atomic writer (targets, state, caches, outputs): `data` at `name` in the
    directory held by `dir_fd`, so that a kill leaves the old file or the new one, never half.
    A temp file is made beside it through the descriptor (O_CREAT|O_EXCL|O_NOFOLLOW, 0600,
    named for `remove_temps`), written, fsync-ed, given `owner` (uid, gid; when root writes)
    and `mode`'s permission bits less `NEVER_SET`, renamed over `name` through the descriptor
    (a link at `name` is replaced, never written through), then the directory fsync-ed.
    `durable=False` skips both fsyncs (the rename stays atomic): for what can be rebuilt."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    while True:
        tmp = f".{name}.{os.urandom(6).hex()}{TMP_SUFFIX}"
        try:
            out = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:  # 48 random bits: a clash is a stale temp of that very name
            continue
    try:
        with os.fdopen(out, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
            if owner is not None and os.geteuid() == 0:
                os.fchown(fh.fileno(), *owner)
            os.fchmod(fh.fileno(), stat.S_IMODE(mode) & ~NEVER_SET)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    if durable:
        try:
            os.fsync(dir_fd)
        except OSError as exc:
            # A search-only descriptor (O_PATH: no read permission on the directory) cannot
            # be fsync-ed; the rename stands.
            if exc.errno not in (errno.EBADF, errno.EINVAL):
                raise


def walk_dir(path: Path) -> tuple[int, str | None]:
    """`_walk` for the state directory's holder (`engine/statedir.py`): the same rule, one
    implementation."""
    return _walk(path)


def first_link(path: Path) -> tuple[Path, str] | None:
    """The first component of the absolute `path` that is a symbolic link, and where it
    points, looked at one directory at a time from `/` without following any link; None when
    there is none up to the first component that is missing or not a directory."""
    fd = os.open("/", _DIR | _SEARCH)
    try:
        for i, part in enumerate(path.parts[1:]):
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return None
            if stat.S_ISLNK(st.st_mode):
                return Path("/", *path.parts[1 : i + 2]), os.readlink(part, dir_fd=fd)
            if not stat.S_ISDIR(st.st_mode):
                return None
            try:
                nxt = os.open(part, _DIR | _SEARCH, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nxt
        return None
    finally:
        os.close(fd)


class TreeHandle:
    """A target's root directory, held open from the moment the target is found, with its
    device, inode and owner; every file of the tree is reached from it (see the module)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(os.path.abspath(root))  # as found (`targets.finding.find` resolved it)
        self.fd = -1
        fd, why = _walk(self.path)
        if why is not None:
            linked = why.endswith("a symbolic link")
            raise Refused(
                f"{self.path}: {why}"
                + ("; sm120patch opens a target without following a link" if linked else ""),
                "give the path the link points to, then run sm120patch again" if linked
                else f"check {self.path} (its directories, their permissions), then run again",
            )
        self.fd = fd
        st = os.fstat(fd)
        self.dev, self.ino, self.uid = st.st_dev, st.st_ino, st.st_uid

    def close(self) -> None:
        fd, self.fd = self.fd, -1  # forgotten before it is closed: never closed twice
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> TreeHandle:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TreeHandle({str(self.path)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # A descriptor is this process's: a copy would close it twice, a pickle in another
        # process would name one of its own.
        raise TypeError("a TreeHandle holds this process's descriptor: it is not copied")

    # ---- is it still the tree the path names? ----------------------------------------
    def moved(self) -> str | None:
        """Why the path no longer names the held tree (walked again, O_NOFOLLOW on each
        component), or None."""
        fd, why = _walk(self.path)
        if why is not None:
            return why
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return f"{self.path} is another directory"
        return None

    def verify(self) -> None:
        """Refuse (TreeMoved, one line) when the path names another tree than the one held:
        before anything is written by path (state, git) or through the handle."""
        why = self.moved()
        if why is not None:
            raise TreeMoved(
                f"{self.path} was replaced while sm120patch worked on it ({why} now); "
                "nothing was written through the new path",
                f"find out who changes {self.path}, then run sm120patch again",
            )

    def where_now(self) -> Path | None:
        """Where the held tree is now (it may have been renamed aside), when the system says."""
        try:
            now = os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:
            return None
        return None if now.endswith(" (deleted)") else Path(now)

    # ---- reaching a file ---------------------------------------------------------------
    def shown(self, rel: str) -> Path:
        """`rel`'s path, for messages only (never opened)."""
        return self.path / rel

    def _parts(self, rel: str) -> tuple[str, ...]:
        p = PurePosixPath(rel)
        if "\0" in rel or p.is_absolute() or ".." in p.parts or not p.parts:
            raise Refused(
                f"the path '{rel}' is not a plain relative path inside {self.path}",
                "the state file was edited or is corrupt; inspect it, then remove it",
            )
        return p.parts

    @contextmanager
    def _parent(self, rel: str) -> Iterator[tuple[int, str]]:
        """The directory holding `rel` (a descriptor, its components opened from the root
        with O_NOFOLLOW) and `rel`'s last name. A link on the way is refused in one line; a
        missing directory raises FileNotFoundError, a file on the way NotADirectoryError."""
        parts = self._parts(rel)
        fd = self.fd
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    nxt = _open_dir(part, fd, readable=True)
                except NotADirectoryError:
                    if _kind(fd, part) == "a symbolic link":
                        shown = self.path.joinpath(*parts[: i + 1])
                        raise LinkInTree(
                            f"{shown} is a symbolic link; sm120patch follows no link inside "
                            "a target",
                            f"replace {shown} by the directory itself, then run sm120patch again",
                        ) from None
                    raise
                # The new descriptor is held before the old one is closed: a Ctrl-C handled
                # right after a close returned must not leave `fd` naming it, or the finally
                # below closes it twice (EBADF, or another file's reused number).
                old, fd = fd, nxt
                if old != self.fd:
                    os.close(old)
            yield fd, parts[-1]
        finally:
            if fd != self.fd:
                os.close(fd)

    def lstat(self, rel: str) -> os.stat_result | None:
        """What is at `rel` itself (a link is not followed); None when nothing is."""
        try:
            with self._parent(rel) as (fd, name):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, rel: str) -> bool:
        return self.lstat(rel) is not None

    def is_regular(self, rel: str) -> bool:
        st = self.lstat(rel)
        return st is not None and stat.S_ISREG(st.st_mode)

    def read(self, rel: str, *, limit: int = READ_LIMIT) -> bytes:
        """The bytes of the regular file at `rel`, by `safeio.read_regular`'s rules (no link
        at its name, no FIFO, device or socket, at most `limit` bytes), judged on the file
        opened: FileNotFoundError, NotADirectoryError, IsADirectoryError as `read_bytes`."""
        with self._parent(rel) as (fd, name):
            return read_regular(self.shown(rel), limit=limit, at=(fd, name))

    def sha256(self, rel: str) -> str | None:
        """The sha256 of the file at `rel`; None when there is no file (or a directory)."""
        import hashlib

        try:
            return hashlib.sha256(self.read(rel)).hexdigest()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def writable(self, directory: str) -> bool:
        """Whether this process may create and rename entries in the tree's directory
        `directory` ("." the root)."""
        if directory in ("", "."):
            return os.access(".", os.W_OK | os.X_OK, dir_fd=self.fd)
        try:
            with self._parent(directory) as (fd, name):
                sub = _open_dir(name, fd, readable=False)
                try:
                    return os.access(".", os.W_OK | os.X_OK, dir_fd=sub)
                finally:
                    os.close(sub)
        except OSError:
            return False

    # ---- writing ------------------------------------------------------------------------
    def replace(self, rel: str, data: bytes) -> None:
        """Write `data` over the regular file at `rel`, atomically: a temp file made in the
        same directory (O_CREAT|O_EXCL|O_NOFOLLOW, 0600, through the directory's descriptor),
        written, fsync-ed, given the old file's owner (when root writes) and permission bits
        (never setuid, setgid, sticky or world-writable), renamed over the name, then the
        directory fsync-ed. A file that is not there is never created; a link or anything but
        a regular file at the name is refused."""
        shown = self.shown(rel)
        with self._parent(rel) as (fd, name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise Refused(
                    f"{shown} does not exist (deleted?); sm120patch never creates a file in a "
                    "target",
                    "reinstall the release (or check the file out again), then run sm120patch "
                    "again",
                ) from None
            if not stat.S_ISREG(st.st_mode):
                raise Refused(
                    f"{shown} is not a regular file; sm120patch writes regular files only",
                    "replace it by the release's file, then run sm120patch again",
                )
            write_at(fd, name, data, st.st_mode, owner=(st.st_uid, st.st_gid))

    def unlink(self, rel: str) -> None:
        """Remove the entry at `rel` (a link is removed itself); nothing there is fine."""
        try:
            with self._parent(rel) as (fd, name):
                os.unlink(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            pass

    def _names(self, fd: int) -> list[str]:
        try:
            return os.listdir(fd)
        except OSError:
            return []  # a search-only descriptor: nothing of ours can be listed there

    def drop_pycache(self, rel: str) -> None:
        """Stale bytecode of a module rewritten must not outlive it: `__pycache__/<stem>.*.pyc`
        next to `rel`, removed through the directory's descriptor (a link there is left)."""
        stem = PurePosixPath(rel).stem
        try:
            with self._parent(rel) as (fd, _):
                try:
                    cache = _open_dir("__pycache__", fd, readable=True)
                except (FileNotFoundError, NotADirectoryError):
                    return
                try:
                    for entry in self._names(cache):
                        if entry.startswith(f"{stem}.") and entry.endswith(".pyc"):
                            try:
                                os.unlink(entry, dir_fd=cache)
                            except (FileNotFoundError, IsADirectoryError, PermissionError):
                                pass
                finally:
                    os.close(cache)
        except (FileNotFoundError, NotADirectoryError, LinkInTree):
            pass  # nothing is ever written behind a link: no bytecode of ours is there

    def remove_temps(self, rel: str) -> None:
        """Remove the temp files a killed write of `rel` may have left next to it."""
        name = PurePosixPath(rel).name
        try:
            with self._parent(rel) as (fd, _):
                for entry in self._names(fd):
                    if entry.startswith(f".{name}.") and entry.endswith(TMP_SUFFIX):
                        try:
                            os.unlink(entry, dir_fd=fd)
                        except (FileNotFoundError, IsADirectoryError, PermissionError):
                            pass
        except (FileNotFoundError, NotADirectoryError, LinkInTree):
            pass  # nothing is ever written behind a link: no temp of ours is there
