"""`pin`: the lock of a profile on the trees as they are (the applied state where the profile
is applied, else what the plan would write), decided from the bytes like every other verdict."""

from __future__ import annotations

from typing import Any

from sm120patch.errors import Refused
from sm120patch.plan import catalog
from sm120patch.plan.lockfile import Lock, LockedFile, from_plan


def make(profile_name: str, paths: Any, *, force: bool = False) -> Lock:
    """The lock of `profile_name` on the trees at `paths`.

    A reference box is usually patched already: where the profile is applied (checked from the
    bytes), the lock records the applied state from its manifest; on pristine trees (or where
    the patch is gone) it records what the plan would write.
    """
    from sm120patch.engine import assess
    from sm120patch.plan import planner

    cat = catalog.load()
    profile = cat.profile(profile_name)
    found = planner.resolve_targets(profile, paths)
    planner.require_pins(profile, found, paths, force=force, verb="pin")
    states = {s.target.kind: s for s in assess.status(paths) if s.target.kind in profile.targets}
    applied = [s for s in states.values() if s.state == assess.State.APPLIED]
    for s in states.values():
        if s.assessment.state.holds_no_patch:
            continue
        if s.state == assess.State.APPLIED and s.profile == profile.name:
            continue
        raise Refused(
            f"{s.target.at}: {s.assessment.message}",
            "pin on trees where this profile is applied or nothing is",
        )
    if applied and len(applied) != len(found):
        raise Refused(
            f"profile {profile.name} is applied on some of its targets only",
            f"apply it everywhere (`sm120patch apply {profile.name}`), then pin",
        )
    if applied:
        files = [
            LockedFile(s.target.kind, f.module, f.before, f.after)
            for s in applied
            for f in (s.assessment.manifest.files if s.assessment.manifest else ())
        ]
        return Lock(
            profile=profile.name,
            versions={s.target.kind: s.target.version for s in applied},
            patches=list(profile.patches),
            files=files,
        )
    lock = from_plan(planner.checked(profile.name, paths, force=True))
    if not lock.files:
        raise Refused(
            f"profile {profile.name} changes no file here (every site is already SM120-ready)",
            "nothing to pin on these releases",
        )
    return lock
