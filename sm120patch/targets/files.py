"""TODO: sm120patch.targets.files."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path, PurePosixPath

from sm120patch.errors import Refused

TMP_SUFFIX = ".sm120patch-tmp"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except (FileNotFoundError, IsADirectoryError):
        return None  # not the file we wrote: reported as such, never a traceback


def atomic_write(path: Path, data: bytes, mode: int | None = None, *, durable: bool = True) -> None:
    """Write `data` to `path` so that a kill leaves either the old or the new file, never half.

    Keeps `mode` (the old file's permission bits) when given. `durable=False` skips the fsyncs
    (the rename stays atomic): for what can be rebuilt, such as caches and the diff copies.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def _new_temp(path: Path) -> tuple[int, Path]:
    """A new file next to `path` named for `remove_temps`, as `tempfile.mkstemp` makes it
    (O_EXCL, mode 0600), without importing tempfile and shutil (2 ms on every command)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.parent / f".{path.name}.{os.urandom(6).hex()}{TMP_SUFFIX}"
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:  # 48 random bits: a clash is a stale temp of that very name
            continue


def drop_pycache(path: Path) -> None:
    """Stale bytecode of a module we rewrote must not outlive it."""
    cache = path.parent / "__pycache__"
    if cache.is_dir() and not cache.is_symlink():
        for pyc in cache.glob(f"{path.stem}.*.pyc"):
            try:
                pyc.unlink()
            except FileNotFoundError:
                pass


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
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
