"""Where state is written: manifest, journal, pristine copies and the lock of one target.

Layout of a target's state directory (`.git/sm120patch/<kind>/` for a git target, the user's
state directory keyed by the target path and kind for an installed one):

    manifest.json   what is applied: profile, patches, files with hashes, git base
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
import re
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


def state_dir_for(root: Path, layout: str, kind: str) -> Path:
    """The state directory of the `kind` target at `root`. One per kind: SGLang and FlashInfer
    installed in the same site-packages (or kept in one repository) are two targets."""
    if layout == "git":
        from sm120patch import vcs

        return vcs.git_dir_of(root) / "sm120patch" / kind
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return user_state_dir() / "targets" / f"{digest}-{kind}"


def private_dir(path: Path) -> None:
    """Make `path` (and any missing parent) a directory only its owner can enter (0700).

    Refuses, with what to do, when something that is not a directory is in the way, or when
    the directory is a symbolic link (state is never written through one).
    """
    # The level above a target's state (`.git/sm120patch`, `<state>/targets`) is ours too:
    # a link there would carry every write elsewhere just the same.
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
            d.mkdir(mode=0o700)
        except FileExistsError:  # made by a concurrent run: checked below
            pass
        except OSError as exc:
            raise Refused(
                f"cannot create sm120patch's state directory {d} ({exc.strerror})",
                "make its parent writable, or set SM120PATCH_STATE_DIR to a directory you own",
            ) from None
    if path.is_symlink() or not path.is_dir():
        what = "a symbolic link" if path.is_symlink() else "not a directory"
        raise Refused(
            f"{path} is in the way of sm120patch's state directory ({what})",
            f"move {path} aside, then run sm120patch again",
        )
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        os.chmod(path, mode & 0o700)


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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
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


class TargetState:
    """The state directory of one target."""

    @classmethod
    def of(cls, root: Path, layout: str, kind: str) -> TargetState:
        return cls(state_dir_for(root, layout, kind), root)

    def __init__(self, directory: Path, root: Path) -> None:
        self.dir = directory
        self.root = root

    # ---- lock -------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        import filelock

        private_dir(self.dir)
        # An OS lock (flock): a run killed while holding it releases it with its process,
        # so a lock file left behind is never stale.
        lock = filelock.FileLock(str(self.dir / "lock"), timeout=0, mode=0o600)
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
        private_dir(self.dir)
        atomic_write(self.dir / name, data, mode=0o600)

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
        return inside(self.dir, f"{kind}/{safe_relpath(rel)}")

    def keep_copy(self, kind: str, rel: str, data: bytes) -> None:
        path = self._copy_path(kind, rel)
        private_dir(path.parent)
        atomic_write(path, data, mode=0o600)

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


def check_trials(doc: dict[str, Any]) -> str:
    trials = doc.get("trials", [])
    if not isinstance(trials, list) or not all(isinstance(t, dict) for t in trials):
        return "trials is not a list of records"
    return ""


_CHECKS = {MANIFEST: check_manifest, JOURNAL: check_journal, TRIALS: check_trials}
