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

The directory is held by descriptor (`statedir.StateDir`): made, checked, written and removed
relative to it, never by a path looked up again. Every write is atomic (temp file in the same
directory, fsync, rename). State files carry a schema number; a newer one than this tool knows
is refused, never misread. The documents are
read into typed records (`Manifest`, `Journal`, `TrialRecord`) after their shape is checked.
State written by sm120patch 0.1.0 in the user's state directory is read there and moved on the
next locked run, when that directory is the running user's own.

State is evidence, never instruction, and it is trusted only as far as who may write it: the
state directory belongs to the target's owner (the owner of the site-packages or of the git
directory; root makes it theirs) and is writable by no one else. A run that writes (`locked`)
refuses, with the fix, a state directory that anyone else could have written, and the lock
file is readable and writable by its owner only, so only someone who may write the target
can hold it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import stat
import sys
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sm120patch import safeio
from sm120patch.engine.records import SCHEMA, Journal, Manifest, check_journal, check_manifest
from sm120patch.engine.statedir import LOCK, Making, StateDir, uncreatable, unopenable
from sm120patch.engine.trialrecord import TrialRecord, check_trials
from sm120patch.errors import NotWritable, Refused
from sm120patch.handle import TreeHandle
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


def shared_mode(anchor: os.stat_result | None) -> int:
    """The permission bits of a state directory: those of the directory it describes (the
    site-packages or the git directory) for reading, so whoever can read the target can read
    its state; writable by its owner only."""
    bits = 0o700 if anchor is None else stat.S_IMODE(anchor.st_mode)
    return (bits | 0o700) & 0o755


class TargetState:
    """The state directory of one target (and, read-only, where 0.1.0 kept it), held by its
    descriptor once found or made (`statedir.StateDir`)."""

    @classmethod
    def of(cls, root: Path, layout: str, kind: str, tree: TreeHandle | None = None) -> TargetState:
        legacy = legacy_state_dir_for(root, kind) if layout == "installed" else None
        return cls(state_dir_for(root, layout, kind), root, legacy, tree)

    def __init__(
        self,
        directory: Path,
        root: Path,
        legacy: Path | None = None,
        tree: TreeHandle | None = None,
    ) -> None:
        self.dir = directory
        self.root = root
        # Reached from the tree's own handle where the state lives in it (`.sm120patch` beside
        # the package, `.git/sm120patch`), else walked from `/` without following a link.
        self.held = StateDir(directory, tree)
        # 0.1.0's per-user state is read (and moved) only from a directory of the running
        # user's own: another user's HOME or XDG directory (root run with a user's HOME) is
        # not evidence of anything.
        if legacy is not None and legacy.is_dir():
            if files.untrusted_by(legacy, os.geteuid(), tree=True) is not None:
                legacy = None
        else:
            legacy = None
        self.legacy = legacy
        # The directory whose permissions the state takes: the site-packages, or .git.
        self.anchor = directory.parent.parent

    @property
    def dir_mode(self) -> int:
        return shared_mode(self.held.anchor_stat())

    @property
    def file_mode(self) -> int:
        return self.dir_mode & 0o644

    @property
    def _owners(self) -> tuple[int, ...]:
        """Who may own a state file sm120patch reads: the target's owner, root, or (0.1.0's
        per-user state, read only from a directory of its own) the running user."""
        return (self.owner[0], 0, os.geteuid())

    @property
    def owner(self) -> tuple[int, int]:
        """(uid, gid) of the target's owner: the owner of the site-packages or git directory,
        from its descriptor."""
        st = self.held.anchor_stat()
        if st is None:
            return os.geteuid(), os.getegid()
        return st.st_uid, st.st_gid

    def _making(self) -> Making:
        return Making(self.dir_mode, self.owner, self._judge)

    def _judge(self, path: Path, st: os.stat_result) -> None:
        """Refuse an entry of the state that anyone but the target's owner (or root) could
        have written, or a link (state is never read or written through one)."""
        if stat.S_ISLNK(st.st_mode):
            raise Refused(
                f"{path} is in the way of sm120patch's state directory (a symbolic link: "
                "state is never read or written through one, which could lead outside)",
                f"move {path} aside, then run sm120patch again",
            )
        problem = files.lax_entry(path, st, (self.owner[0], 0))
        if problem:
            raise self._untrusted(problem)

    def verify(self) -> None:
        """Refuse (TreeMoved) once the state directory's path names another than the one held."""
        self.held.verify()

    def check_trusted(self) -> None:
        """Refuse, with the fix, state that anyone but the target's owner (or root) could have
        written: the state directory, the level above it, and everything in them must be
        owned by them, be no symbolic link and be writable by no one else. A run by another
        user than the owner or root is refused before it creates anything."""
        uid = self.owner[0]
        me = os.geteuid()
        who = files.owner_name(uid)
        if me not in (uid, 0):
            raise NotWritable(
                f"the state of {self.root} belongs to {who}, the owner of {self.anchor}; "
                f"{files.owner_name(me)} may not write it",
                f"run sm120patch as {who}" + ("" if uid == 0 else " (or as root)"),
            )
        try:
            self.held.open()
        except FileNotFoundError:
            st = self.held.top_stat()  # the level above, when only it is there
            if st is not None:
                self._judge(self.dir.parent, st)
            return
        for path, st in [*self.held.held_stats(), *self.held.entries()]:
            self._judge(path, st)

    def _untrusted(self, problem: str) -> Refused:
        """The refusal of state someone else could have written, with the fix."""
        who, top = files.owner_name(self.owner[0]), self.dir.parent
        quoted = shlex.quote(str(top))
        return Refused(
            f"{problem}: sm120patch's state must be owned by {who} (the owner of "
            f"{self.anchor}) and writable by no one else, or anyone could have written it",
            f"if you trust what is in {top}, `chown -R {shlex.quote(who)} {quoted} && "
            f"chmod -R go-w {quoted}`; otherwise move {top} aside (and check the target's files)",
        )

    # ---- lock -------------------------------------------------------------------------
    @contextmanager
    def locked(self, wait: Waiting | None = None) -> Iterator[None]:
        """One sm120patch run per target: an flock on `lock` in the target's state directory.
        Held by another run: refused at once, or with `wait` (ensure), its notice given once
        and the lock waited for up to its seconds.

        An OS lock: a run killed while holding it releases it with its process, so a lock
        file left behind is never stale. (filelock did the same; its import alone was a tenth
        of every `ensure` at service start.)
        """
        import fcntl

        # The state directory is held from here to the run's end: every write of the run
        # goes through the descriptors opened (and checked) now.
        with self.held.holding():
            self.check_trusted()
            making = self._making()
            fd = self.held.open_lock(making.owner, making)
            try:
                # Readable and writable by its owner only (made so, or refused as it is):
                # flock needs nothing but a descriptor, so a lock anyone can open is a lock
                # anyone can hold.
                _take(fd, wait, self._held, self.root)
                try:
                    self._migrate()
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _held(self, waited: float = 0.0) -> Refused:
        if waited:
            return Refused(
                f"another sm120patch run held the lock on {self.root} for all of the "
                f"{waited:.3g} s waited for it; nothing was changed",
                "`sm120patch status` shows the state; once that run is done, start this one again",
            )
        return Refused(
            f"another sm120patch run holds the lock on {self.root}",
            "wait for it to finish, then try again",
        )

    def check_lockable(self) -> None:
        """Refuse as `locked` would (the state directory in the way or not creatable, the lock
        file not openable, another run holding it), creating and locking nothing: the dry
        runs' preflight, so that a dry run refuses where its command would."""
        with self.held.holding():
            self._check_lockable()

    def _check_lockable(self) -> None:
        self.check_trusted()
        try:
            fd_dir = self.held.open()
        except FileNotFoundError:
            missing = self.held.uncreatable()
            if missing is not None:
                raise uncreatable(missing, os.strerror(errno.EACCES)) from None
            return
        path = self.dir / LOCK
        try:
            os.stat(LOCK, dir_fd=fd_dir, follow_symlinks=False)
        except FileNotFoundError:
            if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd_dir):
                raise unopenable(path, os.strerror(errno.EACCES)) from None
        else:
            try:
                # Opened for writing as `locked` opens it, and closed at once: no byte written.
                fd = os.open(LOCK, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=fd_dir)
            except OSError as exc:
                raise unopenable(path, exc.strerror) from None
            try:
                self.held.check_lock(os.fstat(fd), self.owner[0])
            finally:
                os.close(fd)
        self.check_unlocked()

    def check_unlocked(self) -> None:
        """Refuse, as `locked` would, while another run holds the lock; creates nothing."""
        import fcntl

        try:
            with self.held.holding():
                # Never blocking on a FIFO there, never through a link.
                fd = os.open(
                    LOCK, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=self.held.open()
                )
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
        if self.legacy is None or any(self.held.exists(n) for n in (MANIFEST, JOURNAL)):
            return
        try:
            self._move_legacy()
        except OSError as exc:
            raise Refused(
                f"cannot move sm120patch 0.1.0's state from {self.legacy} to {self.dir} "
                f"({exc.strerror})",
                "free some space (or fix the permissions), then run sm120patch again",
            ) from None

    def _move_legacy(self) -> None:
        assert self.legacy is not None
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
        try:
            raw = self.held.read(name, self._owners)
        except (FileNotFoundError, NotADirectoryError):
            if self.legacy is None:
                return None
            return self._read_at(self.legacy / name)
        except safeio.NotOwned as exc:
            raise self._untrusted(exc.message) from None
        except OSError as exc:
            path = self.dir / name
            raise Refused(
                f"cannot read {path} ({exc.strerror})",
                f"if it is a symbolic link, move it aside ({path})",
            ) from None
        return self._parse(self.dir / name, raw)

    def _read_at(self, path: Path) -> dict[str, Any] | None:
        """A document of 0.1.0's per-user state (the running user's own directory)."""
        try:
            raw = _read_nofollow(path, self)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise Refused(
                f"cannot read {path} ({exc.strerror})",
                f"if it is a symbolic link, move it aside ({path})",
            ) from None
        return self._parse(path, raw)

    def _parse(self, path: Path, raw: bytes) -> dict[str, Any]:
        name = path.name
        try:
            doc = json.loads(raw.decode("utf-8"))
            schema = doc["schema"]
        # RecursionError: a forged file of deeply nested brackets (the decoder recurses)
        except (ValueError, KeyError, TypeError, RecursionError):
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
        self.held.write(name, data, self.file_mode, self._making(), durable=True)

    def remove_temps(self) -> None:
        """Temp files of state writes a killed run left behind."""
        self.held.remove_temps((MANIFEST, JOURNAL, TRIALS))

    def _remove(self, name: str) -> None:
        self.held.unlink(name)

    def has_manifest(self) -> bool:
        try:
            return self.held.exists(MANIFEST)
        except FileNotFoundError:
            return False

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
        self.held.unlink(JOURNAL, durable=False)

    def trials(self) -> list[TrialRecord]:
        doc = self._read(TRIALS)  # checked whole (`check_trials`): each entry is a record
        return [] if doc is None else [TrialRecord.from_json(t) for t in doc.get("trials", [])]

    def add_trial(self, trial: TrialRecord) -> None:
        self._write(TRIALS, {"trials": [*(t.to_json() for t in self.trials()), trial.to_json()]})

    def drop_trials(self, keys: Collection[str]) -> int:
        """Remove the trials whose `TrialRecord.key` is in `keys`; how many went."""
        trials = self.trials()
        kept = [t.to_json() for t in trials if t.key not in keys]
        if len(kept) != len(trials):
            self._write(TRIALS, {"trials": kept})
        return len(trials) - len(kept)

    # ---- file copies -------------------------------------------------------------------
    def keep_copy(self, kind: str, rel: str, data: bytes) -> None:
        # A pristine copy is what a revert restores from: durable. A patched copy only shows a
        # later edit as a diff (and a torn one shows as a larger diff, never a wrong restore).
        self.held.write(
            f"{kind}/{files.safe_relpath(rel)}",
            data,
            self.file_mode,
            self._making(),
            durable=kind == "pristine",
        )

    def copy(self, kind: str, rel: str) -> bytes | None:
        name = f"{kind}/{files.safe_relpath(rel)}"
        try:
            return self.held.read(name, self._owners)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except safeio.NotOwned as exc:
            raise self._untrusted(exc.message) from None
        except (OSError, Refused):
            return None  # a link or an unreadable copy: no copy to restore from
        if self.legacy is None:
            return None
        try:
            return _read_nofollow(files.inside(self.legacy, name), self)
        except OSError:
            return None

    def drop_copies(self) -> None:
        for kind in ("pristine", "patched"):
            self.held.remove_tree(kind)


def _read_nofollow(path: Path, state: TargetState) -> bytes:
    """The bytes of the regular file at `path`, never through a symbolic link at its name,
    never blocking on a FIFO, and owned by the target's owner or root (`files.read_regular`)."""
    try:
        return files.read_regular(path, owners=state._owners)
    except safeio.NotOwned as exc:
        raise state._untrusted(exc.message) from None


_CHECKS = {MANIFEST: check_manifest, JOURNAL: check_journal, TRIALS: check_trials}


@dataclass(frozen=True)
class Waiting:
    """How a run waits for a lock another run holds (`ensure` at service start: two services
    sharing a venv both start): up to `seconds`, `notice` called once when it starts waiting
    (the CLI says so on stderr; the engine never prints)."""

    seconds: float
    notice: Callable[[Path], None] | None = None
    # The command's whole bound, when `seconds` is what is left of it for this lock (several
    # targets share one bound): the refusal names the bound the user gave, not the remainder.
    bound: float | None = None


def _take(fd: int, wait: Waiting | None, held: Callable[[float], Refused], root: Path) -> None:
    """flock `fd`: at once, or waiting as `wait` says; `held(waited)` is the refusal."""
    import fcntl
    import time

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        if wait is None or wait.seconds <= 0:
            raise held(0.0) from None
    if wait.notice is not None:
        wait.notice(root)
    deadline = time.monotonic() + wait.seconds
    while True:
        # Polled, not a blocking flock under an alarm: a signal then interrupts a sleep, never
        # a call the interrupts module has to restart, and the bound holds whatever the signal.
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise held(wait.seconds if wait.bound is None else wait.bound) from None
