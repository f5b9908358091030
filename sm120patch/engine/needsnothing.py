"""The record that a profile needs nothing on a target (every site upstream or not applicable):
written after an apply's transaction, with the bytes of every file the profile's patches read
there, so that `assess` says "as wanted" from the bytes without a plan; and the releases of the
other targets the profile refuses, kept in each manifest (`refuses_beside`)."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from sm120patch import __version__
from sm120patch.engine.records import CheckedFile, Manifest, TargetRecord
from sm120patch.engine.run import TargetRun
from sm120patch.patchkit.facts import Status
from sm120patch.plan import catalog, plans
from sm120patch.plan.plans import Plan
from sm120patch.targets import Target
from sm120patch.targets.files import sha256

if TYPE_CHECKING:
    from sm120patch.plan.lockfile import Lock

NOTHING_NEEDED = frozenset((Status.UPSTREAM, Status.NOT_APPLICABLE))


def record(
    plan: Plan | None,
    ctxs: Sequence[TargetRun],
    wanted: Collection[TargetRun],
    cat: catalog.Catalog,
    profile: catalog.Profile,
    lock: Lock | None,
) -> tuple[list[str], dict[str, str]]:
    """Record, on each target of the plan that the profile needs nothing from (every site
    upstream or not applicable), that it is as wanted, with the bytes of every file its
    patches read: `assess` then says so from the bytes, without a plan. Returns notes, and
    why each target left without a record of the profile is (kind -> why)."""
    if plan is None:
        return [], {}
    tplans = {tp.target.kind: tp for tp in plan.targets}
    notes: list[str] = []
    unrecorded: dict[str, str] = {}
    name = profile.name
    for ctx in ctxs:
        tp = tplans.get(ctx.target.kind)
        if ctx in wanted or tp is None or tp.changed:
            continue
        if any(o.status not in NOTHING_NEEDED for f in tp.files for o in f.outcomes):
            # already-applied without a record of ours: not ours to vouch for
            unrecorded[ctx.target.kind] = (
                f"its sites already hold profile {name}'s code, which sm120patch did not "
                "write here: there is no record that the profile is applied"
            )
            continue
        checked = checked_files(cat, profile, ctx.target, tp)
        if checked is None:  # the next run plans it again
            unrecorded[ctx.target.kind] = (
                f"a file profile {name} reads changed while it was planned: nothing was recorded"
            )
            continue
        if (moved := ctx.tree.moved()) is not None:
            # The path names another tree now: no record (the next run plans it again).
            unrecorded[ctx.target.kind] = f"{moved}: nothing was recorded"
            continue
        ctx.state.write_manifest(
            Manifest(
                profile=profile.name,
                patches=tuple(sorted(set(profile.patches))),
                tool_version=__version__,
                applied_at=time.time(),
                target=TargetRecord.of(ctx.target),
                files=(),
                lock=lock.digest() if lock is not None else None,
                checked=checked,
                refuses=refuses_beside(profile, ctx.target.kind),
            )
        )
        notes.append(
            f"{ctx.target.at}: profile {profile.name} needs nothing here (every site "
            "upstream or not applicable); recorded as applied"
        )
    return notes, unrecorded


def checked_files(
    cat: catalog.Catalog, profile: catalog.Profile, target: Target, tp: plans.TargetPlan
) -> tuple[CheckedFile, ...] | None:
    """Every file the profile's patches read on `target`, with its sha256 now (None: absent);
    None when a file the plan read has other bytes now than it read."""
    modules = sorted(
        {f for p in cat.patches_of(profile) if p.target == target.kind for f in p.files}
    )
    now = {m: target.handle.sha256(target.rel(m)) for m in modules}
    for f in tp.files:
        if f.file and now.get(f.file) != sha256(f.before.encode("utf-8")):
            return None
    return tuple(CheckedFile(target.rel(m), m, now[m]) for m in modules)


def refuses_beside(profile: catalog.Profile, kind: str) -> dict[str, tuple[str, ...]]:
    """The releases of the other targets that `profile` refuses (moe: FlashInfer <0.6.7), kept
    in the manifest of `kind` so that `status` says so when one is installed after the apply."""
    out: dict[str, tuple[str, ...]] = {}
    for r in profile.refuse:
        if r.kind != kind:
            out[r.kind] = (*out.get(r.kind, ()), str(r.releases))
    return out
