"""The records of a target's state (manifest, journal) and the checks every read makes.

A state file is untrusted input: every value is checked for its type and its shape before a
record is made of it (`check_manifest`, `check_journal`), so that a mistyped or edited file is
one line saying what to do, never a traceback, and a value that reaches git or the disk cannot
name another branch, an option, or a path outside the target. What the records may name is
narrower still (the files of the recorded profile's patches): `engine.run.check_evidence`.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from sm120patch.patchkit.kinds import TARGETS
from sm120patch.targets import Target
from sm120patch.targets.files import safe_relpath

SCHEMA = 1
BRANCH_PREFIX = "sm120patch/"


# What a state file may name, checked on every read: a value that reaches git or the disk
# must not be able to name another branch, an option, or a path outside the target.
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_PATCH_BRANCH = re.compile(re.escape(BRANCH_PREFIX) + r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_BRANCH = re.compile(r"[^-.\s~^:?*\[\\][^\s~^:?*\[\\]*")


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
        return cls(
            doc["path"],
            doc.get("module", doc["path"]),
            doc["before"],
            doc["after"],
            doc.get("mode"),
        )

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CheckedFile:
    """A file a profile's patches read on a target they changed nothing on: its sha256 then
    (None: it did not exist). While every one still has it, the verdict "nothing needed" holds
    without planning again."""

    path: str  # relative to the target root
    module: str  # relative to the package's parent
    sha256: str | None

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> CheckedFile:
        return cls(doc["path"], doc.get("module", doc["path"]), doc.get("sha256"))

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
        return cls(
            doc.get("branch"), doc["head"], doc["patch_branch"], tuple(doc.get("commits", []))
        )

    def to_doc(self) -> dict[str, Any]:
        return {**asdict(self), "commits": list(self.commits)}


@dataclass(frozen=True)
class TargetRecord:
    """The target as an apply found it (`Target.to_dict`). Each key may be absent: a state an
    older sm120patch wrote, or one made by hand, has only some, and an absent key is written
    back absent; a key this sm120patch does not know is not kept."""

    kind: str | None = None
    root: str | None = None
    package: str | None = None
    layout: str | None = None
    version: str | None = None
    version_source: str | None = None

    @classmethod
    def of(cls, target: Target) -> TargetRecord:
        return cls.from_doc(target.to_dict())

    @classmethod
    def from_doc(cls, doc: dict[str, Any] | None) -> TargetRecord:
        doc = doc or {}
        return cls(**{f.name: doc[f.name] for f in fields(cls) if f.name in doc})

    def to_doc(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v is not None}


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
    target: TargetRecord
    files: tuple[FileRecord, ...]
    git: GitBase | None = None
    txn: str | None = None
    lock: str | None = None  # digest of the lock file applied, when `--locked`
    # Set on a target the profile needs nothing from (every site upstream or not applicable):
    # the files that said so, for `assess` to check against the bytes. None on a manifest of
    # files written.
    checked: tuple[CheckedFile, ...] | None = None
    # kind -> specifier: releases of another target the profile refuses (moe: FlashInfer
    # <0.6.7), for `status` to say so when one is installed after the apply.
    refuses: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return "unknown" if self.target.version is None else self.target.version

    @property
    def needs_nothing(self) -> bool:
        """A record of "this profile needs nothing here", no file written."""
        return self.checked is not None

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Manifest:
        return cls(
            profile=doc["profile"],
            patches=tuple(doc.get("patches", [])),
            tool_version=str(doc.get("tool_version", "")),
            applied_at=float(doc.get("applied_at", 0)),
            target=TargetRecord.from_doc(doc.get("target")),
            files=tuple(FileRecord.from_doc(f) for f in doc["files"]),
            git=GitBase.from_doc(doc.get("git")),
            txn=doc.get("txn"),
            lock=doc.get("lock"),
            checked=None if doc.get("checked") is None
            else tuple(CheckedFile.from_doc(f) for f in doc["checked"]),
            refuses={k: tuple(v) for k, v in (doc.get("refuses") or {}).items()},
        )

    def to_doc(self) -> dict[str, Any]:
        out = self._doc()
        # Written only where set: a manifest of files written reads as before to an older
        # sm120patch.
        if self.checked is not None:
            out["checked"] = [f.to_doc() for f in self.checked]
        if self.refuses:
            out["refuses"] = {k: list(v) for k, v in self.refuses.items()}
        return out

    def _doc(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "patches": list(self.patches),
            "tool_version": self.tool_version,
            "applied_at": self.applied_at,
            "target": self.target.to_doc(),
            "files": [f.to_doc() for f in self.files],
            "git": None if self.git is None else self.git.to_doc(),
            "txn": self.txn,
            "lock": self.lock,
        }


class Op(str, Enum):
    """What a journal is the write-ahead record of."""

    APPLY = "apply"
    REVERT = "revert"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Journal:
    """An apply or revert in progress (journal.json): what `recover` needs to finish it."""

    op: Op
    profile: str
    started: float
    pid: int
    txn: str | None
    peers: tuple[Peer, ...]
    tool_version: str = ""
    # apply: the files to write, each with its planned before-hash, and the git base
    target: TargetRecord = field(default_factory=TargetRecord)
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
            op=Op(doc["op"]),
            profile=str(doc.get("profile") or (manifest or {}).get("profile", "")),
            started=float(doc.get("started", 0)),
            pid=int(doc.get("pid", 0)),
            txn=doc.get("txn"),
            peers=tuple(Peer(p["kind"], p["root"], p["layout"]) for p in doc.get("peers", [])),
            tool_version=str(doc.get("tool_version", "")),
            target=TargetRecord.from_doc(doc.get("target")),
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
            "target": self.target.to_doc(),
            "files": [f.to_doc() for f in self.files],
            "git": None if self.git is None else self.git.to_doc(),
            "manifest": None if self.manifest is None else self.manifest.to_doc(),
            "keep_branch": self.keep_branch,
        }


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_str(doc: dict[str, Any], *keys: str) -> str:
    for key in keys:
        if doc.get(key) is not None and not isinstance(doc[key], str):
            return f"{key} is not a string"
    return ""


def _check_target(target: object) -> str:
    if target is None:
        return ""
    if not isinstance(target, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in target.items()
    ):
        return "target is not a table of strings"
    if target.get("kind") not in (None, *TARGETS):
        return f"target.kind {target.get('kind')!r} is not a target kind"
    if target.get("layout") not in (None, "git", "installed"):
        return f"target.layout {target.get('layout')!r} is neither git nor installed"
    return ""


def _check_files(
    files: object,
    name: str = "files",
    hashes: tuple[str, ...] = ("before", "after"),
    absent: bool = False,
) -> str:
    """`files` (or `checked`, whose sha256 may be None: `absent`) entry by entry."""
    if not isinstance(files, list):
        return f"{name} is not a list"
    for f in files:
        problem = _paths_problem(f, "a file entry" if name == "files" else f"a {name} entry")
        if problem:
            return problem
        for key in hashes:
            if absent and f.get(key) is None:
                continue
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
            or p.get("kind") not in TARGETS
            or p.get("layout") not in ("git", "installed")
            or not isinstance(p.get("root"), str)
            or not os.path.isabs(p["root"])
        ):
            return "a peer that is not a target"
    return ""


def check_manifest(doc: dict[str, Any]) -> str:
    if not isinstance(doc, dict):
        return "not a table"
    if not isinstance(doc.get("profile"), str):
        return "no profile"
    patches = doc.get("patches", [])
    if not isinstance(patches, list) or not all(isinstance(p, str) for p in patches):
        return "patches is not a list of patch ids"
    if "applied_at" in doc and not _number(doc["applied_at"]):
        return "applied_at is not a time"
    return (
        _optional_str(doc, "tool_version", "txn", "lock")
        or _check_target(doc.get("target"))
        or _check_files(doc.get("files"))
        or _check_git(doc.get("git"), commits=True)
        or _check_checked(doc)
        or _check_refuses(doc.get("refuses"))
    )


def _check_checked(doc: dict[str, Any]) -> str:
    checked = doc.get("checked")
    if checked is None:
        return ""
    if doc.get("files") or doc.get("git") is not None:
        return "checked is set on a manifest of files written"
    return _check_files(checked, "checked", ("sha256",), absent=True)


def _check_refuses(refuses: object) -> str:
    ok = refuses is None or (
        isinstance(refuses, dict)
        and all(
            k in TARGETS and isinstance(v, list) and all(isinstance(spec, str) for spec in v)
            for k, v in refuses.items()
        )
    )
    return "" if ok else "refuses is not a table of target kind to specifiers"


def _paths_problem(f: object, what: str) -> str:
    """What is wrong with the path and module of one entry (a path leaving the target is a
    usage error, `safe_relpath`)."""
    if not isinstance(f, dict) or not isinstance(f.get("path"), str):
        return f"{what} without a path"
    safe_relpath(f["path"])
    if "module" in f:
        if not isinstance(f["module"], str):
            return f"{f['path']}: module is not a path"
        safe_relpath(f["module"])
    return ""


def check_journal(doc: dict[str, Any]) -> str:
    op = doc.get("op")
    if op not in ("apply", "revert"):
        return f"op {op!r} is neither apply nor revert"
    problem = _check_peers(doc.get("peers", []))
    if problem:
        return problem
    for key in ("started",):
        if key in doc and not _number(doc[key]):
            return f"{key} is not a time"
    if "pid" in doc and (type(doc["pid"]) is not int or doc["pid"] < 0):
        return "pid is not a process id"
    if "keep_branch" in doc and not isinstance(doc["keep_branch"], bool):
        return "keep_branch is not true or false"
    problem = _optional_str(doc, "profile", "tool_version", "txn", "pid_start", "boot_id") or (
        _check_target(doc.get("target"))
    )
    if problem:
        return problem
    if op == "revert":
        manifest = doc.get("manifest")
        if not isinstance(manifest, dict):
            return "a revert without its manifest"
        return check_manifest(manifest)
    return _check_files(doc.get("files")) or _check_git(doc.get("git"), commits=False)
