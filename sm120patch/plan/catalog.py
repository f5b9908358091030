"""Load the patch library (patches/*.py, patches/profiles.toml) and patch packs from outside.

A pack is a package of patch modules (each declaring `PATCH = Patch(...)`) with an optional
profiles.toml, in the layout of the built-in library. Packs come from the entry point group
`sm120patch.patches` (each entry point names a package) and from directories (`--patches DIR`,
`SM120PATCH_PATCHES`), and are validated as the built-in library is: ids unique across every
pack, pins that parse, every patch a profile names known.

Packs are code, run with the privileges of whoever runs sm120patch (often root): they come from
those three places only, and a pack whose directory or module (or anything in it, or a
directory above it) anyone but the running user or root could write is refused before it is
imported (`trust`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier

from sm120patch import patches as package  # type: ignore[attr-defined]  # patches/ (package-dir)
from sm120patch.config import PACKS_ENV as PACKS_ENV
from sm120patch.config import Config
from sm120patch.errors import UnknownProfile
from sm120patch.patchkit.model import Evidence, Patch, wiring_evidence
from sm120patch.plan.entrypoints import entry_points
from sm120patch.plan.profiles import BUILT_IN as BUILT_IN
from sm120patch.plan.profiles import DAMAGED_HINT as DAMAGED_HINT
from sm120patch.plan.profiles import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from sm120patch.plan.profiles import PROFILES_SCHEMA as PROFILES_SCHEMA
from sm120patch.plan.profiles import Profile as Profile
from sm120patch.plan.profiles import Refusal as Refusal
from sm120patch.plan.profiles import TOMLDecodeError as TOMLDecodeError
from sm120patch.plan.profiles import parse_toml as parse_toml
from sm120patch.plan.profiles import pin_problems as pin_problems
from sm120patch.plan.profiles import read_profile
from sm120patch.plan.profiles import refusal_problems as refusal_problems
from sm120patch.plan.registry import REGISTRY_FILE, Registry, Row, discover, rows_in
from sm120patch.plan.registry import Pack as Pack
from sm120patch.plan.registry import PackError as PackError
from sm120patch.targets.files import untrusted_by


@dataclass(frozen=True)
class Catalog:
    # patch id -> Patch, each patch's module imported when it is first asked for; what the
    # registry knows without importing it is in `patches.rows`
    patches: Registry
    profiles: dict[str, Profile]
    # patch id / profile name -> the pack it comes from
    sources: dict[str, Pack] = field(default_factory=dict)
    profile_sources: dict[str, Pack] = field(default_factory=dict)
    # every pack loaded, the built-in library first (known.toml is read from each)
    loaded: list[Pack] = field(default_factory=list)

    def profile(self, name: str) -> Profile:
        try:
            return self.profiles[name]
        except KeyError:
            known = ", ".join(sorted(self.profiles))
            raise UnknownProfile(
                name,
                f"unknown profile '{name}'; known profiles: {known}",
                "`sm120patch list` shows each with its pins and patches",
            ) from None

    def patches_of(self, profile: Profile) -> list[Patch]:
        return [self.patches[pid] for pid in profile.patches]

    def source(self, patch_id: str) -> Pack:
        return self.sources.get(patch_id, Pack(BUILT_IN, ""))

    @property
    def packs(self) -> list[Pack]:
        """Every pack from outside that this catalog loaded (the built-in library left out)."""
        found = [*self.sources.values(), *self.profile_sources.values()]
        return [p for p in {p.name: p for p in found}.values() if not p.built_in]

    def packs_of(self, profile: Profile) -> list[Pack]:
        """The packs a profile's patches and the profile itself come from, each once."""
        found = [self.profile_sources.get(profile.name, Pack(BUILT_IN, ""))]
        found += [self.source(pid) for pid in profile.patches]
        return list({p.name: p for p in found}.values())

    def wiring(self, profile: Profile | str, log: str) -> dict[str, Evidence]:
        """What a server's `log` shows of each patch of `profile` that declares its wiring:
        ran, skipped or not-seen (`patchkit.model.wiring_evidence`)."""
        prof = self.profile(profile) if isinstance(profile, str) else profile
        return wiring_evidence(self.patches_of(prof), log)


def load(config: Config | None = None) -> Catalog:
    """The built-in library plus every pack from outside: entry points and the directories of
    `config` (a command's, `app.Session.config`); None is the environment's alone
    (SM120PATCH_PATCHES: a test, a library user). Cached by the directories, so one catalog
    per set of packs, whichever command asks."""
    return _load((config or Config.made()).packs)


@lru_cache(maxsize=4)
def _load(dirs: tuple[str, ...]) -> Catalog:
    builtin = Pack(BUILT_IN, str(Path(package.__path__[0])))
    packs: list[tuple[Pack, Registry, str | None]] = [
        (builtin, _registry(package, builtin), _read_data(package, "profiles.toml"))
    ]
    for ep in _entry_points():
        pack = Pack(f"entry point {ep.name}", "")
        trust(pack, _entry_point_code(ep))
        try:
            module = ep.load()
        except Exception as exc:  # a third party's import error must not be a traceback
            raise PackError(pack, f"does not import ({type(exc).__name__}: {exc})") from None
        where = getattr(module, "__path__", None)
        if where:
            pack = Pack(pack.name, str(list(where)[0]))
        else:
            pack = Pack(pack.name, str(Path(module.__file__ or "").parent), module.__file__ or "")
        # What was loaded, too: before its patches are used (its name may not have said).
        trust(pack, Path(pack.module_file or pack.location) if pack.location else None)
        packs.append((pack, _registry(module, pack), _read_data(module, "profiles.toml")))
    for d in dirs:
        packs.append(_load_dir(d))
    return _combine(packs)


def trust(pack: Pack, path: Path | None) -> None:
    """Refuse a pack that anyone but the running user or root could have written: the
    directory or module, every file in it, every directory above it (a pack is code; it
    runs with this process's privileges)."""
    if path is None:
        return
    problem = untrusted_by(path, os.geteuid(), tree=True)
    if problem:
        raise PackError(
            pack,
            f"{problem}; a pack is code and runs with your privileges, so it must be "
            "writable by no one but you (or root)",
        )


def _entry_point_code(ep: Any) -> Path | None:
    """Where the top-level package (or module) an entry point names lives, found without
    importing anything; None when it is not on disk as a file or directory."""
    value = getattr(ep, "value", None)
    if not isinstance(value, str):
        return None  # judged once loaded, by where it came from
    top = value.split(":")[0].strip().split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None  # the import fails below, with its own words
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin and os.path.isfile(spec.origin) else None


def _entry_points() -> list[Any]:
    return sorted(entry_points(ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _registry(package: Any, pack: Pack) -> Registry:
    """A pack's patches: the rows of its registry.toml, no module imported, or, where it has
    none, every module's `PATCH` found by importing it."""
    text = _read_data(package, REGISTRY_FILE)
    if text is None:
        return discover(package, pack)
    return Registry(rows_in(text, package.__name__, pack))


def _read_data(package: Any, name: str) -> str | None:
    """A pack's data file `name` (profiles.toml, registry.toml), None when it has none (or is
    a plain module). A package on disk is read directly: `importlib.resources`, which also
    reads zipped packages, brings `zipfile`, `tempfile` and `shutil` (4 ms) to every command."""
    if not hasattr(package, "__path__"):
        return None  # a plain module
    init = getattr(package, "__file__", None)
    if init and os.path.isfile(init):
        path = Path(init).parent / name
        return path.read_text(encoding="utf-8") if path.is_file() else None
    if init is None:  # a namespace package (a pack directory): its first directory
        path = Path(list(package.__path__)[0]) / name
        return path.read_text(encoding="utf-8") if path.is_file() else None
    from importlib import resources  # here: see above (a zipped package only)

    try:
        entry = resources.files(package).joinpath(name)
        return entry.read_text(encoding="utf-8") if entry.is_file() else None
    except (TypeError, ModuleNotFoundError, FileNotFoundError):
        return None


def _load_dir(directory: str) -> tuple[Pack, Registry, str | None]:
    path = Path(directory).expanduser().resolve()
    pack = Pack(f"directory {path}", str(path))
    if not path.is_dir():
        raise PackError(pack, "is not a directory")
    trust(pack, path)  # before anything of it is imported
    # The directory becomes a package of its own name, so its modules import as
    # `sm120patch_pack_<digest>.<module>` and may import each other relatively.
    name = f"sm120patch_pack_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    package = sys.modules.get(name)
    if package is None:
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    return pack, _registry(package, pack), _read_data(package, "profiles.toml")


def _combine(packs: list[tuple[Pack, Registry, str | None]]) -> Catalog:
    """One catalog from every pack: ids and profile names unique, every profile's patches
    known (from any pack), pins that parse; the first problem raises naming its pack. No
    patch module is imported here but those of a pack without registry.toml."""
    rows: dict[str, Row] = {}
    loaded: dict[str, Patch] = {}
    for pack, found, _ in packs:
        for pid, row in found.rows.items():
            if pid in rows:
                other = rows[pid].pack.name
                raise PackError(pack, f"two patches declare the id {pid} (also in {other})")
            rows[pid] = row
        loaded.update({pid: found[pid] for pid in found.imported()})
    patches = Registry(rows.values(), loaded)
    sources = {pid: row.pack for pid, row in rows.items()}
    profiles: dict[str, Profile] = {}
    profile_sources: dict[str, Pack] = {}
    for pack, _, text in packs:
        if text is None:
            continue
        try:
            found_profiles = parse_profiles(text, patches)
        except TOMLDecodeError as exc:
            where = Path(pack.location, "profiles.toml") if pack.location else "profiles.toml"
            raise PackError(pack, f"{where} is not valid TOML ({exc})") from None
        except RuntimeError as exc:
            raise PackError(pack, str(exc)) from None
        for name, prof in found_profiles.items():
            if name in profiles:
                other = profile_sources[name].name
                raise PackError(pack, f"profiles.toml: profile {name} is also defined in {other}")
            profiles[name] = prof
            profile_sources[name] = pack
    return Catalog(patches, profiles, sources, profile_sources, [p for p, _, _ in packs])


def parse_profiles(text: str, patches: Registry) -> dict[str, Profile]:
    data = parse_toml(text)
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
            prof = read_profile(name, raw)
        except InvalidSpecifier as exc:
            raise RuntimeError(f"profiles.toml: profile {name}: {exc}") from None
        needed = {patches.rows[pid].target for pid in ids}
        if needed - set(prof.pins):
            raise RuntimeError(
                f"profiles.toml: profile {name} lacks pins for {sorted(needed - set(prof.pins))}"
            )
        profiles[name] = replace(prof, facts=patches.facts(ids))
    return profiles
