"""A target's state directory held like its tree: opened once, one component at a time without
following a link, and every later read, write, rename, unlink and removal in it made relative
to that descriptor.

Root writes the state of trees that others own, in directories they own (`.sm120patch` in
their site-packages, `sm120patch` in their git directory). A path looked up twice is two
lookups, and the owner can swap a directory on it between them: root's chmod or chown of a
directory it just made would land on whatever a link there names, and a revert's last removals
on another tree's state. Here:

- the anchor (the site-packages or the git directory) is reached from the tree's own handle
  where it is the tree or in it, else walked from `/` with O_NOFOLLOW on each component;
- each state directory missing is made with `mkdir` relative to its held parent (mode 0700
  until checked), opened O_DIRECTORY|O_NOFOLLOW, and checked on the descriptor: the same
  device as its parent, owned by this process, empty. Only then is it `fchmod`-ed and
  `fchown`-ed; a directory that was already there is judged (its owner and mode) and never
  changed;
- the held directory's path is walked again before each write and removal (`verify`): once it
  names another directory, nothing more is written or removed (`TreeMoved`);
- files are written as the tree's are (a temp made O_CREAT|O_EXCL|O_NOFOLLOW in the held
  directory, fsync, rename relative to it) and trees removed by a descriptor walk as CPython's
  `shutil.rmtree` does (no link is ever followed; no recursion);
- the lock is made O_CREAT|O_EXCL|O_NOFOLLOW; one already there is used only when it is a
  regular file with one link, mode 0600 and the target's owner's, and is never
  `fchown`-ed or `fchmod`-ed.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Concatenate, ParamSpec, TypeVar

from sm120patch.engine import interrupts
from sm120patch.errors import Refused, not_writable
from sm120patch.handle import TMP_SUFFIX, TreeHandle, TreeMoved, walk_dir, write_at
from sm120patch.safeio import read_regular

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC | os.O_RDONLY
LOCK = "lock"
LOCK_MODE = 0o600

# Raises (Refused) for an entry of the state that anyone but the target's owner could have
# written: `store.TargetState` says which, and the fix.
Judge = Callable[[Path, os.stat_result], None]


@dataclass(frozen=True)
class Making:
    """How a directory this run makes is set: its mode, its owner (root makes it the target
    owner's), and the judge of one found there already."""

    mode: int
    owner: tuple[int, int]
    judge: Judge


def _in_the_way(shown: Path, parent: int, name: str) -> Refused:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    except OSError:
        what = "gone"
    if what == "a symbolic link":
        what += ": state is never read or written through one, which could lead outside"
    return Refused(
        f"{shown} is in the way of sm120patch's state directory ({what})",
        f"move {shown} aside, then run sm120patch again",
    )


def uncreatable(path: Path, reason: str | None) -> Refused:
    return not_writable("cannot create sm120patch's state directory", path, reason)


def unopenable(path: Path, reason: str | None) -> Refused:
    return not_writable("cannot open the lock", path, reason)


P = ParamSpec("P")
R = TypeVar("R")


def _released(
    method: Callable[Concatenate[StateDir, P], R],
) -> Callable[Concatenate[StateDir, P], R]:
    """What `method` opened is closed at its end, unless the directory is held (`holding`)."""

    @functools.wraps(method)
    def inner(self: StateDir, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._done()

    return inner


class StateDir:
    """`<anchor>/<top>/<kind>`, held open once found or made (see the module)."""

    def __init__(self, directory: Path, tree: TreeHandle | None = None) -> None:
        self.path = directory
        self.anchor = directory.parent.parent
        self.names = (directory.parent.name, directory.name)
        self._tree = tree
        self._anchor_fd = -1
        self._anchor_st: os.stat_result | None = None
        self.fds: list[int] = []  # the top directory and the state directory, once held
        self.dev = self.ino = 0
        # Held across calls only within `holding` (a locked run): outside it each call opens
        # what it needs and closes it, so no descriptor in a git directory outlives a command
        # (a process holding one there reads as a git command still running).
        self.keep = False

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the directory from its first opening to the end of the block."""
        kept = self.keep
        self.keep = True
        try:
            yield
        finally:
            self.keep = kept
            if not kept:
                self.close()

    def _done(self) -> None:
        if not self.keep:
            self.close()

    @property
    def fd(self) -> int:
        return self.fds[-1] if self.fds else -1

    def close(self) -> None:
        for fd in (*self.fds, self._anchor_fd):
            if fd >= 0:
                os.close(fd)
        self.fds, self._anchor_fd = [], -1

    # ---- the anchor ---------------------------------------------------------------------
    def _anchor(self) -> int:
        """The anchor's descriptor: from the tree's handle when the anchor is the tree or a
        directory of it (`.git`), else walked from `/`; -1 when it is not there."""
        if self._anchor_fd >= 0:
            return self._anchor_fd
        tree = self._tree
        fd = -1
        if tree is not None and tree.fd >= 0 and self.anchor == tree.path:
            fd = os.dup(tree.fd)
        elif tree is not None and tree.fd >= 0 and self.anchor.parent == tree.path:
            try:
                fd = os.open(self.anchor.name, _DIR, dir_fd=tree.fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _in_the_way(self.anchor, tree.fd, self.anchor.name) from None
                return -1
        else:
            fd, why = walk_dir(self.anchor)
            if why is not None:
                if why.endswith("a symbolic link"):
                    raise Refused(
                        f"{self.anchor}: {why}; sm120patch reaches a state directory without "
                        "following a link",
                        "give the path the link points to, then run sm120patch again",
                    )
                return -1
        self._anchor_fd = fd
        self._anchor_st = os.fstat(fd)
        return fd

    def anchor_stat(self) -> os.stat_result | None:
        """The anchor's stat (owner, mode, device), from its descriptor when first asked;
        None when absent. Closes nothing that is in use (a judge asks mid-walk)."""
        if self._anchor_st is None:
            try:
                self._anchor()
            except (OSError, Refused):
                return None
            if not self.keep and not self.fds and self._anchor_fd >= 0:
                os.close(self._anchor_fd)
                self._anchor_fd = -1
        return self._anchor_st

    # ---- opening and making ---------------------------------------------------------------
    def _child(self, parent: int, name: str, shown: Path, making: Making | None) -> int:
        """`name` in `parent`, opened O_DIRECTORY|O_NOFOLLOW, made first with `making`
        (FileNotFoundError when it is not there and nothing is to be made)."""
        made = False
        if making is not None:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)  # 0700 until it is checked below
                made = True
            except FileExistsError:
                pass  # there already (or made by a concurrent run): judged below
            except OSError as exc:
                raise uncreatable(shown, exc.strerror) from None
            interrupts.hook("state-made")  # tests: a swap between the mkdir and the open
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if made:
                raise self._replaced(shown) from None
            raise
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _in_the_way(shown, parent, name) from None
            raise Refused(f"cannot read {shown} ({exc.strerror})") from None
        try:
            st, pst = os.fstat(fd), os.fstat(parent)
            if made:
                # The directory opened is the one just made only if it is this process's,
                # empty, and on its parent's device: a swap between mkdir and open is refused
                # before a bit of it is changed.
                if st.st_uid != os.geteuid() or st.st_dev != pst.st_dev or os.listdir(fd):
                    raise self._replaced(shown)
                assert making is not None
                os.fchmod(fd, making.mode)  # mkdir's mode passes through the umask
                if os.geteuid() == 0:
                    os.fchown(fd, *making.owner)  # root makes the state the target owner's
            else:
                if st.st_dev != pst.st_dev:
                    raise Refused(
                        f"{shown} is on another filesystem than {shown.parent}; sm120patch's "
                        "state stays on its target's",
                        f"move {shown} aside, then run sm120patch again",
                    )
                if making is not None:
                    making.judge(shown, st)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _replaced(self, shown: Path) -> Refused:
        return Refused(
            f"{shown} was replaced while sm120patch made it; nothing was written in it",
            f"find out who changes {shown.parent}, then run sm120patch again",
        )

    def open(self, making: Making | None = None) -> int:
        """The state directory's descriptor, held from the first call on; made (with its top
        directory) under `making`. FileNotFoundError when it is not there and not made."""
        if self.fds:
            return self.fds[-1]
        parent = self._anchor()
        if parent < 0:
            if making is not None:
                raise uncreatable(self.anchor, os.strerror(errno.ENOENT))
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.anchor))
        fds: list[int] = []
        try:
            for i, name in enumerate(self.names):
                shown = self.anchor.joinpath(*self.names[: i + 1])
                fds.append(self._child(parent, name, shown, making))
                parent = fds[-1]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.fds = fds
        st = os.fstat(fds[-1])
        self.dev, self.ino = st.st_dev, st.st_ino
        return fds[-1]

    def held_stats(self) -> list[tuple[Path, os.stat_result]]:
        """The top directory and the state directory as held, for judging."""
        return [(self.anchor.joinpath(*self.names[: i + 1]), os.fstat(fd))
                for i, fd in enumerate(self.fds)]

    @_released
    def entries(self) -> list[tuple[Path, os.stat_result]]:
        """Every entry below the held directory (links not followed, none gone into), by a
        descriptor walk: for judging who could have written them."""
        out: list[tuple[Path, os.stat_result]] = []
        stack = [(os.dup(self.open()), self.path)]
        while stack:
            fd, shown = stack.pop()
            try:
                with os.scandir(fd) as found:
                    items = [(e.name, e.stat(follow_symlinks=False)) for e in found]
            except OSError:
                items = []
            for name, st in items:
                out.append((shown / name, st))
                if stat.S_ISDIR(st.st_mode):
                    try:
                        stack.append((os.open(name, _DIR, dir_fd=fd), shown / name))
                    except OSError:
                        pass  # swapped meanwhile: what stands there now is met when used
            os.close(fd)
        return out

    @_released
    def top_stat(self) -> os.stat_result | None:
        """The top directory's entry (never followed) when the state directory is not held."""
        parent = self._anchor()
        if parent < 0:
            return None
        try:
            return os.stat(self.names[0], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return None

    @_released
    def uncreatable(self) -> Path | None:
        """The first missing directory of the state when this process could not make it (a
        dry run's preflight), or None."""
        parent = self._anchor()
        if parent < 0:
            return self.anchor
        fds: list[int] = []
        try:
            for i, name in enumerate(self.names):
                try:
                    fds.append(os.open(name, _DIR, dir_fd=parent))
                except FileNotFoundError:
                    if os.access(".", os.W_OK | os.X_OK, dir_fd=parent):
                        return None
                    return self.anchor.joinpath(*self.names[: i + 1])
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        shown = self.anchor.joinpath(*self.names[: i + 1])
                        raise _in_the_way(shown, parent, name) from None
                    return self.anchor.joinpath(*self.names[: i + 1])
                parent = fds[-1]
            return None
        finally:
            for fd in fds:
                os.close(fd)

    # ---- is it still the directory its path names? ---------------------------------------
    def verify(self) -> None:
        """Refuse (TreeMoved, one line) when the path names another directory than the one
        held: before every write and removal."""
        if not self.fds:
            return
        fd, why = walk_dir(self.path)
        if why is None:
            st = os.fstat(fd)
            os.close(fd)
            if (st.st_dev, st.st_ino) != (self.dev, self.ino):
                why = f"{self.path} is another directory"
        if why is not None:
            raise TreeMoved(
                f"{self.path} was replaced while sm120patch worked on it ({why} now); "
                "nothing was written through the new path",
                f"find out who changes {self.path}, then run sm120patch again",
            )

    # ---- reaching a file -------------------------------------------------------------------
    def _parts(self, rel: str) -> tuple[str, ...]:
        p = PurePosixPath(rel)
        if "\0" in rel or p.is_absolute() or ".." in p.parts or not p.parts:
            raise Refused(
                f"state names the path '{rel}', which is outside its target",
                "the state file was edited or is corrupt; inspect it, then remove it",
            )
        return p.parts

    def _dir_of(self, parts: tuple[str, ...], making: Making | None) -> int:
        """A new descriptor of the directory `parts` below the held one (made under
        `making`); FileNotFoundError or NotADirectoryError when it is not there."""
        fd = os.dup(self.open(making))
        try:
            for i, part in enumerate(parts):
                shown = self.path.joinpath(*parts[: i + 1])
                nxt = self._child(fd, part, shown, making)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    @_released
    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.open(), follow_symlinks=False)
        except OSError:
            return False
        return True

    @_released
    def read(self, rel: str, owners: tuple[int, ...]) -> bytes:
        """The bytes of the regular file at `rel` (`safeio.read_regular`'s rules, owned by one
        of `owners`); FileNotFoundError when it or a directory on the way is not there."""
        parts = self._parts(rel)
        fd = self._dir_of(parts[:-1], None)
        try:
            return read_regular(self.path / rel, owners=owners, at=(fd, parts[-1]))
        finally:
            os.close(fd)

    @_released
    def write(self, rel: str, data: bytes, mode: int, making: Making, *, durable: bool) -> None:
        """Write `data` at `rel` atomically (see the module), the file given `mode` and, when
        root writes, the target owner; directories on the way made under `making`."""
        self.verify()
        parts = self._parts(rel)
        fd = self._dir_of(parts[:-1], making)
        try:
            # The owner: made by this run, ours to give (`handle.write_at`, the one writer).
            write_at(fd, parts[-1], data, mode, owner=making.owner, durable=durable)
        finally:
            os.close(fd)

    @_released
    def unlink(self, name: str, *, durable: bool = True) -> None:
        """Remove the entry `name` of the held directory (a link is removed itself)."""
        try:
            fd = self.open()
        except FileNotFoundError:
            return
        self.verify()
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return
        if durable:
            try:
                os.fsync(fd)
            except OSError:
                pass

    @_released
    def remove_temps(self, names: tuple[str, ...]) -> None:
        """Remove the temp files a killed write of any of `names` left in the held directory."""
        try:
            fd = self.open()
        except FileNotFoundError:
            return
        self.verify()
        for entry in os.listdir(fd):
            if entry.endswith(TMP_SUFFIX) and any(entry.startswith(f".{n}.") for n in names):
                try:
                    os.unlink(entry, dir_fd=fd)
                except (FileNotFoundError, IsADirectoryError, PermissionError):
                    pass

    @_released
    def remove_tree(self, name: str) -> None:
        """Remove `name` (a directory of the held one) and everything in it, by descriptors:
        each directory opened O_NOFOLLOW relative to its parent, each entry unlinked relative
        to its directory, a link removed itself, never followed; errors are passed over (what
        stays is met by the next run), a replaced state directory is not (`verify`)."""
        try:
            top = self.open()
        except FileNotFoundError:
            return
        self.verify()
        _remove_tree(top, name)

    # ---- the lock ---------------------------------------------------------------------------
    def open_lock(self, owner: tuple[int, int], making: Making) -> int:
        """The lock's descriptor (read-write), made O_CREAT|O_EXCL|O_NOFOLLOW when absent (then
        0600 and, when root makes it, the target owner's); one already there is used only as
        this tool would have made it (see `check_lock`), never changed."""
        fd_dir = self.open(making)
        self.verify()
        shown = self.path / LOCK
        flags = os.O_RDWR | os.O_NOFOLLOW | _CLOEXEC
        try:
            fd = os.open(LOCK, flags | os.O_CREAT | os.O_EXCL, LOCK_MODE, dir_fd=fd_dir)
        except FileExistsError:
            fd = -1
        except OSError as exc:
            raise unopenable(shown, exc.strerror) from None
        if fd >= 0:
            try:
                os.fchmod(fd, LOCK_MODE)  # made by this run: O_CREAT's mode passed the umask
                if os.geteuid() == 0:
                    os.fchown(fd, *owner)
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            fd = os.open(LOCK, flags | os.O_NONBLOCK, dir_fd=fd_dir)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _in_the_way(shown, fd_dir, LOCK) from None
            raise unopenable(shown, exc.strerror) from None
        try:
            self.check_lock(os.fstat(fd), owner[0])
        except BaseException:
            os.close(fd)
            raise
        os.set_blocking(fd, True)
        return fd

    def check_lock(self, st: os.stat_result, uid: int) -> None:
        """Refuse a lock file this tool would not have made: not a regular file, more than one
        link (a hard link to another file: fchown-ing it would give that file away), another
        owner than the target's (root makes it theirs), another mode than 0600."""
        shown = self.path / LOCK
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_nlink != 1:
            problem = f"{st.st_nlink} links to one file: a hard link"
        elif st.st_uid != uid:
            from sm120patch.safeio import user_name

            problem = f"owned by {user_name(st.st_uid)}"
        elif stat.S_IMODE(st.st_mode) != LOCK_MODE:
            problem = f"mode {stat.S_IMODE(st.st_mode):o}, not {LOCK_MODE:o}"
        if problem is not None:
            raise Refused(
                f"{shown} is not a lock sm120patch made ({problem}); it is never used nor changed",
                f"move {shown} aside (and check what it is), then run sm120patch again",
            )


def _remove_tree(parent: int, name: str) -> None:
    """`name` in `parent` removed with everything below it, one held directory at a time
    (a loop, not a recursion: a deep tree is no deeper a stack)."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _quiet(os.unlink, name, parent)  # a link or a file: removed itself
        return
    # (parent, directory, its name, the directories below it already gone into)
    stack: list[tuple[int, int, str, set[str]]] = [(parent, fd, name, set())]
    try:
        while stack:
            up, here, its_name, entered = stack[-1]
            deeper = -1
            try:
                with os.scandir(here) as entries:
                    found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            except OSError:
                found = []
            for entry, is_dir in found:
                if not is_dir:
                    _quiet(os.unlink, entry, here)
                    continue
                if entry in entered:
                    continue  # gone into once and still there: left (not removable)
                entered.add(entry)
                try:
                    deeper = os.open(entry, _DIR, dir_fd=here)
                except OSError:
                    _quiet(os.unlink, entry, here)  # swapped for a link meanwhile
                    continue
                stack.append((here, deeper, entry, set()))
                break
            if deeper >= 0:
                continue
            stack.pop()
            os.close(here)
            _quiet(os.rmdir, its_name, up)
    finally:
        for _, here, _, _ in stack:
            os.close(here)


def _quiet(fn: Callable[..., object], name: str, fd: int) -> None:
    try:
        fn(name, dir_fd=fd)
    except OSError:
        pass
