"""The profile model (`Profile`), read from the profiles.toml of the built-in library and of
each pack (`read_profile`, which the catalog uses too) without importing a patch module or the
kit's model.

What `ensure` checks before it knows a tree is as wanted is all here: on an applied tree the
bytes answer the rest (the hashes its record holds), so a service start pays neither for the
patch modules nor for the checks the catalog makes of them. Where this reader cannot decide
(profiles.toml that does not parse or validate, a profile defined twice, a pack it cannot find
without importing it, one anyone else could write, a profile it does not know) it says nothing
(`spec` returns None) and the full catalog (`catalog.load`) decides, with its own errors.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.specifiers import SpecifierSet

from sm120patch.config import Config
from sm120patch.errors import UsageError
from sm120patch.patchkit.facts import Status
from sm120patch.patchkit.kinds import TARGETS
from sm120patch.patchkit.versions import base_release, contains, range_text

if TYPE_CHECKING:
    from sm120patch.patchkit.facts import Fact

# The one place that picks the TOML reader (catalog.py, lockfile.py and trial.py use it too).
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOMLDecodeError = tomllib.TOMLDecodeError

PROFILES_SCHEMA = 1
DAMAGED_HINT = "reinstall sm120patch: a file it ships with is damaged"
ENTRY_POINT_GROUP = "sm120patch.patches"
BUILT_IN = "built-in"  # the library shipped with sm120patch, as a pack's name


def parse_toml(
    text: str, where: str | Path | None = None, hint: str = DAMAGED_HINT
) -> dict[str, Any]:
    """TOML text as a document (the one place that picks the reader). With `where` (a file
    of the library or of a pack: profiles, known outcomes, signatures), text that does not
    parse is one line naming the file (a usage error, exit 2), never a traceback; without
    it the caller handles TOMLDecodeError."""
    if where is None:
        return dict(tomllib.loads(text))
    try:
        return dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where} is not valid TOML ({exc})", hint) from None


@dataclass(frozen=True)
class Refusal:
    """A release range inside (or beside) a profile's pins where applying it is refused with
    a reason unless --force: a known wrong output, or an upstream path this profile would
    shadow. `kind` need not be a target the profile patches (moe refuses a FlashInfer)."""

    kind: str
    releases: SpecifierSet
    reason: str

    def refuses(self, version: str) -> bool:
        return contains(self.releases, base_release(version))


@dataclass(frozen=True)
class Profile:
    """A profile: what its profiles.toml declares (`read_profile`), and its patches' facts,
    which the catalog fills in (`catalog.load`); the light reader (`spec`) leaves them empty,
    reading no patch module."""

    name: str
    title: str
    status: str  # "recommended", "experimental", or "refused" (a reason why a gate stays)
    patches: tuple[str, ...]
    pins: dict[str, SpecifierSet]
    # patch id -> versions where its site does not exist and that is fine for this profile,
    # beyond what the patch's own facts say (its `not-applicable` facts count everywhere)
    absent: dict[str, SpecifierSet] = field(default_factory=dict)
    known: str = ""
    refuse: tuple[Refusal, ...] = ()
    # The kernels (or backends) this profile makes the engine take, in upstream's own names:
    # what a known outcome's `kernel` is held to (`plan.known.ceiling`).
    kernel: tuple[str, ...] = ()
    # Upstream's own flag or environment variable with the same effect on one launch, the
    # release it was read in ("sglang 0.5.23"), and why the patch still helps beside it.
    flag: str = ""
    flag_release: str = ""
    flag_why: str = ""
    # patch id -> the patch's facts, filled in by the catalog (not compared: derived data)
    facts: Mapping[str, tuple[Fact, ...]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in TARGETS if t in self.pins)

    def refusals(self, kind: str, version: str) -> list[Refusal]:
        """The refusals of this profile that take `kind` `version`."""
        return [r for r in self.refuse if r.kind == kind and r.refuses(version)]

    def pinned(self, target: str, version: str) -> bool:
        return contains(self.pins[target], base_release(version))

    def absent_ok(self, patch_id: str, version: str) -> bool:
        """Whether a missing site of `patch_id` is fine in `version`: a `not-applicable` fact
        of the patch covers it, or the profile's own `absent` table does."""
        if any(
            f.status is Status.NOT_APPLICABLE and f.covers(version)
            for f in self.facts.get(patch_id, ())
        ):
            return True
        spec = self.absent.get(patch_id)
        return spec is not None and contains(spec, base_release(version))

    def flag_sentence(self, release: bool = True) -> str:
        """Upstream's own flag or variable beside the patch and why the patch still helps (a
        user may prefer the flag for one launch): what `show` and `doctor` print."""
        read = f" (read in {self.flag_release})" if release and self.flag_release else ""
        return f"upstream's flag for one launch: {self.flag}{read}. Why the patch beside it: " \
            + self.flag_why

    def ran_doc(self) -> dict[str, Any]:
        """`show --json`'s engine, kernels and upstream's flag (None where there is none)."""
        flag = {"flag": self.flag, "release": self.flag_release, "why": self.flag_why}
        return {
            "engine": self.engine,
            "kernel": list(self.kernel),
            "flag": flag if self.flag else None,
        }

    @property
    def engine(self) -> str:
        """The engine whose server this profile changes: vLLM where it patches vLLM, else
        SGLang (a FlashInfer patch serves the SGLang beside it)."""
        return "vllm" if any(p.startswith("vllm.") for p in self.patches) else "sglang"


def pins_of(name: str, raw: dict[str, Any]) -> tuple[dict[str, SpecifierSet], tuple[Refusal, ...]]:
    """A profile table's pins and refusals (InvalidSpecifier or RuntimeError where they do
    not parse)."""
    pins: dict[str, SpecifierSet] = {
        t: SpecifierSet(raw["pins"][t]) for t in TARGETS if t in raw.get("pins", {})
    }
    return pins, tuple(refusal(name, r) for r in raw.get("refuse", []))


def refusal(profile: str, raw: Any) -> Refusal:
    """One `[[profiles.NAME.refuse]]` table: exactly one target kind = specifier, and a reason."""
    kinds = [k for k in TARGETS if k in raw] if isinstance(raw, dict) else []
    reason = raw.get("reason", "") if isinstance(raw, dict) else ""
    unknown = set(raw) - {*TARGETS, "reason"} if isinstance(raw, dict) else set()
    if len(kinds) != 1 or not isinstance(reason, str) or not reason.strip() or unknown:
        raise RuntimeError(
            f"profiles.toml: profile {profile}: each refuse table names one of "
            f"{', '.join(TARGETS)} (a specifier) and a reason"
        )
    return Refusal(kinds[0], SpecifierSet(raw[kinds[0]]), " ".join(reason.split()))


def read_profile(name: str, raw: dict[str, Any]) -> Profile:
    """A `[profiles.NAME]` table as it declares the profile, its facts not filled in
    (KeyError, InvalidSpecifier or RuntimeError where it does not read; the catalog checks
    its patches and pins against the patches it loads)."""
    pins, refuse = pins_of(name, raw)
    return Profile(
        name=name,
        title=raw.get("title", name),
        status=raw.get("status", "experimental"),
        patches=tuple(raw["patches"]),
        pins=pins,
        absent={pid: SpecifierSet(spec) for pid, spec in raw.get("absent", {}).items()},
        known=raw.get("known", "").strip(),
        refuse=refuse,
        kernel=tuple(raw.get("kernel", ())),
        flag=raw.get("flag", ""),
        flag_release=raw.get("flag_release", ""),
        flag_why=" ".join(raw.get("flag_why", "").split()),
    )


def pin_problems(
    profile: Profile,
    versions: Mapping[str, str],
    labels: Mapping[str, tuple[str, str]] | None = None,
) -> list[str]:
    """One line per kind whose version is outside the profile's pins (or is no version).

    `labels` may give each kind (name in the message, where its version was read); by default
    (the kind, nothing).
    """
    problems = []
    for kind, version in versions.items():
        if kind not in profile.pins:
            continue
        spec = profile.pins[kind]
        label, source = (labels or {}).get(kind, (kind, ""))
        if version == "unknown":  # targets.UNKNOWN: the source says why and how to state it
            problems.append(
                f"{label} version unknown ({source}): profile {profile.name} is pinned to "
                + range_text(spec)
            )
            continue
        if base_release(version) is None:
            problems.append(
                f"{label} version '{version}'"
                + (f" (from {source})" if source else "")
                + f" is not a PEP 440 version; profile {profile.name} is pinned to "
                + range_text(spec)
            )
            continue
        if not profile.pinned(kind, version):
            problems.append(
                f"{label} {version} is outside the pins of profile {profile.name} "
                f"({kind} {range_text(spec)})"
            )
    return problems


def refusal_problems(
    profile: Profile,
    versions: Mapping[str, str],
    labels: Mapping[str, tuple[str, str]] | None = None,
) -> list[str]:
    """One line per refusal of `profile` that takes a version of `versions`: what it is and
    why (`--force` applies anyway, as outside the pins)."""
    problems = []
    for kind, version in versions.items():
        label = (labels or {}).get(kind, (kind, ""))[0]
        for r in profile.refusals(kind, version):
            problems.append(
                f"profile {profile.name} refuses {label} {version} ({kind} {r.releases}): "
                f"{r.reason}"
            )
    return problems


def spec(name: str, config: Config) -> Profile | None:
    """Profile `name` as the profiles.toml files of `config`'s packs declare it; None where
    this reader cannot decide (the module's docstring says when): the full catalog decides
    then."""
    return _specs(config.packs).get(name)


@lru_cache(maxsize=4)
def _specs(dirs: tuple[str, ...]) -> dict[str, Profile]:
    places = _places(dirs)
    if places is None:
        return {}
    found: dict[str, Profile] = {}
    for place in places:
        path = place / "profiles.toml"
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            if data.get("schema") != PROFILES_SCHEMA:
                return {}
            for name, raw in data.get("profiles", {}).items():
                if name in found:
                    return {}  # defined twice: the catalog names both packs
                found[name] = read_profile(name, raw)
        except Exception:  # anything that does not read or validate: the catalog says what
            return {}
    return found


def _places(dirs: tuple[str, ...]) -> list[Path] | None:
    """The directories of the built-in library and of every pack, in the catalog's order,
    found without importing any of them; None where one cannot be."""
    import importlib.util

    from sm120patch.plan.entrypoints import entry_points
    from sm120patch.targets.files import untrusted_by

    # Where the catalog reads it: the package's own `__path__` once it is imported.
    loaded = sys.modules.get("sm120patch.patches")
    builtin = importlib.util.find_spec("sm120patch.patches") if loaded is None else None
    where = list(
        getattr(loaded, "__path__", None)
        or (builtin.submodule_search_locations or [] if builtin is not None else [])
    )
    if not where:
        return None
    places = [Path(where[0])]
    for ep in sorted(entry_points(ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        value = ep.value.strip()
        if not value.isidentifier():
            return None  # a submodule or an attribute: only importing it says where it is
        try:
            found = importlib.util.find_spec(value)
        except (ImportError, ValueError):
            return None
        if found is None or not found.submodule_search_locations:
            return None  # a plain module has no profiles.toml, but its patches may clash
        places.append(Path(next(iter(found.submodule_search_locations))))
    places += [Path(d).expanduser().resolve() for d in dirs]
    for place in places[1:]:
        # A pack's profiles.toml decides what is refused: read only where the catalog would.
        if not place.is_dir() or untrusted_by(place, os.geteuid(), tree=True):
            return None
    return places
