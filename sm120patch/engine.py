"""Apply, revert, recover, ensure, status: the engine's contract (DESIGN.md s3). Never prints.

Every verdict is decided from the bytes on disk (`assess`), never from the manifest alone.
An apply is one transaction over every target of the profile:
    preflight (shared with the dry run) -> journal (+ pristine copies) -> write (+ one commit
    per patch on a checkout) -> verify -> manifest -> close journal.
Any failure before the journal is closed rolls every target back; a kill leaves the journal
behind, and `recover` finishes the rollback. A revert is rolled forward by `recover` instead:
both end states are exact.

Across targets, the journals of one run share a transaction id (`txn`) and name each other
(`peers`). An apply is committed once every target's manifest of that txn is written:
`recover` then closes the journals left open instead of rolling back, so a kill between two
journal closes cannot leave one target patched and the other pristine. A revert writes every
target's journal before it changes anything, and `recover` rolls the whole of it forward,
journaling peers the killed run had not reached yet.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch import __version__, assess, catalog, interrupts, procscan, state, targets
from sm120patch import plan as planner
from sm120patch.assess import Assessment
from sm120patch.errors import Refused, Sm120Error
from sm120patch.layouts import InstalledLayout, layout_of
from sm120patch.plan import Plan, PlanRefused
from sm120patch.state import FileRecord, Journal, Manifest, Peer, TargetState, sha256, trial_key
from sm120patch.targets import Target
from sm120patch.transform import Outcome

if TYPE_CHECKING:
    from sm120patch.lockfile import Lock

BRANCH_PREFIX = state.BRANCH_PREFIX
KILL_ENV = state.KILL_ENV
TRACE_ENV = state.TRACE_ENV
kill_point = state.kill_point
drop_pycache = state.drop_pycache


@dataclass
class TargetReport:
    target: Target
    branch: str | None = None
    commits: list[str] = field(default_factory=list)
    files: list[dict[str, str]] = field(default_factory=list)
    state: str | None = None  # the target's state when the command finished

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.target.to_dict(),
            "branch": self.branch,
            "commits": self.commits,
            "files": self.files,
            "state": self.state,
        }


@dataclass
class Report:
    # "applied", "nothing-to-do", "reverted", "dropped" (only stale records), "recovered"
    action: str
    profile: str | None
    targets: list[TargetReport]
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: Plan | None = None
    # A `revert --dry-run`: what the revert would do (`action`) and write (`restores`, a diff
    # from the bytes on disk to the restored ones); nothing was changed.
    dry_run: bool = False
    restores: str = ""

    @property
    def changed(self) -> bool:
        return self.action in ("applied", "reverted", "recovered")

    def to_dict(self) -> dict[str, Any]:
        diff = self.plan.diff() if self.plan is not None and self.action == "applied" else ""
        return {
            "action": self.action,
            "changed": self.changed,
            "dry_run": self.dry_run,
            "profile": self.profile,
            "targets": [t.to_dict() for t in self.targets],
            "outcomes": [o.to_dict() for o in self.outcomes],
            "notes": self.notes,
            # What an apply wrote, as the dry run showed it (a fleet's diff mode needs no
            # second call); what a revert would write back, for its dry run.
            "diff": self.restores if self.dry_run else diff,
        }


class _Ctx:
    """One target during a run: its state directory and its layout (git or installed)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.state = TargetState.of(target.root, target.layout, target.kind)
        self._layout: InstalledLayout | None = None

    @property
    def layout(self) -> InstalledLayout:
        # Made on first use: GitPython is imported only by runs that touch git.
        if self._layout is None:
            self._layout = layout_of(self.target, self.state)
        return self._layout

    def path(self, rel: str) -> Path:
        return state.inside(self.target.root, rel)

    def peer(self) -> Peer:
        t = self.target
        return Peer(t.kind, str(t.root), t.layout)

    def assess(self) -> Assessment:
        return assess.assess(self.target, self.state)


@contextmanager
def _locked(ctxs: list[_Ctx]) -> Iterator[None]:
    with ExitStack() as stack:
        for ctx in ctxs:
            stack.enter_context(ctx.state.locked())
        yield


def _refuse_unfinished(ctxs: list[_Ctx]) -> None:
    for ctx in ctxs:
        journal = ctx.state.journal()
        if journal is not None:
            raise Refused(
                f"an interrupted sm120patch {journal.op} left a journal on {ctx.target.root}",
                "run `sm120patch recover` (with the same --sglang/--flashinfer) first",
            )


# ---- preflight: one for the dry run and the apply ----------------------------------------


@dataclass
class Prepared:
    """What an apply would do, decided with nothing written: the dry run shows it."""

    profile: catalog.Profile
    ctxs: list[_Ctx]
    plan: Plan | None
    notes: list[str] = field(default_factory=list)
    # targets whose manifest describes a patch that is gone or replaced: dropped on apply
    stale: list[_Ctx] = field(default_factory=list)
    branches: dict[str, str | None] = field(default_factory=dict)
    nothing_to_do: bool = False


def _targets(
    profile: catalog.Profile,
    paths: Mapping[str, str | Path | None],
    force: bool,
    lock: Lock | None = None,
) -> list[_Ctx]:
    found = planner.resolve_targets(profile, paths)
    outside = planner.check_pins(profile, found)
    if outside and not force:
        raise Refused("; ".join(outside), "use a pinned release, or --force to apply anyway")
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
    return [_Ctx(t) for t in found]


def _preflight(
    profile: catalog.Profile,
    ctxs: list[_Ctx],
    *,
    check_plan: Callable[[Plan], None] | None,
    lock: Lock | None,
) -> Prepared:
    _refuse_unfinished(ctxs)
    prep = Prepared(profile, ctxs, None)
    applied = []
    for ctx in ctxs:
        found = ctx.assess()
        other = found.profile
        if found.state == assess.PRISTINE:
            continue
        if found.state == assess.APPLIED and other == profile.name:
            applied.append((ctx, found))
            continue
        if found.state in (assess.GONE, assess.REPLACED):
            prep.notes.append(f"{ctx.target.name} at {ctx.target.root}: {found.message}")
            prep.stale.append(ctx)
            continue
        if other != profile.name:
            raise Refused(
                f"profile {other} is applied on {ctx.target.root} ({found.state})",
                f"revert it first (`sm120patch revert {other}`), then "
                f"`sm120patch apply {profile.name}`",
            )
        raise Refused(
            f"{ctx.target.root}: {found.message}",
            f"see `sm120patch status`; `sm120patch revert {other} --force` discards the "
            "edits, then apply again",
        )
    if lock is not None:
        for ctx, found in applied:
            _check_applied_matches_lock(ctx, found, lock)
    if len(applied) == len(ctxs):
        prep.nothing_to_do = True
        prep.notes.append(
            f"profile {profile.name} is already applied: every touched file has the bytes "
            "sm120patch wrote" + (" and the lock's" if lock is not None else "")
        )
        return prep
    cat = catalog.load()
    for ctx in ctxs:
        # Before planning: a user's uncommitted edit must be named as such, not reported as an
        # unknown shape.
        ctx.layout.check_ready(_candidate_files(cat, profile, ctx.target))
    # A lock carries its reviewed result: where the files match it, no parse is needed.
    plan = lock.plan(profile, [c.target for c in ctxs]) if lock is not None else None
    if plan is None:
        plan = planner.plan(profile.name, found=[c.target for c in ctxs], force=True)
    prep.plan = plan
    if plan.refused:
        raise PlanRefused(plan)
    if check_plan is not None:
        if lock is not None:
            check_plan(plan, frozenset(c.target.kind for c, _ in applied))  # type: ignore[call-arg]
        else:
            check_plan(plan)
    if not plan.applies:
        prep.nothing_to_do = True
        prep.notes.append("every site is already SM120-ready; nothing was changed")
        return prep
    tplans = {tp.target.kind: tp for tp in plan.targets}
    for ctx in ctxs:
        tp = tplans[ctx.target.kind]
        if not tp.changed:
            continue
        for f in tp.changed:
            _check_writable(ctx.path(tp.target.rel(f.file)))
        prep.branches[ctx.target.kind] = ctx.layout.patch_branch(profile.name)
    return prep


def _check_applied_matches_lock(ctx: _Ctx, found: Assessment, lock: Lock) -> None:
    assert found.manifest is not None
    want = {f["path"]: f["after"] for f in lock.files if f["target"] == ctx.target.kind}
    have = {f.module: f.after for f in found.manifest.files}
    if want != have or lock.versions.get(ctx.target.kind) != ctx.target.version:
        raise Refused(
            f"{ctx.target.root}: profile {found.profile} is applied, but not as the lock says "
            "(other files, bytes or version)",
            f"revert it (`sm120patch revert {found.profile}`), then apply the lock",
        )


def _check_writable(path: Path) -> None:
    """Before the journal: every file we will write can be written, as a regular file."""
    if path.is_symlink():
        raise Refused(
            f"{path} is a symbolic link; sm120patch writes regular files only",
            "replace the link by the file it points to, or patch the tree it points into",
        )
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise Refused(
            f"cannot write in {path.parent} (permission denied); nothing was changed",
            "run sm120patch as a user who can write there, or make it writable",
        )


def _candidate_files(cat: catalog.Catalog, profile: catalog.Profile, target: Target) -> list[str]:
    """Every existing file the profile's patches may touch on this target."""
    rels = {
        target.rel(f)
        for p in cat.patches_of(profile)
        if p.target == target.kind
        for f in p.files
        if target.path_of(f).exists()
    }
    return sorted(rels)


# ---- apply -------------------------------------------------------------------------------


def dry_run(
    profile_name: str,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
    check_plan: Callable[[Plan], None] | None = None,
    lock: Lock | None = None,
) -> Prepared:
    """The apply minus the writes: the same preflight, the same refusals; writes nothing."""
    profile = catalog.load().profile(profile_name)
    ctxs = _targets(profile, paths, force, lock)
    for ctx in ctxs:
        ctx.state.check_unlocked()
    prep = _preflight(profile, ctxs, check_plan=check_plan, lock=lock)
    if prep.plan is None:
        prep.plan = planner.plan(profile.name, found=[c.target for c in ctxs], force=True)
    return prep


def apply(
    profile_name: str,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    check_plan: Callable[[Plan], None] | None = None,
    lock: Lock | None = None,
) -> Report:
    """Apply a profile to its targets as one transaction. Raises Refused with nothing changed.

    `check_plan` sees the plan before anything is written (a lock file's comparison); with
    `lock`, every written file must end with the lock's after-hash or the apply rolls back.
    """
    profile = catalog.load().profile(profile_name)
    ctxs = _targets(profile, paths, force, lock)
    with _locked(ctxs):
        prep = _preflight(profile, ctxs, check_plan=check_plan, lock=lock)
        if prep.nothing_to_do:
            for ctx in prep.stale:
                # The new release needs nothing (upstream has it): the old record goes.
                ctx.state.remove_manifest()
                ctx.state.drop_copies()
            return Report(
                "nothing-to-do",
                profile.name,
                [TargetReport(c.target, state=assess.APPLIED) for c in ctxs],
                outcomes=prep.plan.outcomes if prep.plan else [],
                notes=prep.notes,
                plan=prep.plan,
            )
        if preconditions is not None:
            preconditions()
        assert prep.plan is not None
        report = _transaction(prep, lock)
        report.notes[:0] = [*prep.notes, *(
            [f"re-applied {profile.name}"] if prep.stale else []
        )]  # fmt: skip
        return report


def _transaction(prep: Prepared, lock: Lock | None) -> Report:
    plan = prep.plan
    assert plan is not None
    profile = prep.profile
    tplans = {tp.target.kind: tp for tp in plan.targets}
    work = [(ctx, tplans[ctx.target.kind]) for ctx in prep.ctxs if tplans[ctx.target.kind].changed]
    for ctx in prep.stale:
        # The record of a patch that is gone (or of another release) describes nothing on
        # disk: dropping it loses nothing, and a kill from here leaves the true state.
        ctx.state.remove_manifest()
        ctx.state.drop_copies()
    journals: dict[str, Journal] = {}
    reports: list[TargetReport] = []
    txn = _new_txn()
    peers = tuple(ctx.peer() for ctx, _ in work)
    # [signals] SIGINT/SIGTERM/SIGHUP are deferred from here to the last journal's close.
    with interrupts.critical(
        "apply",
        profile.name,
        abortable=True,
        unfinished=lambda: any(c.state.journal() is not None for c, _ in work),
    ) as guard:
        try:
            for ctx, tp in work:
                journals[ctx.target.kind] = _start_apply(
                    ctx, tp, profile.name, prep.branches.get(ctx.target.kind), txn, peers
                )
            for ctx, tp in work:
                reports.append(_write_target(ctx, tp, journals[ctx.target.kind], plan))
            for ctx, tp in work:
                _verify(ctx, tp, lock)
            for (ctx, _), report in zip(work, reports, strict=True):
                kill_point("before-manifest")
                _write_manifest(ctx, journals[ctx.target.kind], report, profile, lock)
                kill_point("after-manifest")
        except BaseException as exc:
            guard.rolling_back()  # [signals] nothing aborts the rollback
            _roll_back_all([ctx for ctx, _ in work], exc)
            if isinstance(exc, OSError):
                raise Refused(
                    f"apply failed writing {exc.filename or 'a file'}: {exc.strerror}; "
                    "every file was put back as it was",
                    "fix the cause (disk space, permissions), then apply again",
                ) from exc
            raise
        # Every manifest is written: the apply is committed (see the module's docstring).
        guard.commit()  # [signals] from here a signal no longer rolls back
        for ctx, _ in work:
            ctx.state.close_journal()
            kill_point("after-close")
    for r in reports:
        r.state = assess.APPLIED
    return Report("applied", profile.name, reports, outcomes=plan.outcomes, plan=plan)


def _roll_back_all(ctxs: list[_Ctx], cause: BaseException) -> None:
    """Undo every target that has a journal of this run; if that fails too, say so."""
    for ctx in reversed(ctxs):
        try:
            journal = ctx.state.journal()
            if journal is not None:
                _rollback_apply(ctx, journal)
        except Exception as exc:
            raise Refused(
                f"apply failed ({cause}) and rolling back {ctx.target.root} failed too ({exc})",
                "the journal is kept: fix the cause, then run `sm120patch recover`",
            ) from exc


def _start_apply(
    ctx: _Ctx,
    tp: planner.TargetPlan,
    profile: str,
    branch: str | None,
    txn: str,
    peers: tuple[Peer, ...],
) -> Journal:
    files = []
    for f in tp.changed:
        rel = tp.target.rel(f.file)
        path = ctx.path(rel)
        data = path.read_bytes()
        planned = sha256(f.before.encode("utf-8"))
        if sha256(data) != planned:
            # Read again for the journal: an install that landed since the plan must not get a
            # patch of the old text written over it.
            raise Refused(
                f"{path} changed since it was planned (an install or an editor wrote it); "
                "nothing was changed",
                "run the apply again once nothing else is writing the tree",
            )
        files.append(
            FileRecord(rel, f.file, planned, sha256(f.after.encode("utf-8")),
                       path.stat().st_mode & 0o7777)  # fmt: skip
        )
    journal = Journal(
        op="apply",
        profile=profile,
        started=time.time(),
        pid=os.getpid(),
        pid_start=_start_time(),
        boot_id=procscan.boot_id(),  # [signals] with pid_start: recover's proof the run is dead
        txn=txn,
        peers=peers,
        tool_version=__version__,
        target=tp.target.to_dict(),
        files=tuple(files),
        git=ctx.layout.base(branch) if branch else None,
    )
    # The journal comes first: a kill while copying then finds the files still pristine.
    ctx.state.write_journal(journal)
    if ctx.layout.keeps_pristine():
        for f in files:
            ctx.state.keep_copy("pristine", f.path, ctx.path(f.path).read_bytes())
            kill_point("after-copy")
    kill_point("after-journal")
    return journal


def _new_txn() -> str:
    # uuid4's 122 random bits, from the same source; `import uuid` brings `platform` (3 ms).
    return os.urandom(16).hex()


def _start_time() -> str | None:
    """This process's start time (field 22 of /proc/self/stat), to tell a reused pid apart."""
    return procscan.start_time(os.getpid())  # [signals] one /proc parser


def _write_target(ctx: _Ctx, tp: planner.TargetPlan, journal: Journal, plan: Plan) -> TargetReport:
    cat = catalog.load()
    order = {pid: i for i, pid in enumerate(plan.profile.patches)}
    if journal.git is not None:
        # One commit per patch: every step's text, in profile order.
        steps = sorted(
            ((pid, f, text) for f in tp.changed for pid, text in f.step_texts()),
            key=lambda s: order[s[0]],
        )
    else:
        # No commits to make: each file is written once, with its final text.
        steps = [(f.step_texts()[-1][0], f, f.after) for f in tp.changed]
    report = TargetReport(tp.target)
    if journal.git is not None:
        ctx.layout.begin(journal.git.patch_branch)
        report.branch = journal.git.patch_branch
        kill_point("after-branch")
    for pid, f, text in steps:
        rel = tp.target.rel(f.file)
        path = ctx.path(rel)
        state.atomic_write(path, text.encode("utf-8"), mode=path.stat().st_mode)
        drop_pycache(path)
        kill_point("after-write")
        patch = cat.patches[pid]
        message = (
            f"sm120patch: {patch.title}\n\n{patch.why}\n\n"
            f"Sm120patch-Patch: {pid}\n"
            f"Sm120patch-Profile: {plan.profile.name}\n"
            f"Sm120patch-Version: {__version__}\n"
        )
        commit = ctx.layout.record_step(rel, message)
        if commit is not None:
            report.commits.append(commit)
            kill_point("after-commit")
    for f in tp.changed:
        rel = tp.target.rel(f.file)
        ctx.state.keep_copy("patched", rel, f.after.encode("utf-8"))
        report.files.append({"path": rel, "state": "patched"})
    return report


def _verify(ctx: _Ctx, tp: planner.TargetPlan, lock: Lock | None) -> None:
    """The bytes on disk are exactly the planned text (and the lock's, when applying one).

    The plan already compiled that text and ran every patch on it again (each said
    already-applied): those checks hold for the file."""
    locked = {}
    if lock is not None:
        locked = {f["path"]: f["after"] for f in lock.files if f["target"] == ctx.target.kind}
    for f in tp.changed:
        path = ctx.path(tp.target.rel(f.file))
        data = path.read_bytes()
        if data != f.after.encode("utf-8"):
            raise Refused(
                f"verify: {path} does not hold the planned text after writing",
                "something else is writing this file; everything was rolled back",
            )
        if lock is not None and locked.get(f.file) != sha256(data):
            raise Refused(
                f"verify: {path} does not have the lock's after-hash "
                f"({str(locked.get(f.file))[:12]} locked, {sha256(data)[:12]} written); "
                "everything was rolled back",
                "make a new lock with `sm120patch pin` on the reference box",
            )


def _write_manifest(
    ctx: _Ctx, journal: Journal, report: TargetReport, profile: catalog.Profile, lock: Lock | None
) -> None:
    from dataclasses import replace

    git = journal.git
    manifest = Manifest(
        profile=journal.profile,
        patches=tuple(sorted(set(profile.patches))),
        tool_version=__version__,
        applied_at=time.time(),
        target=journal.target,
        files=journal.files,
        git=None if git is None else replace(git, commits=tuple(report.commits)),
        txn=journal.txn,
        lock=lock.digest() if lock is not None else None,
    )
    ctx.state.write_manifest(manifest)


def _rollback_apply(ctx: _Ctx, journal: Journal) -> None:
    """Put every file of an unfinished apply back as it was, and git where it was."""
    _remove_temps(ctx, journal.files)
    ctx.layout.roll_back(journal.files, journal.git)
    if not ctx.layout.keeps_pristine():
        # Git put the files back (the branch switch); check it did, byte for byte.
        _check_restored(ctx, journal.files)
    manifest = ctx.state.manifest() if (ctx.state.dir / state.MANIFEST).exists() else None
    if manifest is not None and _same_run(manifest, journal):
        ctx.state.remove_manifest()
    ctx.state.drop_copies()
    ctx.state.close_journal()


def _check_restored(ctx: _Ctx, files: tuple[FileRecord, ...]) -> None:
    from sm120patch.state import file_sha256

    for f in files:
        if file_sha256(ctx.path(f.path)) != f.before:
            raise Refused(
                f"{ctx.target.root}: after rolling back, {f.path} does not have its original "
                "bytes",
                f"inspect it (`git -C {ctx.target.root} status`); the journal is kept",
            )


def _same_run(manifest: Manifest, journal: Journal) -> bool:
    """Whether `manifest` was written by the apply of `journal` (not one applied before)."""
    if journal.txn:
        return manifest.txn == journal.txn
    return manifest.applied_at >= journal.started


def _remove_temps(ctx: _Ctx, files: tuple[FileRecord, ...]) -> None:
    """A run killed inside a write leaves a temp file next to the file: not the user's."""
    for f in files:
        state.remove_temps(ctx.path(f.path))
    ctx.state.remove_temps()


# ---- revert ------------------------------------------------------------------------------


def revert(
    profile_name: str | None,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
    keep_branch: bool = False,
) -> Report:
    """Revert `profile_name` (None: whatever is applied) on the targets at `paths`."""
    ctxs = _revert_targets(profile_name, paths)
    reports: list[TargetReport] = []
    notes: list[str] = []
    with _locked(ctxs):
        todo, stale, nothing = _revert_preflight(profile_name, ctxs, force)
        if nothing is not None:
            return nothing
        for ctx, found_state in stale:
            # Never write one release's bytes into another, nor pristine bytes over a branch:
            # the patch is already gone, only its record is left.
            assert found_state.manifest is not None
            notes.append(_dropped_note(ctx, found_state))
            if found_state.state == assess.GONE:
                notes.extend(ctx.layout.drop_branch(found_state.manifest.git, keep_branch))
            ctx.state.remove_manifest()
            ctx.state.drop_copies()
            reports.append(TargetReport(ctx.target, state=found_state.state))
        txn = _new_txn()
        peers = tuple(ctx.peer() for ctx, _ in todo)
        journals = []
        # [signals] deferred from the first journal write to the last close: a revert is
        # finished, never cut short.
        with interrupts.critical(
            "revert",
            profile_name,
            abortable=False,
            unfinished=lambda: any(c.state.journal() is not None for c, _ in todo),
        ):
            for ctx, manifest in todo:
                journal = Journal(
                    op="revert",
                    profile=manifest.profile,
                    started=time.time(),
                    pid=os.getpid(),
                    pid_start=_start_time(),
                    boot_id=procscan.boot_id(),  # [signals] as in _start_apply
                    txn=txn,
                    peers=peers,
                    tool_version=__version__,
                    manifest=manifest,
                    keep_branch=keep_branch,
                )
                ctx.state.write_journal(journal)
                kill_point("after-journal")
                journals.append((ctx, journal))
            # Every journal is written before anything changes: from here on, recover rolls the
            # whole revert forward.
            try:
                for ctx, journal in journals:
                    report, more = _finish_revert(ctx, journal)
                    reports.append(report)
                    notes.extend(more)
            except OSError as exc:
                raise Refused(
                    f"revert failed writing {exc.filename or 'a file'}: {exc.strerror}",
                    "the journal is kept: fix the cause (disk space, permissions), then run "
                    "`sm120patch recover` to finish the revert",
                ) from exc
    return Report("reverted" if todo else "dropped", profile_name, reports, notes=notes)


def revert_dry_run(
    profile_name: str | None,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
) -> Report:
    """The revert minus the writes: the same preflight refuses the same way; the report says
    what the revert would do, and `restores` is the diff of what it would write back."""
    from sm120patch.plan import diff_texts

    ctxs = _revert_targets(profile_name, paths)
    for ctx in ctxs:
        ctx.state.check_unlocked()
    todo, stale, nothing = _revert_preflight(profile_name, ctxs, force)
    if nothing is not None:
        nothing.dry_run = True
        return nothing
    reports: list[TargetReport] = []
    notes = [_dropped_note(ctx, found, dry_run=True) for ctx, found in stale]
    reports += [TargetReport(ctx.target, state=found.state) for ctx, found in stale]
    diffs = []
    for ctx, manifest in todo:
        report = TargetReport(ctx.target, state=assess.PRISTINE)
        restored = ctx.layout.restores(manifest.files, manifest.git)
        for f in manifest.files:
            now = ctx.path(f.path)
            data = now.read_bytes() if now.is_file() else b""
            after = restored[f.path]
            report.files.append({"path": f.path, "state": "pristine"})
            if after is not None and after != data:
                diffs.append(diff_texts(f.path, data.decode("utf-8", "replace"),
                                        after.decode("utf-8", "replace")))  # fmt: skip
        reports.append(report)
    return Report("reverted" if todo else "dropped", profile_name, reports, notes=notes,
                  dry_run=True, restores="".join(diffs))  # fmt: skip


def _revert_targets(profile_name: str | None, paths: Mapping[str, str | Path | None]) -> list[_Ctx]:
    kinds = catalog.TARGETS if profile_name is None else catalog.load().profile(
        profile_name).targets  # fmt: skip
    found = [targets.find_quiet(k, paths.get(k), required=paths.get(k) is not None) for k in kinds]
    return [_Ctx(t) for t in found if t is not None]


def _revert_preflight(
    profile_name: str | None, ctxs: list[_Ctx], force: bool
) -> tuple[list[tuple[_Ctx, Manifest]], list[tuple[_Ctx, Assessment]], Report | None]:
    """What a revert restores (`todo`), what records it only drops (`stale`), or the report
    that there is nothing to revert; refuses as the revert would, before anything is written."""
    _refuse_unfinished(ctxs)
    todo: list[tuple[_Ctx, Manifest]] = []
    stale: list[tuple[_Ctx, Assessment]] = []
    for ctx in ctxs:
        found_state = ctx.assess()
        manifest = found_state.manifest
        if manifest is None:
            continue
        if profile_name is not None and manifest.profile != profile_name:
            raise Refused(
                f"profile {manifest.profile} is applied on {ctx.target.root}, "
                f"not {profile_name}",
                f"run `sm120patch revert {manifest.profile}` or `revert --all`",
            )
        if found_state.state in (assess.GONE, assess.REPLACED):
            stale.append((ctx, found_state))
        else:
            todo.append((ctx, manifest))
    if not todo and not stale:
        what = f"profile {profile_name}" if profile_name else "anything"
        where = ", ".join(f"{c.target.name} at {c.target.root}" for c in ctxs)
        return todo, stale, Report(
            "nothing-to-do",
            profile_name,
            [TargetReport(c.target, state=assess.PRISTINE) for c in ctxs],
            notes=[f"sm120patch has not applied {what} on {where or 'any target found'}"],
        )
    for ctx, manifest in todo:
        _check_revertable(ctx, manifest, force)
    return todo, stale, None


def _dropped_note(ctx: _Ctx, found: Assessment, *, dry_run: bool = False) -> str:
    done = "the revert would drop the record" if dry_run else "dropped the record"
    return f"{ctx.target.name} at {ctx.target.root}: {found.message}; nothing to restore, {done}"


def _check_revertable(ctx: _Ctx, manifest: Manifest, force: bool) -> None:
    from sm120patch.state import file_sha256

    for f in manifest.files:
        path = ctx.path(f.path)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise Refused(
                f"{ctx.target.root}: the state of the apply names {f.path}, which is not a "
                "regular file",
                f"inspect {ctx.state.dir / state.MANIFEST}; if it is damaged, move it aside",
            )
    changed = [
        f for f in manifest.files if file_sha256(ctx.path(f.path)) not in (f.after, f.before)
    ]
    problems = []
    missing = [f.path for f in changed if not ctx.path(f.path).exists()]
    if missing:
        problems.append("deleted since the apply: " + ", ".join(missing))
    drifted = [f for f in changed if ctx.path(f.path).exists()]
    if drifted:
        problems.append(_drift_diff(ctx, drifted))
    git = manifest.git
    problems.extend(ctx.layout.changes_since_apply(git))
    ctx.layout.check_revertable(manifest.files, git)
    if problems and not force:
        raise Refused(
            f"{ctx.target.root}: changed since the apply; refusing to throw that away:\n"
            + "\n".join(problems),
            "keep your edits elsewhere, or `revert --force` to discard them",
        )


def _drift_diff(ctx: _Ctx, drifted: list[FileRecord]) -> str:
    import difflib

    out = []
    for f in drifted:
        ours = (ctx.state.copy("patched", f.path) or b"").decode("utf-8", "replace")
        now = ctx.path(f.path).read_bytes().decode("utf-8", "replace")
        out.extend(
            difflib.unified_diff(
                ours.splitlines(True),
                now.splitlines(True),
                f"sm120patch/{f.path}",
                f"yours/{f.path}",
            )
        )
    return "".join(out).rstrip("\n")


def _finish_revert(ctx: _Ctx, journal: Journal) -> tuple[TargetReport, list[str]]:
    """Idempotent: run again from the journal, it converges."""
    manifest = journal.manifest
    assert manifest is not None
    report = TargetReport(ctx.target, state=assess.PRISTINE)
    _remove_temps(ctx, manifest.files)
    ctx.layout.finish_revert(manifest.files, manifest.git, journal.keep_branch)
    notes = ctx.layout.drop_branch(manifest.git, journal.keep_branch)
    if manifest.git is not None and journal.keep_branch:
        report.branch = manifest.git.patch_branch
    for f in manifest.files:
        report.files.append({"path": f.path, "state": "pristine"})
    kill_point("before-manifest")
    ctx.state.remove_manifest()
    kill_point("after-manifest")
    ctx.state.drop_copies()
    ctx.state.close_journal()
    kill_point("after-close")
    return report, notes


# ---- recover -----------------------------------------------------------------------------


def recover(paths: Mapping[str, str | Path | None]) -> Report:
    """Finish what a killed run left: roll an apply back, roll a revert forward."""
    found = [
        targets.find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None)
        for kind in catalog.TARGETS
    ]
    ctxs = _with_peers([_Ctx(t) for t in found if t is not None])
    reports = []
    notes = []
    with _locked(ctxs), interrupts.critical(  # [signals] recover is finished, never cut short
        "recover",
        None,
        abortable=False,
        unfinished=lambda: any(c.state.journal() is not None for c in ctxs),
    ):
        journals = {ctx.target.kind: ctx.state.journal() for ctx in ctxs}
        for ctx in ctxs:
            journal = journals[ctx.target.kind]
            if journal is not None:
                notes.extend(ctx.layout.settle_after_kill(journal))
        _journal_revert_peers(ctxs, journals)
        try:
            for ctx in ctxs:
                journal = journals[ctx.target.kind]
                if journal is None:
                    continue
                if journal.op == "apply" and _apply_committed(journal):
                    _remove_temps(ctx, journal.files)
                    ctx.state.close_journal()
                    notes.append(
                        f"{ctx.target.root}: the interrupted apply of {journal.profile} had "
                        "written every target; kept it"
                    )
                elif journal.op == "apply":
                    _rollback_apply(ctx, journal)
                    notes.append(
                        f"{ctx.target.root}: rolled back the interrupted apply of "
                        f"{journal.profile}"
                    )
                else:
                    _, more = _finish_revert(ctx, journal)
                    notes.append(
                        f"{ctx.target.root}: finished the interrupted revert of {journal.profile}"
                    )
                    notes.extend(more)
                reports.append(TargetReport(ctx.target, state=ctx.assess().state))
        except OSError as exc:
            raise Refused(
                f"recover failed writing {exc.filename or 'a file'}: {exc.strerror}",
                "the journal is kept: fix the cause (permissions, disk space), then run "
                "`sm120patch recover` again",
            ) from exc
    if not reports:
        notes.append("nothing to recover")
    return Report("recovered" if reports else "nothing-to-do", None, reports, notes=notes)


def _with_peers(ctxs: list[_Ctx]) -> list[_Ctx]:
    """`ctxs` and the targets their journals name: recover finishes a whole transaction."""
    out = list(ctxs)
    # (kind, root): SGLang and FlashInfer may share a root (one site-packages).
    seen = {(ctx.target.kind, ctx.target.root) for ctx in ctxs}
    for ctx in ctxs:
        journal = ctx.state.journal()
        for peer in journal.peers if journal else ():
            root = Path(peer.root)
            if (peer.kind, root) in seen or peer.kind in {c.target.kind for c in out}:
                continue
            try:
                target = targets.find_quiet(peer.kind, root, required=False)
            except Sm120Error:
                target = None  # gone: its own journal (if any) is recovered where it is
            if target is not None and target.root == root:
                out.append(_Ctx(target))
                seen.add((peer.kind, root))
    return out


def _apply_committed(journal: Journal) -> bool:
    """Whether every target of the journal's apply has its manifest of that apply."""
    if not journal.txn:
        return False
    for peer in journal.peers:
        manifest = TargetState.of(Path(peer.root), peer.layout, peer.kind).manifest()
        if manifest is None or manifest.txn != journal.txn:
            return False
    return True


def _journal_revert_peers(ctxs: list[_Ctx], journals: dict[str, Journal | None]) -> None:
    """A revert killed while writing its journals: journal the targets it had not reached.

    Such a target still holds the manifest the revert was started on (nothing changes before
    every journal is written), and the user asked for its revert.
    """
    from dataclasses import replace

    for journal in [j for j in journals.values() if j and j.op == "revert"]:
        named = {(p.kind, Path(p.root)) for p in journal.peers}
        for ctx in ctxs:
            kind = ctx.target.kind
            if (kind, ctx.target.root) not in named or journals[kind] is not None:
                continue
            manifest = ctx.state.manifest()
            if manifest is None or not manifest.txn:
                continue  # finished, or nothing of ours to revert
            own = replace(journal, manifest=manifest, profile=manifest.profile)
            ctx.state.write_journal(own)
            journals[kind] = own


# ---- ensure ------------------------------------------------------------------------------


def ensure(
    profile_name: str,
    paths: Mapping[str, str | Path | None],
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    check_plan: Callable[[Plan], None] | None = None,
    lock: Lock | None = None,
    apply_if_needed: bool = True,
) -> Report:
    """For service start-up: the target ends exactly as wanted, or nothing changes (Refused).

    `apply_if_needed=False` only verifies (a Kubernetes init container, which cannot patch the
    server container's files): anything but "applied as wanted" is refused.

    Pristine or gone: applied first. Applied as wanted: nothing to do. Drifted, missing,
    unfinished, another profile, another release outside the pins or than the lock's:
    refused with nothing changed (apply's own preflight). Then the result is checked from the
    bytes again.
    """
    profile = catalog.load().profile(profile_name)
    ctxs = _targets(profile, paths, force, lock)
    # At every service start: when the bytes already say "as wanted", answer without the lock
    # (reading is safe; a run in progress would show as unfinished).
    found = [ctx.assess() for ctx in ctxs]
    if all(a.state == assess.APPLIED and a.profile == profile.name for a in found):
        try:
            if lock is not None:
                for ctx, a in zip(ctxs, found, strict=True):
                    _check_applied_matches_lock(ctx, a, lock)
            return Report(
                "nothing-to-do",
                profile.name,
                [TargetReport(c.target, state=assess.APPLIED) for c in ctxs],
                notes=[
                    f"profile {profile.name} is already applied: every touched file has the "
                    "bytes sm120patch wrote" + (" and the lock's" if lock is not None else "")
                ],
            )
        except Refused:
            if not apply_if_needed:
                raise
            # not as the lock says: apply's preflight refuses with the full story
    if not apply_if_needed:
        wrong = next(a for a in found if not (a.state == assess.APPLIED
                                              and a.profile == profile.name))  # fmt: skip
        raise Refused(
            f"{wrong.target.root}: {wrong.state}: {wrong.message}",
            "apply it where the files can be written (`sm120patch ensure` without --no-apply)",
        )
    report = apply(
        profile_name, paths, force=force, preconditions=preconditions, check_plan=check_plan,
        lock=lock,
    )  # fmt: skip
    for ctx in ctxs:  # the same targets, their bytes read again after the apply
        found = ctx.assess()
        if found.state != assess.APPLIED or found.profile != profile.name:
            raise Refused(
                f"{ctx.target.root}: {found.message}",
                "see `sm120patch status`",
            )
    return report


# ---- status (decided in assess.py, from the bytes) ---------------------------------------

# Part of the engine's API; `sm120patch status` calls assess directly (no planner import).
status = assess.status
TargetStatus = assess.TargetStatus


def record_trial(
    paths: Mapping[str, str | Path | None], profile: str, trial: dict[str, Any]
) -> None:
    """Keep a trial's record on every target of its profile (it survives the revert)."""
    for kind in catalog.load().profile(profile).targets:
        target = targets.find_quiet(kind, paths.get(kind), required=False)
        if target is None:
            continue
        st = TargetState.of(target.root, target.layout, target.kind)
        with st.locked():
            st.add_trial(trial)


def forget_trials(paths: Mapping[str, str | Path | None], keys: Collection[str]) -> int:
    """Remove the trials named by `keys` (`state.trial_key`) from every target found in
    `paths` (a trial is kept on each target of its profile); how many records went."""
    dropped = 0
    for kind in targets.KINDS:
        target = targets.find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None)
        if target is None:
            continue
        st = TargetState.of(target.root, target.layout, target.kind)
        if not any(trial_key(t) in keys for t in st.trials()):
            continue  # nothing to remove: no lock taken, no state directory made
        with st.locked():
            dropped += st.drop_trials(keys)
    return dropped
