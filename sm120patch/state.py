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

import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sm120patch.errors import Refused

SCHEMA = 1
MANIFEST = "manifest.json"
JOURNAL = "journal.json"
TRIALS = "trials.json"
TMP_SUFFIX = ".sm120patch-tmp"
BRANCH_PREFIX = "sm120patch/"
# What a state file may name, checked on every read: a value that reaches git or the disk
# must not be able to name another branch, an option, or a path outside the target.
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_PATCH_BRANCH = re.compile(re.escape(BRANCH_PREFIX) + r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_BRANCH = re.compile(r"[^-.\s~^:?*\[\\][^\s~^:?*\[\\]*")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str | None:
    try:
        return sha256(path.read_bytes())
    except (FileNotFoundError, IsADirectoryError):
        return None  # not the file we wrote: reported as such, never a traceback


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
        from sm120patch import vcs

        return vcs.git_dir_of(root) / "sm120patch" / kind
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


def state_dir(path: Path, mode: int) -> None:
    """Make `path` (and any missing parent) a directory with `mode`.

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
    for d in reversed(missing if p.is_dir() else []):
        try:
            d.mkdir(mode=mode)
            os.chmod(d, mode)  # mkdir's mode passes through the umask
        except FileExistsError:  # made by a concurrent run: checked below
            pass
        except OSError as exc:
            raise Refused(
                f"cannot create sm120patch's state directory {d} ({exc.strerror})",
                "run sm120patch as a user who can write the target",
            ) from None
    if path.is_symlink() or not path.is_dir():
        what = "a symbolic link" if path.is_symlink() else "not a directory"
        raise Refused(
            f"{path} is in the way of sm120patch's state directory ({what})",
            f"move {path} aside, then run sm120patch again",
        )
    now = stat.S_IMODE(path.stat().st_mode)
    if now & ~mode:
        try:
            os.chmod(path, now & mode)
        except PermissionError:
            pass  # another user's directory: its owner set it


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
        _fsync_dir(path.parent)


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


# Test hooks for the kill-anywhere tests: the step at which the process kills itself (`step`,
# or `step:N` for its N-th passage), and a file to which every step passed is appended as
# `step:N` (so that the tests learn every boundary of a run).
KILL_ENV = "SM120PATCH_KILL_AT"
TRACE_ENV = "SM120PATCH_TRACE_STEPS"
_passed: dict[str, int] = {}


def kill_point(step: str) -> None:
    count = _passed[step] = _passed.get(step, 0) + 1
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as fh:
            fh.write(f"{step}:{count}\n")
    if os.environ.get(KILL_ENV) in (step, f"{step}:{count}"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    from sm120patch import interrupts

    interrupts.at_step(step, count)  # [signals] a deferred SIGINT stops an apply here


def drop_pycache(path: Path) -> None:
    """Stale bytecode of a module we rewrote must not outlive it."""
    cache = path.parent / "__pycache__"
    if cache.is_dir() and not cache.is_symlink():
        for pyc in cache.glob(f"{path.stem}.*.pyc"):
            try:
                pyc.unlink()
            except FileNotFoundError:
                pass


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


@dataclass(frozen=True)
class FileRecord:
    """One touched file: where it is and its bytes before and after the apply."""

    path: str  # relative to the target root (what git and the disk see)
    module: str  # relative to the package's parent (`sglang/srt/server_args.py`)
    before: str  # sha256 of the bytes before the apply
    after: str  # sha256 of the bytes the apply wrote
    mode: int | None = None

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> FileRecord:
        return cls(doc["path"], doc.get("module", doc["path"]), doc["before"], doc["after"],
                   doc.get("mode"))  # fmt: skip

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GitBase:
    """Where a checkout was when the apply began, and what the apply made there."""

    branch: str | None  # the user's branch, None when HEAD was detached
    head: str
    patch_branch: str
    commits: tuple[str, ...] = ()

    @classmethod
    def from_doc(cls, doc: dict[str, Any] | None) -> GitBase | None:
        if doc is None:
            return None
        return cls(doc.get("branch"), doc["head"], doc["patch_branch"],
                   tuple(doc.get("commits", [])))  # fmt: skip

    def to_doc(self) -> dict[str, Any]:
        return {**asdict(self), "commits": list(self.commits)}


@dataclass(frozen=True)
class Peer:
    """How a journal names another target of its transaction."""

    kind: str
    root: str
    layout: str

    def to_doc(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Manifest:
    """What is applied to a target (manifest.json)."""

    profile: str
    patches: tuple[str, ...]
    tool_version: str
    applied_at: float
    target: dict[str, str]  # the target as found at apply time (kind, root, layout, version)
    files: tuple[FileRecord, ...]
    git: GitBase | None = None
    txn: str | None = None
    lock: str | None = None  # digest of the lock file applied, when `--locked`

    @property
    def version(self) -> str:
        return str(self.target.get("version", "unknown"))

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Manifest:
        return cls(
            profile=doc["profile"],
            patches=tuple(doc.get("patches", [])),
            tool_version=str(doc.get("tool_version", "")),
            applied_at=float(doc.get("applied_at", 0)),
            target=dict(doc.get("target") or {}),
            files=tuple(FileRecord.from_doc(f) for f in doc["files"]),
            git=GitBase.from_doc(doc.get("git")),
            txn=doc.get("txn"),
            lock=doc.get("lock"),
        )

    def to_doc(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "patches": list(self.patches),
            "tool_version": self.tool_version,
            "applied_at": self.applied_at,
            "target": self.target,
            "files": [f.to_doc() for f in self.files],
            "git": None if self.git is None else self.git.to_doc(),
            "txn": self.txn,
            "lock": self.lock,
        }


@dataclass(frozen=True)
class Journal:
    """An apply or revert in progress (journal.json): what `recover` needs to finish it."""

    op: str  # "apply" or "revert"
    profile: str
    started: float
    pid: int
    txn: str | None
    peers: tuple[Peer, ...]
    tool_version: str = ""
    # apply: the files to write, each with its planned before-hash, and the git base
    target: dict[str, str] = field(default_factory=dict)
    files: tuple[FileRecord, ...] = ()
    git: GitBase | None = None
    # revert: the manifest being reverted
    manifest: Manifest | None = None
    keep_branch: bool = False
    pid_start: str | None = None  # the process's start time, to tell a reused pid apart
    boot_id: str | None = None  # [signals] the boot it ran in: a pid of another boot is not it

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Journal:
        manifest = doc.get("manifest")
        return cls(
            op=doc["op"],
            profile=str(doc.get("profile") or (manifest or {}).get("profile", "")),
            started=float(doc.get("started", 0)),
            pid=int(doc.get("pid", 0)),
            txn=doc.get("txn"),
            peers=tuple(Peer(p["kind"], p["root"], p["layout"]) for p in doc.get("peers", [])),
            tool_version=str(doc.get("tool_version", "")),
            target=dict(doc.get("target") or {}),
            files=tuple(FileRecord.from_doc(f) for f in doc.get("files", [])),
            git=GitBase.from_doc(doc.get("git")),
            manifest=None if manifest is None else Manifest.from_doc(manifest),
            keep_branch=bool(doc.get("keep_branch", False)),
            pid_start=doc.get("pid_start"),
            boot_id=doc.get("boot_id"),  # [signals]
        )

    def to_doc(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "profile": self.profile,
            "started": self.started,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "boot_id": self.boot_id,  # [signals]
            "txn": self.txn,
            "peers": [p.to_doc() for p in self.peers],
            "tool_version": self.tool_version,
            "target": self.target,
            "files": [f.to_doc() for f in self.files],
            "git": None if self.git is None else self.git.to_doc(),
            "manifest": None if self.manifest is None else self.manifest.to_doc(),
            "keep_branch": self.keep_branch,
        }

    @property
    def touched(self) -> tuple[FileRecord, ...]:
        return self.manifest.files if self.manifest is not None else self.files


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
            raise Refused(
                f"cannot open the lock {path} ({exc.strerror})",
                "run sm120patch as a user who can write the target",
            ) from None
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
        problem = _CHECKS[name](doc)
        if problem:
            raise Refused(
                f"{path} is corrupt ({problem})",
                f"if no sm120patch run is going on, move it aside ({path}) and check the "
                "target's files with `sm120patch status`",
            )
        return doc

    def _write(self, name: str, doc: dict[str, Any]) -> None:
        doc = {"schema": SCHEMA, **doc}
        data = json.dumps(doc, indent=2, sort_keys=True).encode("utf-8") + b"\n"
        state_dir(self.dir, self.dir_mode)
        atomic_write(self.dir / name, data, mode=self.file_mode)

    def remove_temps(self) -> None:
        """Temp files of state writes a killed run left behind."""
        for name in (MANIFEST, JOURNAL, TRIALS):
            remove_temps(self.dir / name)

    def _remove(self, name: str) -> None:
        try:
            (self.dir / name).unlink()
        except FileNotFoundError:
            pass
        _fsync_dir(self.dir)

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

    def drop_trials(self, keys: Collection[str]) -> int:
        """Remove the trials whose `trial_key` is in `keys`; how many went."""
        trials = self.trials()
        kept = [t for t in trials if trial_key(t) not in keys]
        if len(kept) != len(trials):
            self._write(TRIALS, {"trials": kept})
        return len(trials) - len(kept)

    # ---- file copies -------------------------------------------------------------------
    def _copy_path(self, kind: str, rel: str, base: Path | None = None) -> Path:
        return inside(base or self.dir, f"{kind}/{safe_relpath(rel)}")

    def keep_copy(self, kind: str, rel: str, data: bytes) -> None:
        path = self._copy_path(kind, rel)
        state_dir(self.dir, self.dir_mode)
        for parent in reversed([p for p in path.parents if self.dir in p.parents]):
            state_dir(parent, self.dir_mode)
        # A pristine copy is what a revert restores from: durable. A patched copy only shows a
        # later edit as a diff (and a torn one shows as a larger diff, never a wrong restore).
        atomic_write(path, data, mode=self.file_mode, durable=kind == "pristine")

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


# ---- what a state file may hold ------------------------------------------------------------
# Each check returns what is wrong, or "" when the document has the shape the engine reads.
# Paths are checked with safe_relpath, which refuses (with its own message) a path leaving
# the target.


def _check_files(files: object) -> str:
    if not isinstance(files, list):
        return "files is not a list"
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str):
            return "a file entry without a path"
        safe_relpath(f["path"])
        for key in ("before", "after"):
            if not isinstance(f.get(key), str) or not _SHA256.fullmatch(f[key]):
                return f"{f['path']}: {key} is not a sha256"
        mode = f.get("mode")
        if mode is not None and (type(mode) is not int or not 0 <= mode <= 0o7777):
            return f"{f['path']}: mode is not a permission mode"
    return ""


def _check_git(git: object, *, commits: bool) -> str:
    if git is None:
        return ""
    if not isinstance(git, dict):
        return "git is not an object"
    branch = git.get("branch")
    if branch is not None and (not isinstance(branch, str) or not _BRANCH.fullmatch(branch)):
        return f"git.branch {branch!r} is not a branch name"
    if not isinstance(git.get("head"), str) or not _COMMIT.fullmatch(git["head"]):
        return "git.head is not a commit id"
    patch = git.get("patch_branch")
    if not isinstance(patch, str) or not _PATCH_BRANCH.fullmatch(patch):
        return f"git.patch_branch {patch!r} is not an {BRANCH_PREFIX}<profile> branch"
    if commits:
        found = git.get("commits", [])
        if not isinstance(found, list) or not all(
            isinstance(c, str) and _COMMIT.fullmatch(c) for c in found
        ):
            return "git.commits is not a list of commit ids"
    return ""


def _check_peers(peers: object) -> str:
    if not isinstance(peers, list):
        return "peers is not a list"
    for p in peers:
        if (
            not isinstance(p, dict)
            or p.get("kind") not in ("sglang", "flashinfer")
            or p.get("layout") not in ("git", "installed")
            or not isinstance(p.get("root"), str)
            or not os.path.isabs(p["root"])
        ):
            return "a peer that is not a target"
    return ""


def check_manifest(doc: dict[str, Any]) -> str:
    if not isinstance(doc.get("profile"), str):
        return "no profile"
    return _check_files(doc.get("files")) or _check_git(doc.get("git"), commits=True)


def check_journal(doc: dict[str, Any]) -> str:
    op = doc.get("op")
    if op not in ("apply", "revert"):
        return f"op {op!r} is neither apply nor revert"
    problem = _check_peers(doc.get("peers", []))
    if problem:
        return problem
    if op == "revert":
        manifest = doc.get("manifest")
        if not isinstance(manifest, dict):
            return "a revert without its manifest"
        return check_manifest(manifest)
    return _check_files(doc.get("files")) or _check_git(doc.get("git"), commits=False)


def trial_key(trial: dict[str, Any]) -> str:
    """What names one trial across targets (it is kept on each target of its profile)."""
    return str(trial.get("id") or f"{trial.get('started')}:{trial.get('profile')}")


def check_trials(doc: dict[str, Any]) -> str:
    trials = doc.get("trials", [])
    if not isinstance(trials, list) or not all(isinstance(t, dict) for t in trials):
        return "trials is not a list of records"
    if any(not isinstance(t.get("id", ""), str) for t in trials):
        return "a trial's id is not a string"
    return ""


_CHECKS = {MANIFEST: check_manifest, JOURNAL: check_journal, TRIALS: check_trials}
