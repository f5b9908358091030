"""The pristine side of an applied tree: what each touched file held before the apply (the
pristine copy of an installed package, or on a checkout the blob of the commit the apply
started from), for `explain` and for `export`, which plan from it on a reference box that is
patched already."""

from __future__ import annotations

from sm120patch.engine import assess
from sm120patch.engine.store import TargetState
from sm120patch.errors import Refused
from sm120patch.plan import catalog, pins, planner
from sm120patch.plan.plans import Plan, PlanRefused
from sm120patch.targets import Target
from sm120patch.targets.resolved import Given, owned


def pristine_bytes(target: Target, rel: str) -> bytes | None:
    """The pristine bytes of `rel` (relative to the target root) of an applied target: the
    engine's pristine copy, or on a checkout the blob of the commit the apply started from."""
    st = TargetState.of(target.root, target.layout, target.kind, target.handle)
    manifest = st.manifest()
    if target.layout == "git" and manifest is not None and manifest.git is not None:
        from sm120patch.targets import git

        return git.Repo(target.root).show(manifest.git.head, rel)
    return st.copy("pristine", rel)


def plan_from_pristine(
    profile_name: str,
    given: Given,
    *,
    force: bool = False,
    verb: str = "export",
) -> Plan:
    """The plan `export` and `pin` write: on trees where the profile is applied (checked from
    the bytes), planned from their pristine side, so the series is the same as before the
    apply; elsewhere from the files on disk. Refuses a tree that is neither (another profile
    applied, an edit since the apply, a journal left open), and pristine bytes that are not
    the ones the apply read (its before-hash)."""
    with owned(given) as named:
        profile = catalog.load(named.config).profile(profile_name)
        found = pins.resolve_targets(profile, named)
        pins.require_pins(profile, found, named, force=force, verb=verb)
        return pristine_plan(profile, found, named, verb=verb)[0]


def pristine_plan(
    profile: catalog.Profile, found: list[Target], given: Given, *, verb: str
) -> tuple[Plan, dict[str, assess.Assessment]]:
    """`plan_from_pristine` on targets found and admitted (their pins checked by the caller,
    `pins.require_pins`), and each target's assessment (made once)."""
    from sm120patch.targets.files import sha256

    texts: dict[str, dict[str, str]] = {}
    assessed: dict[str, assess.Assessment] = {}
    for target in found:
        state = assessed[target.kind] = assess.assess(target)
        if state.state.holds_no_patch:
            continue
        if state.state != assess.State.APPLIED or state.profile != profile.name:
            raise Refused(
                f"{target.name} at {target.root} is {state.state}: {state.message}",
                f"{verb} on trees where this profile is applied as sm120patch left it, or "
                "nothing is (see `sm120patch status`)",
            )
        assert state.manifest is not None
        texts[target.kind] = {}
        for f in state.manifest.files:
            data = pristine_bytes(target, f.path)
            if data is None or sha256(data) != f.before:
                raise Refused(
                    f"{target.at}: the pristine side of {f.path} is "
                    + ("missing" if data is None else "not the bytes the apply read")
                    + ", so the profile cannot be planned as before the apply",
                    "see `sm120patch status`; revert the profile, then "
                    f"`sm120patch {verb} {profile.name}` on the pristine tree",
                )
            texts[target.kind][f.module] = data.decode("utf-8")
    plan = planner.plan_admitted(profile.name, found, given, texts=texts)
    if plan.refused:
        raise PlanRefused(plan)
    return plan, assessed
