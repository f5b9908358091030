"""Where state is written: manifest, journal, pristine copies and the lock of one target.

A target's state lives with the target, shared by everyone who can write it: for a git checkout
in its git directory (`.git/sm120patch/<kind>/`), for an installed package beside it in its
site-packages (`<site-packages>/.sm120patch/<kind>/`). Layout of that directory:

    manifest.json   what is applied: profile, patches, files with hashes, version, git base
    journal.json    an apply or revert in progress (exists only while one runs or was killed)
    trials.json     every trial run on this target, kept across reverts
    pristine/       the bytes of every touched file before the apply (installed packages)
    patched/        the bytes we wrote, to show a user's later edits as a diff
    lock            one sm120patch run per target (an OS lock: a killed run releases it)

Every write is atomic (temp file in the same directory, fsync, rename). State files carry a
schema number; a newer one than this tool knows is refused, never misread. The documents are
read into typed records (`Manifest`, `Journal`) after their shape is checked. State written by
sm120patch 0.1.0 in the user's state directory is read there and moved on the next locked run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sm120patch.engine.records import (
    SCHEMA,
    Journal,
    Manifest,
    check_journal,
    check_manifest,
    check_trials,
)
from sm120patch.errors import Refused
from sm120patch.targets import files

MANIFEST = "manifest.json"
JOURNAL = "journal.json"
TRIALS = "trials.json"
STATE_DIRNAME = ".sm120patch"
LEGACY_ENV = "SM120PATCH_STATE_DIR"


def state_dir_for(root: Path, layout: str, kind: str) -> Path:
    """The state directory of the `kind` target at `root`, shared by everyone who can write it.

    One per kind: SGLang and FlashInfer installed in the same site-packages (or kept in one
    repository) are two targets. A checkout keeps it in its git directory, so the work tree
    stays clean; an installed package keeps it beside itself in its site-packages, in a
    directory whose name is not an importable identifier and that no wheel's RECORD lists, so
    pip's install and uninstall leave it alone and importers never see it. Whatever the user,
    HOME or environment, every run on one target finds the same state and the same lock.
    """
    if layout == "git":
        from sm120patch.targets import git

        return git.git_dir_of(root) / "sm120patch" / kind
    return root / STATE_DIRNAME / kind


_resolved: dict[str, Path] = {}


def legacy_state_dir_for(root: Path, kind: str) -> Path | None:
    """Where sm120patch 0.1.0 kept an installed target's state (per user), to migrate it."""
    override = os.environ.get(LEGACY_ENV)
    if override:
        # Resolved once per value, absolutely: a later change of directory must not move it.
        base = _resolved.setdefault(override, Path(override).absolute())
    elif sys.platform.startswith("linux"):
        # platformdirs' answer on Linux, without importing it on every status.
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "sm120patch"
    else:
        import platformdirs

        base = Path(platformdirs.user_state_dir("sm120patch"))
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return base / "targets" / f"{digest}-{kind}"


def shared_mode(anchor: Path) -> int:
    """The permission bits of a state directory: those of the directory it describes (the
    site-packages or the git directory), so that whoever can write the target can write its
    state and whoever can read it can read the state; never writable by others."""
    try:
        bits = stat.S_IMODE(anchor.stat().st_mode)
    except OSError:
        bits = 0o700
    return (bits | 0o700) & ~0o002


def state_dir(path: Path, mode: int, *, create: bool = True) -> None:
    """Make `path` (and any missing parent) a directory with `mode`; with `create` false,
    refuse exactly as making it would, creating nothing (a dry run's preflight).

    Refuses, with what to do, when something that is not a directory is in the way, or when
    the directory is a symbolic link (state is never written through one).
    """
    # The level above a target's state (`.git/sm120patch`, `.sm120patch`) is ours too: a
    # link there would carry every write elsewhere just the same.
    if path.parent.is_symlink():
        raise Refused(
            f"{path.parent} is in the way of sm120patch's state directory (a symbolic link)",
            f"move {path.parent} aside, then run sm120patch again",
        )
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    if missing and not p.is_dir():
        path = p  # the file in the way is a parent: name it
    elif missing and not create:
        if not os.access(p, os.W_OK | os.X_OK):
            raise _uncreatable(missing[-1], os.strerror(errno.EACCES))
        return
    for d in reversed(missing if p.is_dir() else []):
        try:
            d.mkdir(mode=mode)
            os.chmod(d, mode)  # mkdir's mode passes through the umask
        except FileExistsError:  # made by a concurrent run: checked below
            pass
        except OSError as exc:
            raise _uncreatable(d, exc.strerror) from None
    if path.is_symlink() or not path.is_dir():
        what = "a symbolic link" if path.is_symlink() else "not a directory"
        raise Refused(
            f"{path} is in the way of sm120patch's state directory ({what})",
            f"move {path} aside, then run sm120patch again",
        )
    if not create:
        return
    now = stat.S_IMODE(path.stat().st_mode)
    if now & ~mode:
        try:
            os.chmod(path, now & mode)
        except PermissionError:
            pass  # another user's directory: its owner set it


def _uncreatable(path: Path, reason: str | None) -> Refused:
    return Refused(
        f"cannot create sm120patch's state directory {path} ({reason})",
        "run sm120patch as a user who can write the target",
    )


def _unopenable(path: Path, reason: str | None) -> Refused:
    return Refused(
        f"cannot open the lock {path} ({reason})",
        "run sm120patch as a user who can write the target",
    )


class TargetState:
    """The state directory of one target (and, read-only, where 0.1.0 kept it)."""

    @classmethod
    def of(cls, root: Path, layout: str, kind: str) -> TargetState:
        legacy = legacy_state_dir_for(root, kind) if layout == "installed" else None
        return cls(state_dir_for(root, layout, kind), root, legacy)

    def __init__(self, directory: Path, root: Path, legacy: Path | None = None) -> None:
        self.dir = directory
        self.root = root
        self.legacy = legacy if legacy is not None and legacy.is_dir() else None
        # The directory whose permissions the state takes: the site-packages, or .git.
        self.anchor = directory.parent.parent

    @property
    def dir_mode(self) -> int:
        return shared_mode(self.anchor)

    @property
    def file_mode(self) -> int:
        return self.dir_mode & 0o666

    # ---- lock -------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """One sm120patch run per target: an flock on `lock` in the target's state directory.

        An OS lock: a run killed while holding it releases it with its process, so a lock
        file left behind is never stale. (filelock did the same; its import alone was a tenth
        of every `ensure` at service start.)
        """
        import fcntl

        state_dir(self.dir, self.dir_mode)
        path = self.dir / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                         self.file_mode)  # fmt: skip
        except OSError as exc:
            raise _unopenable(path, exc.strerror) from None
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != self.file_mode:
                try:
                    # The umask changes what open() made: the lock is as shared as the state.
                    os.fchmod(fd, self.file_mode)
                except PermissionError:
                    pass  # another user's lock file: its owner set it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._held() from None
            try:
                self._migrate()
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _held(self) -> Refused:
        return Refused(
            f"another sm120patch run holds the lock on {self.root}",
            "wait for it to finish, then try again",
        )

    def check_lockable(self) -> None:
        """Refuse as `locked` would (the state directory in the way or not creatable, the lock
        file not openable, another run holding it), creating and locking nothing: the dry
        runs' preflight, so that a dry run refuses where its command would."""
        state_dir(self.dir, self.dir_mode, create=False)
        path = self.dir / "lock"
        if os.path.lexists(path):
            try:
                # Opened for writing as `locked` opens it, and closed at once: no byte written.
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                raise _unopenable(path, exc.strerror) from None
            os.close(fd)
        elif self.dir.is_dir() and not os.access(self.dir, os.W_OK | os.X_OK):
            raise _unopenable(path, os.strerror(errno.EACCES))
        self.check_unlocked()

    def check_unlocked(self) -> None:
        """Refuse, as `locked` would, while another run holds the lock; creates nothing."""
        import fcntl

        try:
            fd = os.open(self.dir / "lock", os.O_RDONLY)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._held() from None
        except OSError:
            pass
        finally:
            os.close(fd)

    def _migrate(self) -> None:
        """Move state written by sm120patch 0.1.0 (per user) to the target's own directory."""
        if self.legacy is None or any((self.dir / n).exists() for n in (MANIFEST, JOURNAL)):
            return
        for name in (MANIFEST, JOURNAL, TRIALS):
            old = self.legacy / name
            if old.is_file() and not old.is_symlink():
                doc = self._read_at(old)
                if doc is not None:
                    self._write(name, {k: v for k, v in doc.items() if k != "schema"})
        for kind in ("pristine", "patched"):
            for old in sorted((self.legacy / kind).rglob("*")):
                if old.is_file() and not old.is_symlink():
                    rel = old.relative_to(self.legacy / kind).as_posix()
                    self.keep_copy(kind, rel, old.read_bytes())
        import shutil  # here: every command passes this method, few have anything to move

        shutil.rmtree(self.legacy, ignore_errors=True)
        self.legacy = None

    # ---- json documents ----------------------------------------------------------------
    def _read(self, name: str) -> dict[str, Any] | None:
        doc = self._read_at(self.dir / name)
        if doc is None and self.legacy is not None and not (self.dir / name).exists():
            doc = self._read_at(self.legacy / name)
        return doc

    def _read_at(self, path: Path) -> dict[str, Any] | None:
        name = path.name
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise Refused(
                f"cannot read {path} ({exc.strerror})",
                "run sm120patch as a user who can read the target's state",
            ) from None
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
        problem = _CHECKS[name](doc)
        if problem:
            raise Refused(
                f"{path} is corrupt ({problem})",
                f"if no sm120patch run is going on, move it aside ({path}) and check the "
                "target's files with `sm120patch status`",
            )
        return dict(doc)

    def _write(self, name: str, doc: dict[str, Any]) -> None:
        doc = {"schema": SCHEMA, **doc}
        data = json.dumps(doc, indent=2, sort_keys=True).encode("utf-8") + b"\n"
        state_dir(self.dir, self.dir_mode)
        files.atomic_write(self.dir / name, data, mode=self.file_mode)

    def remove_temps(self) -> None:
        """Temp files of state writes a killed run left behind."""
        for name in (MANIFEST, JOURNAL, TRIALS):
            files.remove_temps(self.dir / name)

    def _remove(self, name: str) -> None:
        try:
            (self.dir / name).unlink()
        except FileNotFoundError:
            pass
        files.fsync_dir(self.dir)

    def manifest(self) -> Manifest | None:
        doc = self._read(MANIFEST)
        return None if doc is None else Manifest.from_doc(doc)

    def write_manifest(self, manifest: Manifest) -> None:
        self._write(MANIFEST, manifest.to_doc())

    def remove_manifest(self) -> None:
        self._remove(MANIFEST)

    def journal(self) -> Journal | None:
        doc = self._read(JOURNAL)
        return None if doc is None else Journal.from_doc(doc)

    def write_journal(self, journal: Journal) -> None:
        self._write(JOURNAL, journal.to_doc())

    def close_journal(self) -> None:
        # No fsync of the directory: an unlink lost to a crash leaves what a kill just before
        # it leaves (the journal next to the manifest of its txn), which `recover` finishes
        # (the kill-anywhere tests stop there).
        try:
            (self.dir / JOURNAL).unlink()
        except FileNotFoundError:
            pass

    def trials(self) -> list[dict[str, Any]]:
        doc = self._read(TRIALS)
        return [] if doc is None else list(doc.get("trials", []))

    def add_trial(self, trial: dict[str, Any]) -> None:
        self._write(TRIALS, {"trials": [*self.trials(), trial]})

    # ---- file copies -------------------------------------------------------------------
    def _copy_path(self, kind: str, rel: str, base: Path | None = None) -> Path:
        return files.inside(base or self.dir, f"{kind}/{files.safe_relpath(rel)}")

    def keep_copy(self, kind: str, rel: str, data: bytes) -> None:
        path = self._copy_path(kind, rel)
        state_dir(self.dir, self.dir_mode)
        for parent in reversed([p for p in path.parents if self.dir in p.parents]):
            state_dir(parent, self.dir_mode)
        # A pristine copy is what a revert restores from: durable. A patched copy only shows a
        # later edit as a diff (and a torn one shows as a larger diff, never a wrong restore).
        files.atomic_write(path, data, mode=self.file_mode, durable=kind == "pristine")

    def copy(self, kind: str, rel: str) -> bytes | None:
        for base in (self.dir, self.legacy):
            if base is None:
                continue
            try:
                return self._copy_path(kind, rel, base).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                continue
        return None

    def drop_copies(self) -> None:
        import shutil

        for kind in ("pristine", "patched"):
            shutil.rmtree(self.dir / kind, ignore_errors=True)


_CHECKS = {MANIFEST: check_manifest, JOURNAL: check_journal, TRIALS: check_trials}
