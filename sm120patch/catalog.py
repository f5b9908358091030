"""Load the patch library (patches/*.py) and the profiles (patches/profiles.toml)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120patch.errors import UsageError
from sm120patch.facts import Fact
from sm120patch.transform import Patch, Status

# The one place that picks the TOML reader (lockfile.py and trial.py use it too).
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILES_SCHEMA = 1
TARGETS = ("sglang", "flashinfer")


def release_of(version: str) -> Version:
    """The release a version counts as for pins: 0.5.9.dev12+gabc and 0.5.9.post1 count as 0.5.9."""
    return Version(Version(version).base_version)


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    status: str  # "recommended" or "experimental"
    patches: tuple[str, ...]
    pins: dict[str, SpecifierSet]
    # patch id -> versions where its site does not exist and that is fine for this profile,
    # beyond what the patch's own facts say (its `not-applicable` facts count everywhere)
    absent: dict[str, SpecifierSet] = field(default_factory=dict)
    known: str = ""
    # patch id -> the patch's facts, filled in by the catalog (not compared: derived data)
    facts: dict[str, tuple[Fact, ...]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in TARGETS if t in self.pins)

    def pinned(self, target: str, version: str) -> bool:
        try:
            return self.pins[target].contains(release_of(version), prereleases=True)
        except InvalidVersion:
            return False

    def absent_ok(self, patch_id: str, version: str) -> bool:
        """Whether a missing site of `patch_id` is fine in `version`: a `not-applicable` fact
        of the patch covers it, or the profile's own `absent` table does."""
        if any(
            f.status is Status.NOT_APPLICABLE and f.covers(version)
            for f in self.facts.get(patch_id, ())
        ):
            return True
        spec = self.absent.get(patch_id)
        if spec is None:
            return False
        try:
            return spec.contains(release_of(version), prereleases=True)
        except InvalidVersion:
            return False


@dataclass(frozen=True)
class Catalog:
    patches: dict[str, Patch]
    profiles: dict[str, Profile]

    def profile(self, name: str) -> Profile:
        try:
            return self.profiles[name]
        except KeyError:
            known = ", ".join(sorted(self.profiles))
            raise UsageError(f"unknown profile '{name}'; known profiles: {known}") from None

    def patches_of(self, profile: Profile) -> list[Patch]:
        return [self.patches[pid] for pid in profile.patches]


@lru_cache(maxsize=1)
def load() -> Catalog:
    from sm120patch import patches as package

    found: dict[str, Patch] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        patch = getattr(module, "PATCH", None)
        if isinstance(patch, Patch):
            if patch.id in found:
                raise RuntimeError(f"two patches declare the id {patch.id}")
            found[patch.id] = patch
    text = resources.files(package).joinpath("profiles.toml").read_text(encoding="utf-8")
    return Catalog(found, parse_profiles(text, found))


def parse_profiles(text: str, patches: dict[str, Patch]) -> dict[str, Profile]:
    data = tomllib.loads(text)
    if data.get("schema") != PROFILES_SCHEMA:
        raise RuntimeError(
            f"profiles.toml: schema {data.get('schema')!r}, expected {PROFILES_SCHEMA}"
        )
    profiles: dict[str, Profile] = {}
    for name, raw in data.get("profiles", {}).items():
        ids = tuple(raw["patches"])
        for pid in ids:
            if pid not in patches:
                raise RuntimeError(f"profiles.toml: profile {name} names unknown patch {pid}")
        try:
            pins = {t: SpecifierSet(raw["pins"][t]) for t in TARGETS if t in raw.get("pins", {})}
            absent = {pid: SpecifierSet(spec) for pid, spec in raw.get("absent", {}).items()}
        except InvalidSpecifier as exc:
            raise RuntimeError(f"profiles.toml: profile {name}: {exc}") from None
        needed = {patches[pid].target for pid in ids}
        if needed - set(pins):
            raise RuntimeError(
                f"profiles.toml: profile {name} lacks pins for {sorted(needed - set(pins))}"
            )
        profiles[name] = Profile(
            name=name,
            title=raw.get("title", name),
            status=raw.get("status", "experimental"),
            patches=ids,
            pins=pins,
            absent=absent,
            known=raw.get("known", "").strip(),
            facts={pid: patches[pid].facts for pid in ids},
        )
    return profiles
