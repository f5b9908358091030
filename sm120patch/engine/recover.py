"""`recover`: finish what a killed apply or revert left: roll a committed apply forward and an
uncommitted one back, roll a revert forward (journaling the peers the killed run had not
reached), and settle the layout (stale git locks)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sm120patch import targets
from sm120patch.engine import interrupts
from sm120patch.engine.apply import rollback_apply
from sm120patch.engine.records import Journal
from sm120patch.engine.reports import Action, Report, TargetReport
from sm120patch.engine.revert import finish_revert
from sm120patch.engine.run import TargetRun, locked, remove_temps
from sm120patch.engine.store import TargetState
from sm120patch.errors import Refused, Sm120Error
from sm120patch.patchkit.model import TARGETS


def recover(paths: Mapping[str, str | Path | None]) -> Report:
    """Finish what a killed run left: roll an apply back, roll a revert forward."""
    found = [
        targets.find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None)
        for kind in TARGETS
    ]
    ctxs = _with_peers([TargetRun(t) for t in found if t is not None])
    reports = []
    notes = []
    with locked(ctxs), interrupts.critical(  # [signals] recover is finished, never cut short
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
                    remove_temps(ctx, journal.files)
                    ctx.state.close_journal()
                    notes.append(
                        f"{ctx.target.at}: the interrupted apply of {journal.profile} had "
                        "written every target; kept it"
                    )
                elif journal.op == "apply":
                    rollback_apply(ctx, journal)
                    notes.append(
                        f"{ctx.target.at}: rolled back the interrupted apply of "
                        f"{journal.profile}"
                    )
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
    if not reports:
        notes.append("nothing to recover")
    return Report(Action.RECOVERED if reports else Action.NOTHING_TO_DO, None, reports, notes=notes)


def _with_peers(ctxs: list[TargetRun]) -> list[TargetRun]:
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
                out.append(TargetRun(target))
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
