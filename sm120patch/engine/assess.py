"""The state of a target, decided every time from what is on disk (docs/ARCHITECTURE.md lists
the states).

A manifest says what sm120patch once did; only the bytes say what the server will run. Each
touched file's sha256 is compared with the manifest's before/after hashes, the installed
version with the manifest's, and on a checkout the branch checked out with the patch branch:

    pristine    nothing applied (no manifest)
    applied     every touched file has the bytes the apply wrote
    drifted     a touched file was edited after the apply (neither its before nor after
                bytes), or commits were made on the patch branch after sm120patch's
    gone        every touched file is back to its before bytes (a reinstall of the same
                release, a checkout of another branch, a deleted patch branch)
    replaced    another release is installed (or checked out) than the one patched
    missing     a touched file was deleted
    unfinished  a journal is open: an interrupted run; `recover` finishes it

No parse and no git process: `status` and `ensure` run this at every service start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from sm120patch.engine.records import FileRecord, Journal, Manifest
from sm120patch.engine.store import TargetState
from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import Sm120Error
from sm120patch.targets import Target, git
from sm120patch.targets.installed import record_hashes
from sm120patch.targets.resolved import Given, Resolved, owned


class State(str, Enum):
    """The state of a target (docs/ARCHITECTURE.md says what each means for apply and revert)."""

    PRISTINE = "pristine"
    APPLIED = "applied"
    DRIFTED = "drifted"
    GONE = "gone"
    REPLACED = "replaced"
    MISSING = "missing"
    UNFINISHED = "unfinished"

    def __str__(self) -> str:
        return self.value

    @property
    def stale(self) -> bool:
        """A record the bytes no longer bear out (gone, replaced): a revert only drops it."""
        return self in (State.GONE, State.REPLACED)

    @property
    def holds_no_patch(self) -> bool:
        """Nothing sm120patch wrote is in the tree: pristine, or a stale record."""
        return self is State.PRISTINE or self.stale


@dataclass(frozen=True)
class FileState:
    path: str
    module: str
    state: str  # "patched", "pristine", "drifted" or "missing"
    sha256: str | None
    # Whether the file matches the dist-info RECORD (as pip installed it); None: no RECORD.
    as_installed: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "module": self.module,
            "state": self.state,
            "sha256": self.sha256,
            "as_installed": self.as_installed,
        }


@dataclass(frozen=True)
class Assessment:
    target: Target
    state: State
    message: str
    manifest: Manifest | None = None
    journal: Journal | None = None
    files: tuple[FileState, ...] = ()
    branch_now: str | None = None  # checkouts: the branch checked out now
    patch_branch_exists: bool | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def profile(self) -> str | None:
        return self.manifest.profile if self.manifest else None


def version_changed(target: Target, manifest: Manifest) -> bool:
    """Whether the release on disk is another one than the manifest's.

    An installed package compares its whole version string (a `+cu128` build is another
    build). A checkout compares the public version (its local part names a commit).
    """
    return other_release(target, manifest.version)


def other_release(target: Target, before: str) -> bool:
    """Whether `target` is now another release than `before` (a version a record names)."""
    now = target.version
    if target.layout == "installed":
        return before != now
    from sm120patch.patchkit import versions

    was, is_ = versions.own_release(before), versions.own_release(now)
    return before != now if was is None or is_ is None else was != is_


def assess(target: Target, st: TargetState | None = None) -> Assessment:
    st = st or TargetState.of(target.root, target.layout, target.kind, target.handle)
    journal = st.journal()
    manifest = st.manifest()
    if journal is not None:
        what = f"an interrupted {journal.op} of profile {journal.profile}"
        return Assessment(
            target,
            State.UNFINISHED,
            f"{what} left a journal: run `sm120patch recover` to finish it",
            manifest,
            journal,
            _files(target, manifest) if manifest else (),
        )
    if manifest is None:
        return Assessment(target, State.PRISTINE, "nothing applied")
    files = _files(target, manifest)
    name, profile = target.name, manifest.profile
    branch_now = exists = None
    if manifest.git is not None:
        branch_now = git.head_branch(target.root)
        exists = git.branch_exists_light(target.root, manifest.git.patch_branch)

    def verdict(state: State, message: str) -> Assessment:
        return Assessment(
            target,
            state,
            message,
            manifest,
            files=files,
            branch_now=branch_now,
            patch_branch_exists=exists,
        )

    if version_changed(target, manifest):
        return verdict(
            State.REPLACED,
            f"{name} was {manifest.version} when profile {profile} was applied, "
            f"{target.version} is installed now: the patches are gone",
        )
    if manifest.needs_nothing:
        return _needs_nothing(target, manifest)
    words = {f.state for f in files}
    if "missing" in words:
        gone = ", ".join(f.path for f in files if f.state == "missing")
        return verdict(
            State.MISSING,
            f"touched file(s) deleted since profile {profile} was applied: {gone}",
        )
    on_branch = manifest.git is not None and branch_now == manifest.git.patch_branch
    if words == {"patched"} and on_branch and manifest.git is not None:
        # The touched files are ours, but the branch moved on: the work tree is not only what
        # the apply made, and a revert would not throw the commits away without --force.
        head = git.branch_sha_light(target.root, manifest.git.patch_branch)
        if manifest.git.commits and head is not None and head != manifest.git.commits[-1]:
            return verdict(
                State.DRIFTED,
                f"branch {manifest.git.patch_branch} has commits after sm120patch's (now at "
                f"{head[:12]}): profile {profile} is applied with changes of yours on top",
            )
    if words == {"patched"}:
        where = ""
        if manifest.git is not None and branch_now != manifest.git.patch_branch:
            where = f" (checked out: {branch_now or 'a detached HEAD'})"
        return verdict(
            State.APPLIED,
            f"profile {profile} applied: every touched file has the bytes sm120patch wrote{where}",
        )
    if manifest.git is not None and branch_now != manifest.git.patch_branch:
        # The patches live on their branch, which is not checked out (or was deleted): this
        # work tree holds whatever the checked-out branch has, edits of the user's included.
        why = (
            f"branch {manifest.git.patch_branch} was deleted"
            if not exists
            else f"{branch_now or 'a detached HEAD'} is checked out, not "
            f"{manifest.git.patch_branch}"
        )
        return verdict(
            State.GONE,
            f"profile {profile} was applied, but {why}: the patches are not in this work tree",
        )
    if words == {"pristine"}:
        return verdict(
            State.GONE,
            f"profile {profile} was applied, but every touched file is back to its original "
            "bytes (a reinstall of the same release?): the patches are gone",
        )
    changed = ", ".join(f.path for f in files if f.state != "patched")
    return verdict(
        State.DRIFTED,
        f"changed since profile {profile} was applied: {changed}",
    )


def _needs_nothing(target: Target, manifest: Manifest) -> Assessment:
    """A record of "profile P needs nothing here": as wanted while every file the plan read
    still has the bytes it read (or is still absent); else stale, and an apply plans again."""
    assert manifest.checked is not None
    changed = [f.path for f in manifest.checked if target.handle.sha256(f.path) != f.sha256]
    if changed:
        return Assessment(
            target,
            State.GONE,
            f"profile {manifest.profile} needed nothing here when it was applied, but "
            f"{', '.join(changed)} changed since: an apply plans it again",
            manifest,
        )
    why = (
        f"every site upstream or not applicable; the {len(manifest.checked)} file(s) that "
        "said so are unchanged"
        if manifest.checked
        else "it has no patch for this target"
    )
    return Assessment(
        target,
        State.APPLIED,
        f"profile {manifest.profile} applied: it needs nothing here ({why})",
        manifest,
    )


def file_verdict(f: FileRecord, now: str | None, released: str | None = None) -> str:
    """The verdict on one touched file from its sha256 `now`: "missing" (deleted), "patched"
    (the bytes the apply wrote), "pristine" (its before-bytes, or `released`: the release's
    own bytes as its RECORD lists them), else "drifted". The one place a file's hash is judged:
    `assess`, revert's preflight and the layouts' restores all read it from here."""
    if now is None:
        return "missing"
    # The release's bytes first: a restore must leave a file that holds them as it is.
    if now == f.before or (released is not None and now == released):
        return "pristine"
    if now == f.after:
        return "patched"
    return "drifted"


def _files(target: Target, manifest: Manifest) -> tuple[FileState, ...]:
    record = record_hashes(target)
    out = []
    for f in manifest.files:
        now = target.handle.sha256(f.path)  # through the tree found, never a path again
        # Against the manifest alone; the RECORD's word is reported beside it (`as_installed`).
        word = file_verdict(f, now)
        installed = record.get(f.module)
        out.append(
            FileState(
                f.path,
                f.module,
                word,
                now,
                None if installed is None or now is None else now == installed,
            )
        )
    return tuple(out)


@dataclass
class TargetStatus:
    target: Target
    assessment: Assessment
    trials: list[TrialRecord]

    @property
    def state(self) -> str:
        return self.assessment.state

    @property
    def profile(self) -> str | None:
        return self.assessment.profile

    @property
    def branch(self) -> str | None:
        m = self.assessment.manifest
        return m.git.patch_branch if m and m.git else None

    @property
    def base(self) -> str | None:
        m = self.assessment.manifest
        return m.git.head if m and m.git else None

    @property
    def unfinished(self) -> str | None:
        j = self.assessment.journal
        return j.op if j else None

    @property
    def files(self) -> tuple[FileState, ...]:
        return self.assessment.files

    def to_dict(self) -> dict[str, Any]:
        a = self.assessment
        return {
            **self.target.to_dict(),
            "state": a.state,
            "message": a.message,
            "profile": self.profile,
            "applied_version": a.manifest.version if a.manifest else None,
            "branch": self.branch,
            "branch_now": a.branch_now,
            "patch_branch_exists": a.patch_branch_exists,
            "base": self.base,
            "files": [f.to_dict() for f in self.files],
            # the profile needs nothing here (every site upstream or not applicable)
            "needs_nothing": bool(a.manifest and a.manifest.needs_nothing),
            "unfinished": self.unfinished,
            "trials": [t.to_json() for t in self.trials],
        }


def status(given: Given) -> list[TargetStatus]:
    """What is applied where, from hashes only (no parsing, no git process): each target of
    the command (`Resolved`) assessed once."""
    with owned(given) as named:
        out = []
        for target in named.each():
            st = TargetState.of(target.root, target.layout, target.kind, target.handle)
            out.append(TargetStatus(target, assess(target, st), st.trials()))
        found: dict[str, Target] = {str(s.target.kind): s.target for s in out}
        for s in out:
            lines = refused_beside(s.assessment, found, named)
            if lines:
                a = s.assessment
                s.assessment = replace(
                    a, message="; ".join([a.message, *lines]), notes=(*a.notes, *lines)
                )
        return out


def refused_beside(
    found: Assessment, others: Mapping[str, Target], named: Resolved | None = None
) -> list[str]:
    """One line per other target, now at hand, in a release the applied profile refuses (the
    manifest's `refuses`: moe refuses a FlashInfer before 0.6.7), installed after the apply or
    not found by it. `others`: the targets of this run; else the one beside an installed
    target (the same site-packages), found through the command's `named` targets."""
    m = found.manifest
    if m is None or not m.refuses or found.state != State.APPLIED:
        return []
    from sm120patch.patchkit import versions

    lines = []
    for kind, specs in sorted(m.refuses.items()):
        other = others.get(kind) or _beside(kind, found.target, named or Resolved({}))
        if other is None:
            continue
        release = versions.base_release(other.version)
        hit = [spec for spec in specs if versions.contains(spec, release)]
        if hit:
            lines.append(
                f"profile {m.profile} refuses {other.name} {other.version} ({kind} "
                f"{' or '.join(hit)}), which is at {other.root} now: `sm120patch ensure "
                f"{m.profile}` refuses to start on it; install a {other.name} the profile "
                f"accepts, or `sm120patch revert {m.profile}`"
            )
    return lines


def _beside(kind: str, target: Target, named: Resolved) -> Target | None:
    if target.layout == "git" or not (target.parent / kind).is_dir():
        return None
    try:
        return named.at(kind, target.parent)
    except Sm120Error:  # an unreadable version: nothing to say about it here
        return None
