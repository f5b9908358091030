"""`apply` and its dry run: one transaction over every target of a profile.

preflight (shared with the dry run, so it refuses exactly as the apply would) -> journal (+
pristine copies) -> write (on a checkout: one commit per patch built in git's object database,
the branch moved once, one checkout; `layouts.GitLayout.write_all`) -> verify -> manifest ->
close the journal. Any failure before the journal is closed rolls every target back; a kill leaves
the journal behind for `recover`. Across targets, the journals of one run share a transaction
id and name each other (peers): the apply is committed once every manifest of that id is
written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch import __version__
from sm120patch.engine import assess, interrupts, needsnothing
from sm120patch.engine.assess import Assessment
from sm120patch.engine.records import (
    FileRecord,
    Journal,
    Manifest,
    Op,
    Peer,
    TargetRecord,
)
from sm120patch.engine.reports import Action, Report, ReportedFile, TargetReport
from sm120patch.engine.run import (
    TargetRun,
    check_applied_matches_lock,
    check_evidence,
    check_restored,
    check_writable,
    locked,
    new_txn,
    refuse_unfinished,
    remove_temps,
    runs_for,
    same_run,
    start_time,
    unchecked_refusals,
)
from sm120patch.engine.store import Waiting
from sm120patch.errors import NotWritable, Refused
from sm120patch.plan import catalog, planner, plans
from sm120patch.plan.plans import Plan, PlanRefused
from sm120patch.targets import Target, procscan
from sm120patch.targets.files import sha256
from sm120patch.targets.resolved import Given, owned, resolved

if TYPE_CHECKING:
    from sm120patch.plan.lockfile import Lock, PlanCheck


@dataclass
class Prepared:
    """What an apply would do, decided with nothing written: the dry run shows it."""

    profile: catalog.Profile
    ctxs: list[TargetRun]
    plan: Plan | None
    cat: catalog.Catalog  # the command's (its packs), which the profile is of
    notes: list[str] = field(default_factory=list)
    # targets whose manifest describes a patch that is gone or replaced: dropped on apply
    stale: list[TargetRun] = field(default_factory=list)
    branches: dict[str, str | None] = field(default_factory=dict)
    nothing_to_do: bool = False
    # targets already as wanted (the profile applied, or its record that it needs nothing)
    wanted: list[TargetRun] = field(default_factory=list)


def _preflight(
    profile: catalog.Profile,
    ctxs: list[TargetRun],
    *,
    check_plan: PlanCheck | None,
    lock: Lock | None,
    given: Given,
    reading: bool = False,
    seen: Mapping[str, Assessment] | None = None,
) -> Prepared:
    """The apply's checks and plan. `reading` (the dry run): what only keeps this user from
    writing is a note, not a refusal, since a diff is reviewed with read access alone.
    `seen`: the targets' assessments made before the lock (`ensure`'s), which stand while
    their state is unchanged (`TargetRun.assess`)."""
    refuse_unfinished(ctxs)
    if lock is not None and check_plan is None:
        from sm120patch.plan import lockfile

        check_plan = lockfile.check(lock, Path("the lock file"))  # a lock is always verified
    cat = catalog.load(resolved(given).config)
    prep = Prepared(profile, ctxs, None, cat)
    prep.notes += unchecked_refusals(profile, [c.target for c in ctxs], given)
    early: Plan | None = None
    if profile.status == "refused":
        # A profile refused by design refuses before any other check: "revert the other
        # profile first, then apply this one" would send the user to a revert for nothing.
        # Nothing below writes, so where it does not refuse this plan stands for the apply.
        early = prep.plan = planner.plan_admitted(profile.name, [c.target for c in ctxs], given)
        if early.refused:
            raise PlanRefused(early, dry_run=reading)
    applied = []
    for ctx in ctxs:
        found = ctx.assess((seen or {}).get(ctx.target.kind))
        other = found.profile
        if found.state == assess.State.PRISTINE:
            continue
        if found.state == assess.State.APPLIED and other == profile.name:
            applied.append((ctx, found))
            prep.wanted.append(ctx)
            continue
        if found.state.stale or (found.manifest is not None and found.manifest.needs_nothing):
            # Another profile's record that it needs nothing here holds no byte of it: it
            # goes as a stale one does (that profile's other targets still refuse, below).
            prep.notes.append(
                f"{ctx.target.at}: {found.message}" if found.state.stale
                else f"{ctx.target.at}: dropped the record that profile {other} needs nothing "
                "here"
            )
            prep.stale.append(ctx)
            continue
        if other != profile.name:
            raise Refused(
                f"profile {other} is applied on {ctx.target.at} ({found.state})",
                f"revert it first (`sm120patch revert {other}`), then "
                f"`sm120patch apply {profile.name}`",
            )
        raise Refused(
            f"{ctx.target.at}: {found.message}",
            f"see `sm120patch status`; `sm120patch revert {other} --force` discards the "
            "edits, then apply again",
        )
    if lock is not None:
        for ctx, found in applied:
            check_applied_matches_lock(ctx, found, lock)
    if len(applied) == len(ctxs):
        prep.nothing_to_do = True
        prep.notes.append(
            f"profile {profile.name} is already applied: every touched file has the bytes "
            "sm120patch wrote" + (", the bytes the lock records" if lock is not None else "")
        )
        return prep
    for ctx in ctxs:
        # Before planning: a user's uncommitted edit must be named as such, not reported as an
        # unknown shape.
        ctx.layout.check_ready(_candidate_files(cat, profile, ctx.target))
    # Planned here, with the patches loaded here: a lock is a claim that `check_plan` holds
    # this plan to, never a source of bytes.
    plan = early or planner.plan_admitted(profile.name, [c.target for c in ctxs], given)
    prep.plan = plan
    if plan.refused:
        raise PlanRefused(plan, dry_run=reading)
    if check_plan is not None:
        # The targets already applied as the lock says were held to it above, file by file.
        check_plan(plan, frozenset(c.target.kind for c, _ in applied) if lock else frozenset())
    if not plan.applies:
        prep.nothing_to_do = True
        prep.notes.append(
            f"profile {profile.name} is already applied; nothing was changed"
            if applied
            else "every site is already SM120-ready; nothing was changed"
        )
        return prep
    tplans = {tp.target.kind: tp for tp in plan.targets}
    for ctx in ctxs:
        tp = tplans[ctx.target.kind]
        if not tp.changed:
            continue
        for f in tp.changed:
            with _noted_if(reading, prep.notes):
                check_writable(ctx, tp.target.rel(f.file))
        prep.branches[ctx.target.kind] = ctx.layout.patch_branch(profile.name)
    return prep


def _candidate_files(cat: catalog.Catalog, profile: catalog.Profile, target: Target) -> list[str]:
    """Every existing file the profile's patches may touch on this target."""
    rels = {
        target.rel(f)
        for p in cat.patches_of(profile)
        if p.target == target.kind
        for f in p.files
        if target.handle.exists(target.rel(f))
    }
    return sorted(rels)


@contextmanager
def _noted_if(reading: bool, notes: list[str]) -> Iterator[None]:
    """A dry run's way with a refusal that is only about writing: one note, the same words."""
    try:
        yield
    except NotWritable as exc:
        if not reading:
            raise
        note = f"the apply would refuse: {exc.message} ({exc.hint})"
        if note not in notes:
            notes.append(note)


def dry_run(
    profile_name: str,
    given: Given,
    *,
    force: bool = False,
    check_plan: PlanCheck | None = None,
    lock: Lock | None = None,
) -> Prepared:
    """The apply minus the writes: the same preflight, the same refusals; writes nothing."""
    with owned(given) as named:
        profile = catalog.load(named.config).profile(profile_name)
        ctxs = runs_for(profile, named, force, lock)
        unwritable: list[str] = []
        for ctx in ctxs:
            with _noted_if(True, unwritable):
                ctx.state.check_lockable()
        prep = _preflight(
            profile, ctxs, check_plan=check_plan, lock=lock, given=named, reading=True
        )
        prep.notes[:0] = unwritable
        if prep.plan is None:
            found = [c.target for c in ctxs]
            prep.plan = planner.plan_admitted(profile.name, found, named)
        return prep


def apply(
    profile_name: str,
    given: Given,
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    check_plan: PlanCheck | None = None,
    lock: Lock | None = None,
) -> Report:
    """Apply a profile to its targets (`given`: the command's, `Resolved`) as one transaction.
    Raises Refused with nothing changed.

    `check_plan` sees the plan before anything is written (a lock file's comparison); with
    `lock`, every written file must end with the lock's after-hash or the apply rolls back.
    """
    with owned(given) as named:
        profile = catalog.load(named.config).profile(profile_name)
        ctxs = runs_for(profile, named, force, lock)
        return apply_runs(
            profile, ctxs, named, preconditions=preconditions, check_plan=check_plan, lock=lock
        )


def apply_runs(
    profile: catalog.Profile,
    ctxs: list[TargetRun],
    given: Given,
    *,
    preconditions: Callable[[], None] | None = None,
    check_plan: PlanCheck | None = None,
    lock: Lock | None = None,
    seen: Mapping[str, Assessment] | None = None,
    wait: Waiting | None = None,
) -> Report:
    """`apply` on runs already made (`runs_for`, its pins checked); `seen` as `_preflight`
    takes it. The report's `unrecorded` names each target left without the profile's record.
    `wait`: a lock another run holds is waited for (`ensure`), and the trees then assessed
    again, as a second apply would."""
    with locked(ctxs, wait) as waited:
        if waited:
            seen = None  # the other run may have changed every tree since
        prep = _preflight(profile, ctxs, check_plan=check_plan, lock=lock, given=given, seen=seen)
        if prep.nothing_to_do:
            for ctx in prep.stale:
                ctx.verify()  # the state goes by path: only while it names the tree found
                # The new release needs nothing (upstream has it): the old record goes.
                ctx.state.remove_manifest()
                ctx.state.drop_copies()
            notes, unrecorded = needsnothing.record(
                prep.plan, prep.ctxs, prep.wanted, prep.cat, prep.profile, lock
            )
            return Report(
                Action.NOTHING_TO_DO,
                profile.name,
                [TargetReport(c.target, state=assess.State.APPLIED) for c in ctxs],
                outcomes=prep.plan.outcomes if prep.plan else [],
                notes=prep.notes + notes,
                plan=prep.plan,
                unrecorded=unrecorded,
            )
        if preconditions is not None:
            preconditions()
        assert prep.plan is not None
        report = _transaction(prep, lock)
        report.notes[:0] = [*prep.notes, *([f"re-applied {profile.name}"] if prep.stale else [])]
        # After the commit, outside the transaction: a kill before these records are written
        # loses nothing, the next apply or ensure plans those targets again and writes them.
        notes, report.unrecorded = needsnothing.record(
            prep.plan, prep.ctxs, prep.wanted, prep.cat, prep.profile, lock
        )
        report.notes += notes
        return report


def _transaction(prep: Prepared, lock: Lock | None) -> Report:
    plan = prep.plan
    assert plan is not None
    profile = prep.profile
    tplans = {tp.target.kind: tp for tp in plan.targets}
    work = [(ctx, tplans[ctx.target.kind]) for ctx in prep.ctxs if tplans[ctx.target.kind].changed]
    for ctx in prep.ctxs:
        # The transaction's start: every path still names the tree found, or nothing is written.
        ctx.verify()
    for ctx in prep.stale:
        # The record of a patch that is gone (or of another release) describes nothing on
        # disk: dropping it loses nothing, and a kill from here leaves the true state.
        ctx.state.remove_manifest()
        ctx.state.drop_copies()
    journals: dict[str, Journal] = {}
    reports: list[TargetReport] = []
    txn = new_txn()
    peers = tuple(ctx.peer() for ctx, _ in work)
    # [signals] SIGINT/SIGTERM/SIGHUP are deferred from here to the last journal's close.
    with interrupts.critical(
        "apply",
        profile.name,
        abortable=True,
        unfinished=lambda: any(c.journal_open() for c, _ in work),
    ) as guard:
        try:
            for ctx, tp in work:
                journals[ctx.target.kind] = _start_apply(
                    ctx, tp, profile.name, prep.branches.get(ctx.target.kind), txn, peers
                )
            for ctx, tp in work:
                reports.append(_write_target(ctx, tp, journals[ctx.target.kind], plan, prep.cat))
            for ctx, tp in work:
                _verify(ctx, tp, lock)
            for (ctx, _), report in zip(work, reports, strict=True):
                interrupts.kill_point("before-manifest")
                _write_manifest(ctx, journals[ctx.target.kind], report, profile, lock)
                interrupts.kill_point("after-manifest")
        except BaseException as exc:
            guard.rolling_back()  # [signals] nothing aborts the rollback
            _roll_back_all([ctx for ctx, _ in work], exc, profile.name)
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
            ctx.verify()
            ctx.state.close_journal()
            interrupts.kill_point("after-close")
    for r in reports:
        r.state = assess.State.APPLIED
    return Report(Action.APPLIED, profile.name, reports, outcomes=plan.outcomes, plan=plan)


def _roll_back_all(ctxs: list[TargetRun], cause: BaseException, profile: str) -> None:
    """Undo every target that has a journal of this run; if that fails too, say so. A target
    whose path names another tree now is rolled back through its handle alone (`moved`)."""
    moved: list[tuple[TargetRun, str]] = []
    for ctx in reversed(ctxs):
        try:
            why = ctx.tree.moved()
            if why is not None:
                ctx.layout.undo_own_writes()
                moved.append((ctx, why))
                continue
            journal = ctx.state.journal()
            if journal is not None:
                rollback_apply(ctx, journal)
        except Exception as exc:
            raise Refused(
                f"apply failed ({cause}) and rolling back {ctx.target.root} failed too ({exc})",
                "the journal is kept: fix the cause, then run `sm120patch recover`",
            ) from exc
    if moved:
        raise _moved(*moved[0], profile)


def _moved(ctx: TargetRun, why: str, profile: str) -> Refused:
    """The one line for a target whose path was swapped for another tree during the apply:
    nothing went through the new path; the tree found keeps its journal (its state and git
    are reached by path), which `recover` pointed at it finishes."""
    import shlex

    t, now = ctx.target, ctx.tree.where_now()
    done = "was put back" if ctx.layout.keeps_pristine() else "stays on its patch branch there"
    return Refused(
        f"{t.root} was replaced while sm120patch applied {profile} ({why} now): nothing was "
        f"written through the new path; what the apply wrote in the tree it found {done}",
        f"that tree, now at {now}, keeps the apply's journal: `sm120patch recover --{t.kind} "
        f"{shlex.quote(str(now))}` finishes it"
        if now is not None
        else "that tree was deleted since: nothing is left to finish there",
    )


def _start_apply(
    ctx: TargetRun,
    tp: plans.TargetPlan,
    profile: str,
    branch: str | None,
    txn: str,
    peers: tuple[Peer, ...],
) -> Journal:
    files = []
    for f in tp.changed:
        rel = tp.target.rel(f.file)
        path = ctx.path(rel)
        data = ctx.tree.read(rel)
        planned = sha256(f.before.encode("utf-8"))
        if sha256(data) != planned:
            # Read again for the journal: an install that landed since the plan must not get a
            # patch of the old text written over it.
            raise Refused(
                f"{path} changed since it was planned (an install or an editor wrote it); "
                "nothing was changed",
                "run the apply again once nothing else is writing the tree",
            )
        st = ctx.tree.lstat(rel)
        assert st is not None  # just read
        files.append(
            FileRecord(rel, f.file, planned, sha256(f.after.encode("utf-8")), st.st_mode & 0o7777)
        )
        ctx.layout.originals[rel] = data  # a rollback in this run restores what it read
    journal = Journal(
        op=Op.APPLY,
        profile=profile,
        started=time.time(),
        pid=os.getpid(),
        pid_start=start_time(),
        boot_id=procscan.boot_id(),  # [signals] with pid_start: recover's proof the run is dead
        txn=txn,
        peers=peers,
        tool_version=__version__,
        target=TargetRecord.of(tp.target),
        files=tuple(files),
        git=ctx.layout.base(branch) if branch else None,
    )
    # The journal comes first: a kill while copying then finds the files still pristine.
    ctx.verify()  # the state goes by path: only while it names the tree found
    ctx.state.write_journal(journal)
    if ctx.layout.keeps_pristine():
        for record in files:
            # The bytes read and checked above, never read again: a swap between that check
            # and a second read would make the copy another file's.
            interrupts.hook("before-copy")
            ctx.verify()
            ctx.state.keep_copy("pristine", record.path, ctx.layout.originals[record.path])
            interrupts.kill_point("after-copy")
    interrupts.kill_point("after-journal")
    return journal


def _write_target(
    ctx: TargetRun, tp: plans.TargetPlan, journal: Journal, plan: Plan, cat: catalog.Catalog
) -> TargetReport:
    order = {pid: i for i, pid in enumerate(plan.profile.patches)}
    writes = []
    for pid, f, text in ctx.layout.steps(tp.changed, order):
        patch = cat.patches[pid]
        message = (
            f"sm120patch: {patch.title}\n\n{patch.why}\n\n"
            f"Sm120patch-Patch: {pid}\n"
            f"Sm120patch-Profile: {plan.profile.name}\n"
            f"Sm120patch-Version: {__version__}\n"
        )
        writes.append((tp.target.rel(f.file), text, message))
    report = TargetReport(tp.target)
    # A checkout: one commit per patch, the branch moved once, one checkout (`GitLayout`).
    report.commits.extend(ctx.layout.write_all(writes, journal.git))
    if journal.git is not None:
        report.branch = journal.git.patch_branch
    ctx.verify()
    for f in tp.changed:
        rel = tp.target.rel(f.file)
        ctx.state.keep_copy("patched", rel, f.after.encode("utf-8"))
        report.files.append(ReportedFile(rel, "patched"))
    return report


def _verify(ctx: TargetRun, tp: plans.TargetPlan, lock: Lock | None) -> None:
    """The bytes on disk are exactly the planned text (and the lock's, when applying one).

    The plan already compiled that text and ran every patch on it again (each said
    already-applied): those checks hold for the file."""
    locked = {}
    if lock is not None:
        locked = {f.path: f.after for f in lock.files if f.target == ctx.target.kind}
    for f in tp.changed:
        path = ctx.path(tp.target.rel(f.file))
        data = ctx.tree.read(tp.target.rel(f.file))
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
    ctx: TargetRun,
    journal: Journal,
    report: TargetReport,
    profile: catalog.Profile,
    lock: Lock | None,
) -> None:
    from dataclasses import replace

    ctx.verify()
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
        refuses=needsnothing.refuses_beside(profile, ctx.target.kind),
    )
    ctx.state.write_manifest(manifest)


def rollback_apply(ctx: TargetRun, journal: Journal) -> None:
    """Put every file of an unfinished apply back as it was, and git where it was."""
    check_evidence(ctx, journal.profile, journal.files, kind=journal.target.kind)
    remove_temps(ctx, journal.files)
    ctx.layout.roll_back(journal.files, journal.git)
    if not ctx.layout.keeps_pristine():
        # Git put the files back (the branch switch); check it did, byte for byte.
        check_restored(ctx, ctx.layout.of_this_run(journal.files))
    ctx.verify()  # the state goes by path
    manifest = ctx.state.manifest() if ctx.state.has_manifest() else None
    if manifest is not None and same_run(manifest, journal):
        ctx.state.remove_manifest()
    ctx.state.drop_copies()
    ctx.state.close_journal()
