"""File primitives: hashes, atomic writes, paths read from state, and who may write a path.

A target's own files are read and written through its handle (`sm120patch.handle`), the same
way. Every write into a state directory, a cache or an output the user named is an atomic
replace (a temp file made with O_EXCL next to the name, fsync, rename): a kill leaves the old
file or the new one, and a symbolic link at the name is replaced, never followed. What the
tool trusts (its state, its caches, patch packs) must be writable by no one but the user it
runs as (or root): `untrusted_by` says why a path is not.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from sm120patch.errors import Refused, UsageError
from sm120patch.handle import TMP_SUFFIX, write_at  # one name for temps, one writer
from sm120patch.safeio import read_regular as read_regular  # where targets/ and above read files
from sm120patch.safeio import user_name, walk


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(
    path: Path,
    data: bytes,
    mode: int | None = None,
    *,
    durable: bool = True,
    owner: tuple[int, int] | None = None,
) -> None:
    """Write `data` to `path` so that a kill leaves either the old or the new file, never half.

    Sets `mode` (the old file's permission bits) when given, less `NEVER_SET`; `owner`
    (uid, gid), when given and this process may, is the new file's owner. `durable=False`
    skips the fsyncs (the rename stays atomic): for what can be rebuilt, such as caches and
    the diff copies. A symbolic link at `path` is replaced, never written through.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # The directory is opened once and written through (`handle.write_at`, the one writer);
    # one this user may write but not list is held search-only (its fsync is then skipped).
    flags = os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path.parent, flags | os.O_RDONLY)
    except PermissionError:
        fd = os.open(path.parent, flags | getattr(os, "O_PATH", os.O_RDONLY))
    try:
        write_at(fd, path.name, data, 0o600 if mode is None else mode, owner=owner, durable=durable)
    finally:
        os.close(fd)


def remove_temps(path: Path) -> None:
    """Remove the temp files a killed `atomic_write(path, ...)` may have left next to `path`."""
    import glob

    pattern = glob.escape(f".{path.name}.") + "*" + glob.escape(TMP_SUFFIX)
    for tmp in path.parent.glob(pattern):
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass


def safe_relpath(rel: str) -> PurePosixPath:
    """A path read from state must stay inside its target: no absolute path, no `..`."""
    if not isinstance(rel, str) or "\0" in rel or "\\" in rel:
        raise Refused(
            f"state names the path {rel!r}, which is not a plain relative path",
            "the state file was edited or is corrupt; inspect it, then remove it",
        )
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise Refused(
            f"state names the path '{rel}', which is outside its target",
            "the state file was edited or is corrupt; inspect it, then remove it",
        )
    return p


def inside(root: Path, rel: str) -> Path:
    """`root/rel`, refusing a path that leaves `root` (also through a symlink)."""
    path = root / safe_relpath(rel)
    real_root = root.resolve()
    real = path.resolve()
    if real != real_root and real_root not in real.parents:
        raise Refused(
            f"{path} resolves to {real}, outside the target {root}",
            "sm120patch does not write through links that leave the target",
        )
    return path


# ---- who may write a path -------------------------------------------------------------------
owner_name = user_name  # a user's name for a message (`alice`, or `uid 1234`)


def lax_entry(path: Path, st: os.stat_result, uids: tuple[int, ...]) -> str | None:
    """Why someone outside `uids` may change the entry itself (not through its parents)."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid not in uids:
        return f"{path} is owned by {user_name(st.st_uid)}"
    if stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def untrusted_by(
    path: Path, uid: int, *, tree: bool = False, owner_only: bool = False
) -> str | None:
    """Why someone other than `uid` (or root) could change what is at `path`, or None.

    The path itself and every directory above it must be owned by `uid` or root and writable
    by no one else; a directory above writable by others counts only with its sticky bit and
    a trusted owner (`/tmp`: nobody renames another's entry there). With `owner_only`, the
    path itself must be owned by `uid` (not root). With `tree`, so must every entry below it
    (symbolic links are refused there too). Paths that do not exist yet are judged by their
    nearest existing parent.
    """
    uids = (uid,) if owner_only else (uid, 0)
    trusted = (uid, 0)
    path = Path(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if st is not None:
        problem = lax_entry(path, st, uids)
        if problem:
            return problem
    for parent in path.parents:
        try:
            pst = os.lstat(parent)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{parent} cannot be read ({exc.strerror})"
        if stat.S_ISLNK(pst.st_mode):
            parent = Path(os.path.realpath(parent))
            problem = untrusted_by(parent, uid)
            if problem:
                return problem
            break  # the link's target was judged, with everything above it
        if pst.st_uid not in trusted:
            return f"{parent} is owned by {user_name(pst.st_uid)}"
        if stat.S_IMODE(pst.st_mode) & (stat.S_IWGRP | stat.S_IWOTH) and not (
            pst.st_mode & stat.S_ISVTX
        ):
            return f"{parent} is writable by its group or by others"
    if tree and st is not None and stat.S_ISDIR(st.st_mode):
        for top, dirs, names in walk(path):
            for name in [*dirs, *names]:
                entry = Path(top) / name
                try:
                    est = os.lstat(entry)
                except FileNotFoundError:
                    continue
                problem = lax_entry(entry, est, trusted)
                if problem:
                    return problem
    return None


# ---- outputs the user names (lock files, reports, exports, logs) ----------------------------
_PATH_ERRORS = {"ENOENT", "ENOTDIR", "EISDIR", "EACCES", "EPERM", "EROFS", "ELOOP", "ENAMETOOLONG"}


def output_error(path: Path, exc: OSError, what: str = "cannot write") -> Exception:
    """One line for an output that cannot be written: a bad path is a usage error (exit 2),
    anything else (a full disk) a refusal (exit 1)."""
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    reason = str(exc.strerror or exc)
    message = f"{what} {path} ({reason})"
    if name in _PATH_ERRORS:
        return UsageError(message, "give a path in a directory you can write", {"reason": reason})
    return Refused(
        message, "free some space (or fix the cause), then run the command again",
        {"reason": reason},
    )


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_output(path: Path | str, data: bytes | str) -> None:
    """Write a file the user named outside any target (`pin -o`, `trial show --html`,
    `--export`, `export -o`): by atomic replace, so a symbolic link at the name is replaced by
    the file, never followed; an existing regular file keeps its permission bits, a new one
    gets the umask's. One line (exit 2 for a bad path) when it cannot be written."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if st is not None and stat.S_ISREG(st.st_mode):
            mode = stat.S_IMODE(st.st_mode)
        else:
            mode = 0o666 & ~_umask()
        if not path.parent.is_dir():
            raise FileNotFoundError(2, "No such directory", str(path.parent))
        atomic_write(path, data, mode=mode)
    except OSError as exc:
        raise output_error(path, exc) from None


def append_output(path: Path | str) -> Any:
    """A file the user named, opened for appending (`--log`, the step trace): never through
    a symbolic link at its name, and only a regular file. One line when it cannot be."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO never blocks
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        import errno

        # ELOOP (O_NOFOLLOW), or EACCES from the kernel's protected_symlinks in a sticky /tmp.
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise UsageError(
                f"{path} is a symbolic link; sm120patch does not write through one",
                "give the path of a regular file",
                {"reason": "a symbolic link"},
            ) from None
        raise output_error(path, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(
            f"{path} is not a regular file",
            "give the path of a regular file",
            {"reason": "not a regular file"},
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def remove_entries(directory: Path, pattern: str) -> None:
    """Remove the files matching `pattern` in `directory`, a real directory (a symbolic link
    there is refused): nothing is deleted through a link, and a link matching is removed
    itself, never what it points to."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise Refused(
            f"{directory} is a symbolic link; sm120patch deletes nothing through one",
            f"remove the link {directory} or give another directory",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{directory} is not a directory", f"move {directory} aside")
    for old in directory.glob(pattern):
        try:
            ost = os.lstat(old)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(ost.st_mode):
            continue
        old.unlink()
