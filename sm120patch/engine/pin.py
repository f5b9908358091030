"""`pin`: the lock of a profile on the trees as they are, decided from the bytes like every
other verdict. Planned from the pristine side where the profile is applied (the pristine
copies of an installed package, the commit a checkout's apply started from), so that the lock
is the same, steps and diffs included, wherever it is pinned."""

from __future__ import annotations

from typing import Any

from sm120patch.errors import Refused
from sm120patch.plan.lockfile import Lock, from_plan


def make(profile_name: str, paths: Any, *, force: bool = False) -> Lock:
    """The lock of `profile_name` on the trees at `paths`.

    A reference box is usually patched already: where the profile is applied (checked from
    the bytes), the plan is made from the bytes the apply started from, so the lock holds
    the same [[steps]] and diffs as one pinned before the apply; the bytes the plan writes
    are the applied ones (the apply checked them against its plan)."""
    from sm120patch.engine import pristine
    from sm120patch.plan import catalog, planner

    profile = catalog.load().profile(profile_name)
    found = planner.resolve_targets(profile, paths)
    planner.require_pins(profile, found, paths, force=force, verb="pin")
    lock = from_plan(pristine.plan_from_pristine(profile.name, paths, force=True, verb="pin"))
    _check_applied_as_planned(lock, found)
    if not lock.files:
        raise Refused(
            f"profile {profile.name} changes no file here (every site is already SM120-ready)",
            "nothing to pin on these releases",
        )
    return lock


def _check_applied_as_planned(lock: Lock, found: list[Any]) -> None:
    """Where the profile is applied, the lock (planned from the pristine side) must describe
    the bytes on disk: a tree patched by other code (an older sm120patch) is not pinned."""
    from sm120patch.engine import assess

    for target in found:
        a = assess.assess(target)
        if a.state != assess.State.APPLIED or a.manifest is None or a.manifest.needs_nothing:
            continue
        have = {f.module: f.after for f in a.manifest.files}
        want = {f.path: f.after for f in lock.files if f.target == target.kind}
        if have != want:
            raise Refused(
                f"{target.at}: profile {lock.profile} is applied with other bytes than these "
                "patches write now (applied by another sm120patch or pack version?)",
                f"revert it (`sm120patch revert {lock.profile}`), apply it again, then pin",
            )
