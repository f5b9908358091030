"""`revert` and its dry run: every touched file back byte for byte, rolled forward by `recover`
after a kill (every target's journal is written before anything changes)."""

from __future__ import annotations

import os
import stat
import time

from sm120patch import __version__
from sm120patch.engine import assess, interrupts, store
from sm120patch.engine.assess import Assessment
from sm120patch.engine.records import FileRecord, Journal, Manifest, Op, Peer
from sm120patch.engine.reports import Action, Report, ReportedFile, TargetReport
from sm120patch.engine.run import (
    TargetRun,
    check_evidence,
    check_writable,
    locked,
    new_txn,
    refuse_unfinished,
    remove_temps,
    start_time,
)
from sm120patch.errors import Refused
from sm120patch.patchkit.model import TARGETS
from sm120patch.plan import catalog
from sm120patch.targets import procscan
from sm120patch.targets.resolved import Given, owned, resolved


def revert(
    profile_name: str | None,
    given: Given,
    *,
    force: bool = False,
    keep_branch: bool = False,
) -> Report:
    """Revert `profile_name` (None: whatever is applied) on the command's targets (`given`)."""
    with owned(given) as named:
        ctxs = _revert_targets(profile_name, named)
        reports: list[TargetReport] = []
        notes: list[str] = []
        if all(c.state.manifest() is None and c.state.journal() is None for c in ctxs):
            # Nothing recorded anywhere: said without the lock, which a tree this run cannot
            # write (a read-only mount, an image's layer) could not even hold. A run starting
            # meanwhile is no more reverted than one starting just after this answer.
            nothing = _revert_preflight(profile_name, ctxs, force)[2]
            if nothing is not None:
                return nothing
        with locked(ctxs):
            todo, stale, nothing = _revert_preflight(profile_name, ctxs, force)
            if nothing is not None:
                return nothing
            for ctx in ctxs:
                ctx.verify()  # the transaction's start: every path still names the tree found
            for ctx, found_state in stale:
                # Never write one release's bytes into another, nor pristine bytes over a branch:
                # the patch is already gone, only its record is left.
                assert found_state.manifest is not None
                notes.append(_dropped_note(ctx, found_state))
                if found_state.state == assess.State.GONE:
                    notes.extend(ctx.layout.drop_branch(found_state.manifest.git, keep_branch))
                ctx.state.remove_manifest()
                ctx.state.drop_copies()
                reports.append(TargetReport(ctx.target, state=_left(found_state)))
            txn = new_txn()
            peers = tuple(ctx.peer() for ctx, _ in todo)
            # [signals] deferred from the first journal write to the last close: a revert is
            # finished, never cut short.
            with interrupts.critical(
                "revert",
                profile_name,
                abortable=False,
                unfinished=lambda: any(c.journal_open() for c, _ in todo),
            ):
                try:
                    journals = _write_journals(todo, txn, peers, keep_branch)
                except OSError as exc:
                    raise Refused(
                        f"revert failed writing its journal {exc.filename or ''}: {exc.strerror}; "
                        "nothing was changed",
                        "free some space (or fix the permissions), then revert again",
                    ) from exc
                # Every journal is written before anything changes: from here on, recover rolls the
                # whole revert forward.
                try:
                    for ctx, journal in journals:
                        report, more = finish_revert(ctx, journal)
                        reports.append(report)
                        notes.extend(more)
                except OSError as exc:
                    raise Refused(
                        f"revert failed writing {exc.filename or 'a file'}: {exc.strerror}",
                        "the journal is kept: fix the cause (disk space, permissions), then run "
                        "`sm120patch recover` to finish the revert",
                    ) from exc
        action = Action.REVERTED if todo else Action.DROPPED
        return Report(action, profile_name, reports, notes=notes)


def _write_journals(
    todo: list[tuple[TargetRun, Manifest]], txn: str, peers: tuple[Peer, ...], keep_branch: bool
) -> list[tuple[TargetRun, Journal]]:
    """Every target's journal, before anything changes; a failure (a full disk) removes the
    ones written, so that nothing is left half-begun."""
    journals: list[tuple[TargetRun, Journal]] = []
    try:
        for ctx, manifest in todo:
            journal = Journal(
                op=Op.REVERT,
                profile=manifest.profile,
                started=time.time(),
                pid=os.getpid(),
                pid_start=start_time(),
                boot_id=procscan.boot_id(),  # [signals] as in _start_apply
                txn=txn,
                peers=peers,
                tool_version=__version__,
                manifest=manifest,
                keep_branch=keep_branch,
            )
            journals.append((ctx, journal))
            ctx.verify()
            ctx.state.write_journal(journal)
            interrupts.kill_point("after-journal")
    except OSError:
        for ctx, _ in journals:
            ctx.state.close_journal()
            ctx.state.remove_temps()
        raise
    return journals


def revert_dry_run(
    profile_name: str | None,
    given: Given,
    *,
    force: bool = False,
) -> Report:
    """The revert minus the writes: the same preflight refuses the same way; the report says
    what the revert would do, and `restores` is the diff of what it would write back."""
    from sm120patch.plan.diffs import diff_texts

    with owned(given) as named:
        ctxs = _revert_targets(profile_name, named)
        for ctx in ctxs:
            ctx.state.check_lockable()
        todo, stale, nothing = _revert_preflight(profile_name, ctxs, force)
        if nothing is not None:
            nothing.dry_run = True
            return nothing
        reports: list[TargetReport] = []
        notes = [_dropped_note(ctx, found, dry_run=True) for ctx, found in stale]
        reports += [TargetReport(ctx.target, state=_left(found)) for ctx, found in stale]
        diffs = []
        for ctx, manifest in todo:
            report = TargetReport(ctx.target, state=assess.State.PRISTINE)
            restored = ctx.layout.restores(manifest.files, manifest.git)
            for f in manifest.files:
                data = ctx.tree.read(f.path) if ctx.tree.is_regular(f.path) else b""
                after = restored[f.path]
                report.files.append(ReportedFile(f.path, "pristine"))
                if after is not None and after != data:
                    diffs.append(
                        diff_texts(
                            f.path,
                            data.decode("utf-8", "replace"),
                            after.decode("utf-8", "replace"),
                        )
                    )
            reports.append(report)
        action = Action.REVERTED if todo else Action.DROPPED
        return Report(
            action, profile_name, reports, notes=notes, dry_run=True, restores="".join(diffs)
        )


def _revert_targets(profile_name: str | None, given: Given) -> list[TargetRun]:
    named = resolved(given)
    kinds = (
        TARGETS
        if profile_name is None
        else catalog.load(named.config).profile(profile_name).targets
    )
    return [TargetRun(t, named.config) for t in named.each(tuple(kinds))]


def _revert_preflight(
    profile_name: str | None, ctxs: list[TargetRun], force: bool
) -> tuple[list[tuple[TargetRun, Manifest]], list[tuple[TargetRun, Assessment]], Report | None]:
    """What a revert restores (`todo`), what records it only drops (`stale`), or the report
    that there is nothing to revert; refuses as the revert would, before anything is written."""
    refuse_unfinished(ctxs)
    todo: list[tuple[TargetRun, Manifest]] = []
    stale: list[tuple[TargetRun, Assessment]] = []
    for ctx in ctxs:
        found_state = ctx.assess()
        manifest = found_state.manifest
        if manifest is None:
            continue
        if manifest.needs_nothing and profile_name not in (None, manifest.profile):
            continue  # another profile's record that it needs nothing here: nothing of ours
        if profile_name is not None and manifest.profile != profile_name:
            raise Refused(
                f"profile {manifest.profile} is applied on {ctx.target.root}, not {profile_name}",
                f"run `sm120patch revert {manifest.profile}` or `sm120patch revert --all`",
            )
        if found_state.state.stale or manifest.needs_nothing:
            # Nothing was written (the record that the profile needs nothing here), or what
            # was is gone: the revert drops the record and writes nothing.
            stale.append((ctx, found_state))
        else:
            todo.append((ctx, manifest))
    if not todo and not stale:
        what = f"profile {profile_name}" if profile_name else "anything"
        where = ", ".join(f"{c.target.name} at {c.target.root}" for c in ctxs)
        return (
            todo,
            stale,
            Report(
                Action.NOTHING_TO_DO,
                profile_name,
                [TargetReport(c.target, state=assess.State.PRISTINE) for c in ctxs],
                notes=[f"sm120patch has not applied {what} on {where or 'any target found'}"],
            ),
        )
    for ctx, manifest in todo:
        _preflight(ctx, manifest, force)
        for f in manifest.files:
            check_writable(ctx, f.path, regular=False)
    return todo, stale, None


def _left(found: Assessment) -> assess.State:
    """The state a dropped record leaves: a target that needed nothing is pristine after."""
    return assess.State.PRISTINE if found.state == assess.State.APPLIED else found.state


def _dropped_note(ctx: TargetRun, found: Assessment, *, dry_run: bool = False) -> str:
    done = "the revert would drop the record" if dry_run else "dropped the record"
    m = found.manifest
    if m is not None and m.needs_nothing and found.state == assess.State.APPLIED:
        return (
            f"{ctx.target.at}: profile {m.profile} needed nothing here; nothing to restore, {done}"
        )
    return f"{ctx.target.at}: {found.message}; nothing to restore, {done}"


def _preflight(ctx: TargetRun, manifest: Manifest, force: bool) -> None:
    """Refuse before any journal is written: the manifest checked as evidence, every file it
    names a regular file, edits since the apply (unless `force`), and whether the layout can
    restore every file (`check_can_restore`), so a revert never stops halfway."""
    check_evidence(
        ctx, manifest.profile, manifest.files, manifest.patches, kind=manifest.target.kind
    )
    for f in manifest.files:
        st = ctx.tree.lstat(f.path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise Refused(
                f"{ctx.target.at}: the state of the apply names {f.path}, which is not a "
                "regular file",
                f"inspect {ctx.state.dir / store.MANIFEST}; if it is damaged, move it aside",
            )

    def unchanged(f: FileRecord) -> bool:
        now = ctx.tree.sha256(f.path)
        return assess.file_verdict(f, now, ctx.layout.released(f)) in ("patched", "pristine")

    changed = [f for f in manifest.files if not unchanged(f)]
    problems = []
    missing = [f.path for f in changed if not ctx.tree.exists(f.path)]
    if missing:
        problems.append("deleted since the apply: " + ", ".join(missing))
    drifted = [f for f in changed if ctx.tree.exists(f.path)]
    if drifted:
        problems.append(_drift_diff(ctx, drifted))
    git = manifest.git
    problems.extend(ctx.layout.changes_since_apply(git))
    ctx.layout.check_can_restore(manifest.files, git)
    if problems and not force:
        raise Refused(
            f"{ctx.target.at}: changed since the apply; refusing to throw that away:\n"
            + "\n".join(problems),
            f"keep your edits elsewhere, or `sm120patch revert {manifest.profile} --force` to "
            "discard them",
        )


def _drift_diff(ctx: TargetRun, drifted: list[FileRecord]) -> str:
    import difflib

    out: list[str] = []
    for f in drifted:
        ours = (ctx.state.copy("patched", f.path) or b"").decode("utf-8", "replace")
        now = ctx.tree.read(f.path).decode("utf-8", "replace")
        out.extend(
            difflib.unified_diff(
                ours.splitlines(True),
                now.splitlines(True),
                f"sm120patch/{f.path}",
                f"yours/{f.path}",
            )
        )
    return "".join(out).rstrip("\n")


def finish_revert(ctx: TargetRun, journal: Journal) -> tuple[TargetReport, list[str]]:
    """Idempotent: run again from the journal, it converges."""
    manifest = journal.manifest
    assert manifest is not None
    check_evidence(
        ctx, manifest.profile, manifest.files, manifest.patches, kind=manifest.target.kind
    )
    report = TargetReport(ctx.target, state=assess.State.PRISTINE)
    remove_temps(ctx, manifest.files)
    ctx.layout.finish_revert(manifest.files, manifest.git, journal.keep_branch)
    notes = [*ctx.layout.notes, *ctx.layout.drop_branch(manifest.git, journal.keep_branch)]
    if manifest.git is not None and journal.keep_branch:
        report.branch = manifest.git.patch_branch
    for f in manifest.files:
        report.files.append(ReportedFile(f.path, "pristine"))
    interrupts.kill_point("before-manifest")
    ctx.verify()  # the state goes by path
    ctx.state.remove_manifest()
    interrupts.kill_point("after-manifest")
    ctx.state.drop_copies()
    ctx.state.close_journal()
    interrupts.kill_point("after-close")
    return report, notes
