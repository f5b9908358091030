"""One target during a run (its state and its layout), the targets of a run and their checks
before anything is read (what apply and ensure share), the locks of a run, and what apply,
revert and recover share about journals and temp files."""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from sm120patch.engine import assess
from sm120patch.engine.assess import Assessment
from sm120patch.engine.records import FileRecord, Journal, Manifest, Peer
from sm120patch.engine.store import TargetState, Waiting
from sm120patch.errors import Refused, not_writable
from sm120patch.plan import pins
from sm120patch.plan.profiles import Profile
from sm120patch.targets import Target, procscan
from sm120patch.targets.resolved import Given, resolved

if TYPE_CHECKING:
    from sm120patch.config import Config
    from sm120patch.engine.layouts import TargetLayout
    from sm120patch.plan.lockfile import Lock


class TargetRun:
    """One target during a run: its state directory and its layout (git or installed)."""

    def __init__(self, target: Target, config: Config) -> None:
        self.target = target
        self.config = config  # the command's: the catalog of its packs judges the state
        # The tree as found, held open: every read and write of its files goes through it.
        self.tree = target.handle
        self.state = TargetState.of(target.root, target.layout, target.kind, target.handle)
        self._layout: TargetLayout | None = None

    @property
    def layout(self) -> TargetLayout:
        # Made on first use: git runs only in runs that touch a checkout, and the layouts
        # only by runs that write (not `ensure` on a tree already as wanted).
        if self._layout is None:
            from sm120patch.engine.layouts import layout_of

            self._layout = layout_of(self.target, self.state)
        return self._layout

    def path(self, rel: str) -> Path:
        """`rel`'s path, for messages (files are reached through `tree`)."""
        return self.tree.shown(rel)

    def verify(self) -> None:
        """Refuse when the path found names another tree now (TreeMoved): before the state
        or git is written by path, and before each write through the handle; and when the
        state directory's path names another than the one held."""
        self.tree.verify()
        self.state.verify()

    def journal_open(self) -> bool:
        """Whether a journal of this target is open where its path names it: one left in a
        tree (or state directory) swapped away meanwhile is that tree's, which the refusal
        in flight names (`recover` there finishes it)."""
        from sm120patch.handle import TreeMoved

        if self.tree.moved() is not None:
            return False
        try:
            self.state.verify()
        except TreeMoved:
            return False
        return self.state.journal() is not None

    def peer(self) -> Peer:
        t = self.target
        return Peer(t.kind, str(t.root), t.layout)

    def assess(self, seen: Assessment | None = None) -> Assessment:
        """This target's state from its bytes, held to the patches loaded now. `seen`: its
        assessment made earlier in this command, before the run's lock was taken (`ensure`'s,
        at service start); it stands while the state it was made from is the state now (no
        journal, the same manifest): another sm120patch run that changed the tree meanwhile
        changed one of them, and what anything else wrote meanwhile is met when the files are
        read for the journal (their bytes held to the plan), as after a locked assessment."""
        if (
            seen is not None
            and seen.target is self.target
            and seen.journal is None
            and self.state.journal() is None
            and self.state.manifest() == seen.manifest
        ):
            return seen
        found = assess.assess(self.target, self.state)
        m = found.manifest
        if found.state is assess.State.APPLIED and m is not None and m.needs_nothing:
            return self._held_to_the_patches(found, m)
        return found

    def _held_to_the_patches(self, found: Assessment, m: Manifest) -> Assessment:
        """A record that a profile needs nothing here holds only while it checked every file
        that profile's patches read on this target, as the patches loaded now name them (a
        pack update may add a patch; the record is state, not instruction)."""
        from dataclasses import replace

        from sm120patch.plan import catalog

        cat = catalog.load(self.config)
        profile = cat.profiles.get(m.profile)
        if profile is None:
            return found  # no loaded patches say otherwise: the bytes still hold
        # The registry's rows name each patch's target and files: no patch module (and so no
        # libcst) is imported at service start.
        rows = [cat.patches.rows[pid] for pid in profile.patches]
        wanted = {f for row in rows if row.target == self.target.kind for f in row.files}
        if {f.module for f in m.checked or ()} == wanted:
            return found
        return replace(
            found,
            state=assess.State.GONE,
            message=f"the record that profile {m.profile} needs nothing here does not name "
            "the files its patches read now (another version of the patches?): an apply plans "
            "again",
        )


def runs_for(
    profile: Profile,
    given: Given,
    force: bool,
    lock: Lock | None = None,
) -> list[TargetRun]:
    """A run of each of the profile's targets, as the command found them (`given`)."""
    found = pins.resolve_targets(profile, given)
    pins.require_pins(profile, found, given, force=force, verb="apply")
    if lock is not None:
        # Before anything is locked or read: a lock for another release is refused at once.
        other = [
            f"{t.kind} version: lock has {lock.versions.get(t.kind)}, found {t.version}"
            for t in found
            if lock.versions.get(t.kind) != t.version
        ]
        if other:
            raise Refused(
                "the lock does not match these trees: " + "; ".join(other),
                "nothing was changed; use the releases the lock was made on, or make a new lock",
            )
    git_roots = [t.root for t in found if t.layout == "git"]
    if len(git_roots) != len(set(git_roots)):
        # One branch per target is the contract; two targets in one work tree would need one
        # branch for both, which revert could not undo one target at a time.
        raise Refused(
            f"SGLang and FlashInfer are in the same git repository ({git_roots[0]}); "
            "sm120patch makes one branch per repository and target",
            "apply to separate checkouts, or to installed packages",
        )
    config = resolved(given).config
    return [TargetRun(t, config) for t in found]


def unchecked_refusals(profile: Profile, found: list[Target], given: Given) -> list[str]:
    """One line per target kind whose releases `profile` refuses but does not patch (moe: a
    FlashInfer before 0.6.7) where no such target can be found to check: why the run goes on,
    and how to have it checked. The profile's patches do not need that target, and SGLang's
    checkout or a venv under construction may not hold it yet; status and ensure check it
    once it is there."""
    from sm120patch.targets import DISPLAY

    have = {t.kind for t in found}
    lines = []
    for kind in dict.fromkeys(r.kind for r in profile.refuse if r.kind not in have):
        if pins.beside(kind, found, given) is not None:
            continue  # found and checked (`pins.require_pins`)
        label = DISPLAY[kind]
        specs = " or ".join(str(r.releases) for r in profile.refuse if r.kind == kind)
        near = ", ".join(str(t.parent) for t in found if t.layout != "git")
        lines.append(
            f"profile {profile.name} refuses {label} {specs}, and no {label} was found "
            f"({'none in ' + near + ', ' if near else ''}none importable by this Python), so "
            f"that was not checked: the profile's patches do not need {label} to apply; give "
            f"--{kind} PATH (the {label} the server runs with) to check it now, and "
            f"`sm120patch status` and `ensure` check it once it is installed"
        )
    return lines


def check_applied_matches_lock(ctx: TargetRun, found: Assessment, lock: Lock) -> None:
    assert found.manifest is not None
    want = {f.path: f.after for f in lock.files if f.target == ctx.target.kind}
    have = {f.module: f.after for f in found.manifest.files}
    if want != have or lock.versions.get(ctx.target.kind) != ctx.target.version:
        raise Refused(
            f"{ctx.target.at}: profile {found.profile} is applied, but not as the lock says "
            "(other files, bytes or version)",
            f"revert it (`sm120patch revert {found.profile}`), then apply the lock",
        )


@contextmanager
def locked(ctxs: list[TargetRun], wait: Waiting | None = None) -> Iterator[bool]:
    """Every target's lock, taken in order; yields whether any was waited for (what was
    assessed before is then stale: the other run may have changed the tree). With `wait`,
    the whole command waits at most its seconds, however many targets."""
    import time

    waited: list[Path] = []

    def notice(root: Path) -> None:
        waited.append(root)
        if wait is not None and wait.notice is not None:
            wait.notice(root)

    deadline = time.monotonic() + (wait.seconds if wait is not None else 0.0)
    with ExitStack() as stack:
        for ctx in ctxs:
            left = None
            if wait is not None:
                left = Waiting(max(0.0, deadline - time.monotonic()), notice, wait.seconds)
            stack.enter_context(ctx.state.locked(left))
        yield bool(waited)


def refuse_unfinished(ctxs: list[TargetRun]) -> None:
    for ctx in ctxs:
        journal = ctx.state.journal()
        if journal is not None:
            raise Refused(
                f"an interrupted sm120patch {journal.op} left a journal on {ctx.target.root}",
                "run `sm120patch recover` first",
            )


def check_writable(ctx: TargetRun, rel: str, *, regular: bool = True) -> None:
    """Before the journal: a file the run will write can be written (as a regular file unless
    `regular` is false: a revert puts the file back whatever is there now), looked at through
    the tree's handle."""
    path = ctx.path(rel)
    st = ctx.tree.lstat(rel)
    if regular and st is not None and stat.S_ISLNK(st.st_mode):
        raise Refused(
            f"{path} is a symbolic link; sm120patch writes regular files only",
            "replace the link by the file it points to, or patch the tree it points into",
        )
    parent = PurePosixPath(rel).parent
    while parent != PurePosixPath(".") and not ctx.tree.exists(parent.as_posix()):
        parent = parent.parent  # a directory deleted with the file: nothing is written there
    if not ctx.tree.writable(parent.as_posix()):
        raise not_writable("cannot write in", ctx.path(parent.as_posix()), "permission denied")


def check_evidence(
    ctx: TargetRun,
    profile: str,
    touched: tuple[FileRecord, ...],
    patches: tuple[str, ...] = (),
    kind: str | None = None,
) -> None:
    """State is evidence, not instruction: before a manifest or journal moves a byte, every
    file it names must be one that a patch of its recorded profile touches (the profile's
    patches and the ones it records), at that file's place in this target, and a record of
    another kind of target is not this one's."""
    where = ctx.state.dir
    if kind is not None and kind != ctx.target.kind:
        raise Refused(
            f"{ctx.target.root}: the state in {where} describes a {kind} target, not "
            f"{ctx.target.name}",
            f"the state was edited or is damaged: inspect {where}, then move it aside",
        )
    from sm120patch.plan import catalog

    cat = catalog.load(ctx.config)
    known = cat.profiles.get(profile)
    if known is None:
        raise Refused(
            f"{ctx.target.root}: the state in {where} names profile {profile!r}, which no "
            "loaded patch library defines",
            "load the pack that defines it (--patches DIR or SM120PATCH_PATCHES) and run "
            f"again; if the state is damaged, move {where} aside",
        )
    ids = [*known.patches, *(p for p in patches if p in cat.patches)]
    # The registry's rows: no patch module imported (a warm `revert` parses nothing).
    rows = [cat.patches.rows[pid] for pid in ids]
    allowed = {f for row in rows if row.target == ctx.target.kind for f in row.files}
    for f in touched:
        if f.module not in allowed or f.path != ctx.target.rel(f.module):
            raise Refused(
                f"{ctx.target.root}: the state in {where} names {f.path}, which no patch of "
                f"profile {profile} touches; sm120patch writes only the files of its patches",
                f"the state was edited or is damaged: inspect {where}, then move it aside",
            )


def new_txn() -> str:
    # uuid4's 122 random bits, from the same source; `import uuid` brings `platform` (3 ms).
    return os.urandom(16).hex()


def start_time() -> str | None:
    """This process's start time (field 22 of /proc/self/stat), to tell a reused pid apart."""
    return procscan.start_time(os.getpid())  # [signals] one /proc parser


def check_restored(ctx: TargetRun, files: tuple[FileRecord, ...]) -> None:
    for f in files:
        if assess.file_verdict(f, ctx.tree.sha256(f.path)) != "pristine":
            raise Refused(
                f"{ctx.target.at}: after rolling back, {f.path} does not have its original "
                "bytes",
                f"inspect it (`git -C {shlex.quote(str(ctx.target.root))} status`); "
                "the journal is kept",
            )


def same_run(manifest: Manifest, journal: Journal) -> bool:
    """Whether `manifest` was written by the apply of `journal` (not one applied before)."""
    if journal.txn:
        return manifest.txn == journal.txn
    return manifest.applied_at >= journal.started


def remove_temps(ctx: TargetRun, touched: tuple[FileRecord, ...]) -> None:
    """A run killed inside a write leaves a temp file next to the file: not the user's."""
    for f in touched:
        ctx.tree.remove_temps(f.path)
    ctx.state.remove_temps()
