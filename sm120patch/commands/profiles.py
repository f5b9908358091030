"""What the commands about profiles do: `list`, `show`, `new-patch`, and the profile names
shell completion offers. Nothing here prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch.app import Session
from sm120patch.errors import UsageError

if TYPE_CHECKING:
    from sm120patch.patchkit.newpatch import Written
    from sm120patch.plan.catalog import Catalog, Profile


def list_profiles(session: Session) -> Catalog:
    return session.catalog


def held_here(cat: Catalog) -> dict[str, list[str]]:
    """Per recommended profile, why not to recommend it with the SGLang and FlashInfer
    installed here: a release it refuses, or a wrong-output known entry about it that matches
    (no reading of the GPUs: `list` stays quick, and an unknown GPU does not exclude an entry)."""
    recommended = [p for p in cat.profiles.values() if p.status == "recommended"]
    if not recommended:
        return {}
    from sm120patch.plan import known, pins

    found = known.installed_targets()
    for t in found:
        t.handle.close()  # only their versions are read below
    box = known.Box(versions={t.kind: t.version for t in found})
    shipped = known.entries(cat=cat)
    held = {}
    for p in recommended:
        why = pins.refusal_lines(p, found)
        why += [e.line() for e in known.condemning(p.name, box, shipped, cat)]
        if why:
            held[p.name] = why
    return held


def profile_names(packs: tuple[str, ...]) -> list[str]:
    """The profiles' names, the packs' included (shell completion); none where a pack is
    broken: completion is no place for a traceback."""
    try:
        return list(Session(packs=packs).catalog.profiles)
    except Exception:
        return []


def show(session: Session, name: str) -> Profile:
    return session.profile(name)


def known_about(profile: str, cat: Catalog) -> list[Any]:
    """Every known outcome about `profile` (plan.known.Entry), whatever this box is."""
    from sm120patch.plan import known

    return known.about_profile(profile, cat=cat)


@dataclass(frozen=True)
class NewPatchRequest:
    patch_id: str
    target: str
    rel: str
    function: str
    pins: str
    keyword: str | None
    expect: str | None
    add: int | None
    profile: str | None
    directory: str
    force: bool


def new_patch(request: NewPatchRequest) -> Written:
    from sm120patch.patchkit import newpatch

    try:
        majors = tuple(int(x) for x in request.expect.split(",")) if request.expect else ()
    except ValueError:
        raise UsageError(
            f"--expect '{request.expect}' is not a list of integers", "e.g. --expect 9,10"
        ) from None
    spec = newpatch.NewPatch(
        request.patch_id,
        request.target,
        request.rel,
        request.function,
        request.pins,
        request.profile or "",
        request.keyword,
        majors,
        request.add,
    )
    from sm120patch.targets.files import write_output

    return newpatch.write(spec, Path(request.directory), write_output, force=request.force)
