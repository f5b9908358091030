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
import importlib
import os
import pkgutil
import sys
import types
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier

from sm120patch.errors import UnknownProfile, UsageError
from sm120patch.patchkit.model import TARGETS, Evidence, Patch, wiring_evidence
from sm120patch.plan.packdirs import PACKS_ENV as PACKS_ENV
from sm120patch.plan.packdirs import pack_dirs as pack_dirs
from sm120patch.plan.packdirs import use_packs as use_packs
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


@dataclass(frozen=True)
class Pack:
    """Where patches and profiles come from: the built-in library or a pack from outside."""

    name: str  # "built-in", "entry point <name>" or "directory <path>"
    location: str  # the package's or directory's path
    module_file: str = ""  # an entry point naming a plain module: its file

    @property
    def built_in(self) -> bool:
        return self.name == BUILT_IN

    def code_files(self) -> list[Path]:
        """Every file of the pack that its patches may read or run: the module of a plain
        module, else every file under its directory (data files too), bytecode left out."""
        if self.module_file:
            return [Path(self.module_file)]
        if not self.location:
            return []
        from sm120patch.safeio import walk

        root = Path(self.location)
        out = []
        for base, dirs, names in walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [Path(base) / n for n in sorted(names)]
        return out

    def digest(self) -> str:
        """sha256 over the pack's modules and profiles.toml (its tests left out)."""
        return _digest_dir(self.location) if self.location else ""


class PackError(UsageError):
    """A patch pack (or the built-in library) that does not load or does not validate."""

    def __init__(self, pack: Pack | str, problem: str) -> None:
        name = pack.name if isinstance(pack, Pack) else pack
        where = "the built-in patch library" if name == BUILT_IN else f"patch pack {name}"
        super().__init__(
            f"{where}: {problem}",
            DAMAGED_HINT
            if name == BUILT_IN
            else "fix the pack, or leave it out (--patches, SM120PATCH_PATCHES, or uninstall "
            "the distribution providing the sm120patch.patches entry point)",
        )


@dataclass(frozen=True)
class Catalog:
    patches: dict[str, Patch]
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


def load() -> Catalog:
    """The built-in library plus every pack from outside (entry points, directories)."""
    return _load(pack_dirs())


@lru_cache(maxsize=4)
def _load(dirs: tuple[str, ...]) -> Catalog:
    from sm120patch import patches as package  # type: ignore[attr-defined]  # from patches/ (package-dir)

    builtin = Pack(BUILT_IN, str(Path(package.__path__[0])))
    packs: list[tuple[Pack, list[Patch], str | None]] = [
        (builtin, _patches_in(package, builtin), _read_profiles(package))
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
        packs.append((pack, _patches_in(module, pack), _read_profiles(module)))
    for d in dirs:
        packs.append(_load_dir(d))
    return _combine(packs)


def trust(pack: Pack, path: Path | None) -> None:
    """Refuse a pack that anyone but the running user or root could have written: the
    directory or module, every file in it, every directory above it (a pack is code; it
    runs with this process's privileges)."""
    if path is None:
        return
    from sm120patch.targets.files import untrusted_by

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
    import importlib.util

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
    from sm120patch.plan.entrypoints import entry_points

    return sorted(entry_points(ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _patches_in(module: Any, pack: Pack) -> list[Patch]:
    """The `PATCH` of every module of a package (or of the module itself)."""
    found: list[Patch] = []
    if isinstance(getattr(module, "PATCH", None), Patch):
        found.append(module.PATCH)
    for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", [])), key=lambda i: i.name):
        if info.name.startswith("test_"):
            continue  # a pack's own tests (new-patch writes one next to the module)
        try:
            sub = importlib.import_module(f"{module.__name__}.{info.name}")
        except Exception as exc:
            raise PackError(
                pack, f"module {info.name} does not import ({type(exc).__name__}: {exc})"
            ) from None
        patch = getattr(sub, "PATCH", None)
        if isinstance(patch, Patch):
            found.append(patch)
    return found


def _read_profiles(package: Any) -> str | None:
    """A pack's profiles.toml, None when it has none (or is a plain module). A package on
    disk is read directly: `importlib.resources`, which also reads zipped packages, brings
    `zipfile`, `tempfile` and `shutil` (4 ms) to every command."""
    if not hasattr(package, "__path__"):
        return None  # a plain module
    init = getattr(package, "__file__", None)
    if init and os.path.isfile(init):
        path = Path(init).parent / "profiles.toml"
        return path.read_text(encoding="utf-8") if path.is_file() else None
    from importlib import resources

    try:
        entry = resources.files(package).joinpath("profiles.toml")
        return entry.read_text(encoding="utf-8") if entry.is_file() else None
    except (TypeError, ModuleNotFoundError, FileNotFoundError):
        return None


def _load_dir(directory: str) -> tuple[Pack, list[Patch], str | None]:
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
    profiles = path / "profiles.toml"
    return pack, _patches_in(package, pack), (
        profiles.read_text(encoding="utf-8") if profiles.is_file() else None
    )


@lru_cache(maxsize=16)
def _digest_dir(directory: str) -> str:
    h = hashlib.sha256()
    root = Path(directory)
    for f in sorted([*root.glob("*.py"), *root.glob("*.toml")]):
        if f.name.startswith("test_"):
            continue
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def _combine(packs: list[tuple[Pack, list[Patch], str | None]]) -> Catalog:
    """One catalog from every pack: ids and profile names unique, every profile's patches
    known (from any pack), pins that parse; the first problem raises naming its pack."""
    patches: dict[str, Patch] = {}
    sources: dict[str, Pack] = {}
    for pack, found, _ in packs:
        for patch in found:
            if patch.id in patches:
                other = sources[patch.id].name
                raise PackError(pack, f"two patches declare the id {patch.id} (also in {other})")
            problems = _patch_problems(patch)
            if problems:
                raise PackError(pack, f"patch {patch.id}: {problems[0]}")
            patches[patch.id] = patch
            sources[patch.id] = pack
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


def _patch_problems(patch: Patch) -> list[str]:
    from sm120patch.patchkit import facts

    problems = []
    if patch.target not in TARGETS:
        problems.append(f"target {patch.target!r} is not one of {', '.join(TARGETS)}")
    if not patch.files:
        problems.append("names no files (neither `files` nor a fact with a file)")
    unlisted = sorted({f.file for f in patch.facts if f.file} - set(patch.files))
    if unlisted:
        problems.append(f"facts name files its `files` lacks: {', '.join(unlisted)}")
    if not callable(patch.transform):
        problems.append("has no transform")
    if patch.wiring is not None:
        problems += patch.wiring.problems()
    if patch.sought is not None:
        problems += patch.sought.problems()
    return problems + facts.check(patch.facts)


def parse_profiles(text: str, patches: dict[str, Patch]) -> dict[str, Profile]:
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
        needed = {patches[pid].target for pid in ids}
        if needed - set(prof.pins):
            raise RuntimeError(
                f"profiles.toml: profile {name} lacks pins for {sorted(needed - set(prof.pins))}"
            )
        profiles[name] = replace(prof, facts={pid: patches[pid].facts for pid in ids})
    return profiles
