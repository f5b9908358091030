"""`pin`: the lock of a profile on the trees as they are, decided from the bytes like every
other verdict. Planned from the pristine side where the profile is applied (the pristine
copies of an installed package, the commit a checkout's apply started from), so that the lock
is the same, steps and diffs included, wherever it is pinned."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from sm120patch.errors import Refused
from sm120patch.plan.lockfile import Lock, from_plan
from sm120patch.targets import Target
from sm120patch.targets.resolved import Given, owned

if TYPE_CHECKING:
    from sm120patch.engine.assess import Assessment


def make(profile_name: str, given: Given, *, force: bool = False) -> Lock:
    """The lock of `profile_name` on the command's trees (`given`), each assessed once.

    A reference box is usually patched already: where the profile is applied (checked from
    the bytes), the plan is made from the bytes the apply started from, so the lock holds
    the same [[steps]] and diffs as one pinned before the apply; the bytes the plan writes
    are the applied ones (the apply checked them against its plan)."""
    from sm120patch.engine import pristine
    from sm120patch.plan import catalog, pins

    with owned(given) as named:
        profile = catalog.load(named.config).profile(profile_name)
        found = pins.resolve_targets(profile, named)
        pins.require_pins(profile, found, named, force=force, verb="pin")
        plan, assessed = pristine.pristine_plan(profile, found, named, verb="pin")
        lock = from_plan(plan)
        _check_applied_as_planned(lock, found, assessed)
        if not lock.files:
            raise Refused(
                f"profile {profile.name} changes no file here (every site is already SM120-ready)",
                "nothing to pin on these releases",
            )
        return lock


def _check_applied_as_planned(
    lock: Lock, found: list[Target], assessed: Mapping[str, Assessment]
) -> None:
    """Where the profile is applied (`assessed`: each target's assessment), the lock (planned
    from the pristine side) must describe the bytes on disk: a tree patched by other code (an
    older sm120patch) is not pinned."""
    from sm120patch.engine import assess

    for target in found:
        a = assessed[target.kind]
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
