"""`ensure`: at service start, the trees exactly as wanted (applying if needed), or a refusal."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sm120patch.engine import assess
from sm120patch.engine.reports import Action, Report, TargetReport
from sm120patch.engine.run import check_applied_matches_lock, runs_for, unchecked_refusals
from sm120patch.engine.store import Waiting
from sm120patch.errors import Refused
from sm120patch.plan import profiles
from sm120patch.targets.resolved import Given, owned

if TYPE_CHECKING:
    from sm120patch.plan.lockfile import Lock, PlanCheck


def ensure(
    profile_name: str,
    given: Given,
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    check_plan: PlanCheck | None = None,
    lock: Lock | None = None,
    apply_if_needed: bool = True,
    wait: Waiting | None = None,
) -> Report:
    """For service start-up: the target ends exactly as wanted, or nothing changes (Refused).

    `apply_if_needed=False` only verifies (a Kubernetes init container, which cannot patch the
    server container's files): anything but "applied as wanted" is refused.

    Pristine or gone: applied first. Applied as wanted: nothing to do. Drifted, missing,
    unfinished, another profile, another release outside the pins or than the lock's:
    refused with nothing changed (apply's own preflight). Each target is assessed once: the
    apply takes this assessment under its lock while the state is unchanged, and reports the
    targets it leaves without the profile's record (every other one it wrote and verified).

    `wait`: where another run holds a target's lock (a second service sharing the venv,
    started at the same time), wait for it, bounded, then decide from the bytes as a second
    apply would: applied as wanted by the other run is nothing to do.
    """
    # The profile as its profiles.toml declares it: no patch module is imported while the
    # bytes may still answer "as wanted" (a damaged pack is met when a plan is needed).
    # Where the light reader cannot decide, the catalog decides, with its own errors.
    with owned(given) as named:
        profile: profiles.Profile | None = profiles.spec(profile_name, named.config)
        if profile is None:
            from sm120patch.plan import catalog

            profile = catalog.load(named.config).profile(profile_name)
        ctxs = runs_for(profile, named, force, lock)
        # At every service start: when the bytes already say "as wanted", answer without the lock
        # (reading is safe; a run in progress would show as unfinished).
        found = [ctx.assess() for ctx in ctxs]
        if all(a.state == assess.State.APPLIED and a.profile == profile.name for a in found):
            try:
                if lock is not None:
                    for ctx, a in zip(ctxs, found, strict=True):
                        check_applied_matches_lock(ctx, a, lock)
                return Report(
                    Action.NOTHING_TO_DO,
                    profile.name,
                    [TargetReport(c.target, state=assess.State.APPLIED) for c in ctxs],
                    notes=[
                        f"profile {profile.name} is already applied: every touched file has the "
                        "bytes sm120patch wrote"
                        + (", the bytes the lock records" if lock is not None else ""),
                        *unchecked_refusals(profile, [c.target for c in ctxs], named),
                    ],
                )
            except Refused:
                if not apply_if_needed:
                    raise
                # not as the lock says: apply's preflight refuses with the full story
        if not apply_if_needed:
            wrong = next(
                a
                for a in found
                if not (a.state == assess.State.APPLIED and a.profile == profile.name)
            )
            raise Refused(
                f"{wrong.target.at}: {wrong.state}: {wrong.message}",
                verify_hint(wrong, profile.name, lock),
            )
        # Only a tree not yet as wanted plans: the planner's modules load here, not at every
        # service start.
        from sm120patch.engine.apply import apply_runs
        from sm120patch.plan import catalog

        report = apply_runs(
            catalog.load(named.config).profile(profile.name),
            ctxs,
            named,
            preconditions=preconditions,
            check_plan=check_plan,
            lock=lock,
            seen={c.target.kind: a for c, a in zip(ctxs, found, strict=True)},
            wait=wait,
        )
        for ctx in ctxs:
            why = report.unrecorded.get(ctx.target.kind)
            if why is not None:
                raise Refused(f"{ctx.target.at}: {why}", "see `sm120patch status`")
        return report


def verify_hint(found: assess.Assessment, profile: str, lock: Lock | None) -> str:
    """What to do about a target `ensure --no-apply` found not as wanted, by its state."""
    wanted = f"apply --locked {lock.path}" if lock is not None and lock.path else f"apply {profile}"
    again = f"`sm120patch {wanted}`"
    where = f"apply it where the files can be written ({again}; in an image, at its build)"
    other = found.profile
    if found.state == assess.State.UNFINISHED:
        return "an interrupted run left its journal: `sm120patch recover` finishes it"
    stale = found.state.stale
    if other is not None and other != profile and not stale:
        return f"profile {other} is applied instead: `sm120patch revert {other}`, then {again}"
    if found.state == assess.State.APPLIED:  # the profile, but not as the lock says
        return f"`sm120patch revert {other}`, then {again}"
    if found.state == assess.State.DRIFTED:
        return (
            f"`sm120patch status` shows what changed; `sm120patch revert {other} --force` "
            f"discards it, then {again}"
        )
    if found.state == assess.State.MISSING:
        return (
            f"`sm120patch revert {other} --force` restores the deleted file(s) as they were, "
            f"then {again}"
        )
    if found.state == assess.State.REPLACED:
        return (
            "another release is installed than the one patched: "
            + where
            + (" with a lock made on this release" if lock is not None else "")
        )
    return where  # pristine, or the patches gone
