"""Where state is written: manifest, journal, pristine copies and the lock of one target.

Layout of a target's state directory (`.git/sm120patch/` for a git target, the user's state
directory keyed by the target path for an installed one):

    manifest.json   what is applied: profile, patches, files with hashes, git base, trials
    journal.json    an apply or revert in progress (exists only while one runs or was killed)
    trials.json     every trial run on this target, kept across reverts
    pristine/       the bytes of every touched file before the apply
    patched/        the bytes we wrote, to show a user's later edits as a diff
    lock            one sm120patch run per target (an OS lock: a killed run releases it)

Every write is atomic (temp file in the same directory, fsync, rename). State files carry a
schema number; a newer one than this tool knows is refused, never misread.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from sm120patch.errors import Refused

SCHEMA = 1
MANIFEST = "manifest.json"
JOURNAL = "journal.json"
TRIALS = "trials.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except FileNotFoundError:
        return None


def state_dir_for(root: Path, layout: str) -> Path:
    if layout == "git":
        from sm120patch import vcs

        return vcs.git_dir_of(root) / "sm120patch"
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return user_state_dir() / "targets" / digest


def user_state_dir() -> Path:
    """State of installed (non-git) targets: $SM120PATCH_STATE_DIR, else the platform's."""
    override = os.environ.get("SM120PATCH_STATE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_state_dir("sm120patch"))


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` so that a kill leaves either the old or the new file, never half.

    Keeps `mode` (the old file's permission bits) when given.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".sm120patch-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
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
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
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


def safe_relpath(rel: str) -> PurePosixPath:
    """A path read from state must stay inside its target: no absolute path, no `..`."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise Refused(
            f"state names the path '{rel}', which is outside its target",
            "the state file was edited or is corrupt; inspect it, then remove it",
        )
    return p


class TargetState:
    """The state directory of one target."""

    def __init__(self, directory: Path, root: Path) -> None:
        self.dir = directory
        self.root = root

    # ---- lock -------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        import filelock

        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = filelock.FileLock(str(self.dir / "lock"), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise Refused(
                f"another sm120patch run holds the lock on {self.root}",
                "wait for it to finish, then try again",
            ) from None
        try:
            yield
        finally:
            lock.release()

    # ---- json documents ----------------------------------------------------------------
    def _read(self, name: str) -> dict[str, Any] | None:
        path = self.dir / name
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Refused(f"cannot read {path} ({exc.strerror})") from None
        try:
            doc = json.loads(raw.decode("utf-8"))
            schema = doc["schema"]
        except (ValueError, KeyError, TypeError):
            raise Refused(
                f"{path} is corrupt or truncated",
                f"if no sm120patch run is going on, move it aside ({path}) and check the "
                "target's files with `sm120patch status`",
            ) from None
        if not isinstance(schema, int) or schema > SCHEMA:
            raise Refused(
                f"{path} has schema {schema!r}; this sm120patch understands up to {SCHEMA}",
                "use the newer sm120patch that wrote it",
            )
        return doc

    def _write(self, name: str, doc: dict[str, Any]) -> None:
        doc = {"schema": SCHEMA, **doc}
        data = json.dumps(doc, indent=2, sort_keys=True).encode("utf-8") + b"\n"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.dir / name, data, mode=0o600)

    def _remove(self, name: str) -> None:
        try:
            (self.dir / name).unlink()
        except FileNotFoundError:
            pass
        _fsync_dir(self.dir)

    def manifest(self) -> dict[str, Any] | None:
        return self._read(MANIFEST)

    def write_manifest(self, doc: dict[str, Any]) -> None:
        self._write(MANIFEST, doc)

    def remove_manifest(self) -> None:
        self._remove(MANIFEST)

    def journal(self) -> dict[str, Any] | None:
        return self._read(JOURNAL)

    def write_journal(self, doc: dict[str, Any]) -> None:
        self._write(JOURNAL, doc)

    def close_journal(self) -> None:
        self._remove(JOURNAL)

    def trials(self) -> list[dict[str, Any]]:
        doc = self._read(TRIALS)
        return [] if doc is None else list(doc.get("trials", []))

    def add_trial(self, trial: dict[str, Any]) -> None:
        self._write(TRIALS, {"trials": [*self.trials(), trial]})

    # ---- file copies -------------------------------------------------------------------
    def _copy_path(self, kind: str, rel: str) -> Path:
        return self.dir / kind / safe_relpath(rel)

    def keep_copy(self, kind: str, rel: str, data: bytes) -> None:
        atomic_write(self._copy_path(kind, rel), data, mode=0o600)

    def copy(self, kind: str, rel: str) -> bytes | None:
        try:
            return self._copy_path(kind, rel).read_bytes()
        except FileNotFoundError:
            return None

    def drop_copies(self) -> None:
        import shutil

        for kind in ("pristine", "patched"):
            shutil.rmtree(self.dir / kind, ignore_errors=True)


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
