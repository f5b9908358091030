"""Which targets a profile runs on, and whether their releases are inside its pins or among
the releases it refuses: what `apply`, `pin` and `ensure` check before anything else, and what
`doctor` reports. No patch runs here, and a profile here is what its profiles.toml declares
(`plan.profiles`), so `ensure` on an applied tree checks its pins without the planner's
modules or the patch modules."""

from __future__ import annotations

from sm120patch import targets
from sm120patch.errors import AGAIN, Refused, Sm120Error
from sm120patch.plan import profiles
from sm120patch.plan.profiles import Profile
from sm120patch.targets import Target
from sm120patch.targets.resolved import Given, owned, resolved


def resolve_targets(profile: Profile, given: Given) -> list[Target]:
    """The profile's targets, as the command found them (`Resolved`)."""
    found = resolved(given)
    return [found.find(kind) for kind in profile.targets]


def check_pins(
    profile: Profile,
    found: list[Target],
    paths: Given | None = None,
) -> list[str]:
    """One line per target whose version is outside the profile's pins, then one per release
    the profile refuses (`refusal_lines`): what --force overrides."""
    return _outside_pins(profile, found) + refusal_lines(profile, found, paths)


def _outside_pins(profile: Profile, found: list[Target]) -> list[str]:
    problems = []
    for target in found:  # one target per kind in a plan; a list keeps each target's line
        problems += profiles.pin_problems(
            profile,
            {target.kind: target.version},
            {target.kind: (target.name, target.version_source)},
        )
    return problems


def require_pins(
    profile: Profile,
    found: list[Target],
    paths: Given | None,
    *,
    force: bool,
    verb: str,
) -> list[str]:
    """Refuse (unless `force`) a target outside the profile's pins or a release it refuses,
    with a hint that fits: a pinned release for the first, what the reason asks for the second.
    Returns what `force` overrode (`check_pins`'s lines), empty when nothing was."""
    outside = _outside_pins(profile, found)
    refused = refusal_lines(profile, found, paths)
    if force or not (outside or refused):
        return outside + refused
    # `sm120patch <again> --force`: the user's own command with --force, as it pastes
    again = f"`sm120patch {AGAIN} --force`"
    unknown = [t.kind for t in found if t.version == targets.UNKNOWN]
    hint = (
        f"state the version (--{unknown[0]}-version VERSION), or {verb} anyway: {again}"
        if unknown
        else f"use a pinned release, or {verb} anyway: {again}"
        if outside
        else f"use a release it does not refuse (its reason says which), or {verb} anyway: {again}"
    )
    raise Refused("; ".join(outside + refused), hint)


def refusal_lines(
    profile: Profile,
    found: list[Target],
    paths: Given | None = None,
) -> list[str]:
    """One line per release of the targets found (or, for a kind the profile does not patch,
    moe refusing a FlashInfer, of the one `beside` finds) that the profile refuses, with why.
    Where that other kind is not found, nothing is refused."""
    have: dict[str, Target] = {t.kind: t for t in found}
    with owned(paths or {}) as given:  # what `beside` finds only for its version
        problems = []
        for kind in dict.fromkeys(r.kind for r in profile.refuse):
            target = have.get(kind) or beside(kind, found, given)
            if target is not None:
                problems += profiles.refusal_problems(
                    profile, {kind: target.version}, {kind: (target.name, target.version_source)}
                )
        return problems


def beside(kind: str, found: list[Target], given: Given) -> Target | None:
    """The `kind` target at its path when given (an error if it is not there); else the one
    in the directory holding a found installed target (SGLang's site-packages holds the
    FlashInfer it runs with); else the one installed in this interpreter; else None. Found
    through the command's `Resolved`, once."""
    named = resolved(given)
    if named.given(kind):
        return named.find(kind)
    try:
        for t in found:
            if t.layout != "git" and (t.parent / kind).is_dir():
                return named.at(kind, t.parent)
        return named.quiet(kind, required=False)
    except Sm120Error:  # a tree whose version cannot be read: nothing to refuse by
        return None
