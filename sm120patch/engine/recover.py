"""`recover`: finish what a killed apply or revert left: roll a committed apply forward and an
uncommitted one back, roll a revert forward (journaling the peers the killed run had not
reached), and settle the layout (stale git locks).

A target on which another release was installed since the run was killed (`replaced`) gets
nothing written: its files are the new release's, and the old release's bytes are never put
back over them; its journal and record are dropped, and the report says to apply again."""

from __future__ import annotations

from pathlib import Path

from sm120patch.engine import assess, interrupts
from sm120patch.engine.apply import rollback_apply
from sm120patch.engine.records import Journal, Op
from sm120patch.engine.reports import Action, Report, TargetReport
from sm120patch.engine.revert import finish_revert
from sm120patch.engine.run import TargetRun, check_evidence, locked, remove_temps, same_run
from sm120patch.engine.store import TargetState
from sm120patch.errors import Refused
from sm120patch.patchkit.model import TARGETS
from sm120patch.targets.git import head_branch as git_head_branch
from sm120patch.targets.resolved import Given, owned


def recover(given: Given) -> Report:
    """Finish what a killed run left on the command's targets (`given`): roll an apply back,
    roll a revert forward."""
    with owned(given) as named:
        ctxs = [TargetRun(t, named.config) for t in named.each(TARGETS)]
        reports: list[TargetReport] = []
        notes: list[str] = _unnamed_peers(ctxs)
        with locked(ctxs):
            journals: dict[str, Journal | None] = {c.target.kind: c.state.journal() for c in ctxs}
            _check_evidence(ctxs, journals)  # before anything changes: a refusal changes nothing
            for ctx in ctxs:
                ctx.verify()  # the transaction's start: every path still names the tree found
            with interrupts.critical(  # [signals] recover is finished, never cut short
                "recover",
                None,
                abortable=False,
                unfinished=lambda: any(c.journal_open() for c in ctxs),
            ):
                _recover(ctxs, journals, reports, notes)
        if not reports:
            notes.append("nothing to recover")
        action = Action.RECOVERED if reports else Action.NOTHING_TO_DO
        return Report(action, None, reports, notes=notes)


def _check_evidence(ctxs: list[TargetRun], journals: dict[str, Journal | None]) -> None:
    """Every journal names only the files of its profile's patches (where it will write)."""
    for ctx in ctxs:
        journal = journals[ctx.target.kind]
        if journal is None or _replaced(ctx, journal):
            continue  # nothing is written to a replaced target
        if journal.op == Op.APPLY:
            check_evidence(ctx, journal.profile, journal.files, kind=journal.target.kind)
        elif journal.manifest is not None:
            m = journal.manifest
            check_evidence(ctx, m.profile, m.files, m.patches, kind=m.target.kind)


def _recover(
    ctxs: list[TargetRun],
    journals: dict[str, Journal | None],
    reports: list[TargetReport],
    notes: list[str],
) -> None:
    for ctx in ctxs:
        journal = journals[ctx.target.kind]
        if journal is not None:
            notes.extend(ctx.layout.settle_after_kill(journal))
    try:
        _journal_revert_peers(ctxs, journals)
        # Decided before anything changes: dropping one target's record must not make
        # its peer's committed apply look uncommitted.
        committed = {
            kind: j is not None and j.op == Op.APPLY and _apply_committed(j)
            for kind, j in journals.items()
        }
        for ctx in ctxs:
            journal = journals[ctx.target.kind]
            if journal is None:
                continue
            was = _replaced(ctx, journal)
            if was:
                notes.extend(_drop_replaced(ctx, journal, was))
                reports.append(TargetReport(ctx.target, state=assess.State.REPLACED))
                continue
            if committed[ctx.target.kind]:
                remove_temps(ctx, journal.files)
                ctx.state.close_journal()
                notes.append(
                    f"{ctx.target.at}: the interrupted apply of {journal.profile} had "
                    "written every target; kept it"
                )
            elif journal.op == Op.APPLY:
                rollback_apply(ctx, journal)
                notes.append(
                    f"{ctx.target.at}: rolled back the interrupted apply of "
                    f"{journal.profile}"
                )
                notes.extend(ctx.layout.notes)
            else:
                _, more = finish_revert(ctx, journal)
                notes.append(
                    f"{ctx.target.at}: finished the interrupted revert of {journal.profile}"
                )
                notes.extend(more)
            reports.append(TargetReport(ctx.target, state=ctx.assess().state))
    except OSError as exc:
        raise Refused(
            f"recover failed writing {exc.filename or 'a file'}: {exc.strerror}",
            "the journal is kept: fix the cause (permissions, disk space), then run "
            "`sm120patch recover` again",
        ) from exc


def _replaced(ctx: TargetRun, journal: Journal) -> str | None:
    """The release the journal's run worked on, when another one is installed now (None:
    the same release, or the journal does not say)."""
    if journal.op == Op.REVERT and journal.manifest is not None:
        was = journal.manifest.target.version
    else:
        was = journal.target.version
    return was if was is not None and assess.other_release(ctx.target, was) else None


def _drop_replaced(ctx: TargetRun, journal: Journal, was: str) -> list[str]:
    """Another release replaced the files the killed run worked on: write nothing, drop the
    journal and what it described (the patch branch too, when only sm120patch's commits are
    on it and it is not checked out)."""
    t = ctx.target
    manifest_was = journal.manifest if journal.op == Op.REVERT else None
    git = journal.git if manifest_was is None else manifest_was.git
    notes = [
        f"{t.root}: {t.name} was {was} when the interrupted {journal.op} of {journal.profile} "
        f"began, {t.version} is there now: nothing of {was} was written back; dropped its "
        "journal"
        + (
            f" (`sm120patch apply {journal.profile}` patches {t.version})"
            if journal.op == Op.APPLY
            else ""
        )
    ]
    if git is not None and t.layout == "git" and git_head_branch(t.root) != git.patch_branch:
        notes.extend(ctx.layout.drop_branch(git, keep_branch=journal.keep_branch))
    manifest = ctx.state.manifest() if ctx.state.has_manifest() else None
    if manifest is not None and (journal.op == Op.REVERT or same_run(manifest, journal)):
        ctx.state.remove_manifest()
    remove_temps(ctx, journal.manifest.files if journal.manifest else journal.files)
    ctx.state.drop_copies()
    ctx.state.close_journal()
    return notes


def _unnamed_peers(ctxs: list[TargetRun]) -> list[str]:
    """What the journals of `ctxs` say of targets the command did not name: reported, never
    written. Targets come from the command line (or the documented defaults) only; a journal
    is evidence, and one in a user's environment could name root's production FlashInfer as
    its "peer". Such a peer keeps its own journal, which `recover` naming it finishes."""
    import shlex

    named = {(ctx.target.kind, ctx.target.root) for ctx in ctxs}
    kinds = {kind for kind, _ in named}
    notes: list[str] = []
    for ctx in ctxs:
        journal = ctx.state.journal()
        if journal is None:
            continue
        for peer in journal.peers:
            if (peer.kind, Path(peer.root)) in named or peer.kind in kinds:
                continue
            notes.append(
                f"{ctx.target.at}: the interrupted {journal.op} of {journal.profile} names "
                f"{peer.kind} at {peer.root} too, which you did not name: nothing was written "
                f"there (`sm120patch recover --{peer.kind} {shlex.quote(peer.root)}` "
                "finishes it, if it is yours)"
            )
    return notes


def _apply_committed(journal: Journal) -> bool:
    """Whether every target of the journal's apply has its manifest of that apply."""
    if not journal.txn:
        return False
    for peer in journal.peers:
        try:
            manifest = TargetState.of(Path(peer.root), peer.layout, peer.kind).manifest()
        except Refused:
            # Not reachable without following a link (or not readable): no evidence that
            # the apply was committed there.
            return False
        if manifest is None or manifest.txn != journal.txn:
            return False
    return True


def _journal_revert_peers(ctxs: list[TargetRun], journals: dict[str, Journal | None]) -> None:
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
