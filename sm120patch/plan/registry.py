"""The patch registry: every patch of the library and of each pack known by its row (id,
target, title, files, module), its module imported only when something asks for the patch.

A pack declares its rows in `registry.toml` beside its modules, as the built-in library does.
Loading the catalog then reads that file and imports no patch module, so what reads a patch's
identity alone (`list`, `show`'s profile lines, the check of a recorded state that `revert` and
`recover` make) does not pay for libcst, which every patch module imports at its top. A
module imported later is held to its row (the same id, target, title and files) and to the
checks every patch passes (`patch_problems`), else its pack is refused. A pack without
registry.toml has its modules imported when it loads, to find their `PATCH`es, as a pack
written by `new-patch` has.
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from sm120patch.errors import UsageError
from sm120patch.patchkit import facts
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.kinds import TARGETS
from sm120patch.patchkit.model import Patch
from sm120patch.plan.profiles import BUILT_IN, DAMAGED_HINT, TOMLDecodeError, parse_toml
from sm120patch.safeio import walk

REGISTRY_FILE = "registry.toml"
REGISTRY_SCHEMA = 1


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
        root = Path(self.location)
        out = []
        for base, dirs, names in walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [Path(base) / n for n in sorted(names)]
        return out

    def digest(self) -> str:
        """sha256 over the pack's modules and its TOML files (its tests left out)."""
        return digest_dir(self.location) if self.location else ""


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
class Row:
    """What the registry knows of a patch without importing its module."""

    id: str
    target: str
    title: str
    files: tuple[str, ...]
    module: str  # the module's dotted name
    pack: Pack = field(compare=False)

    @classmethod
    def of(cls, patch: Patch, module: str, pack: Pack) -> Row:
        return cls(patch.id, patch.target, patch.title, patch.files, module, pack)


class Registry(Mapping[str, Patch]):
    """Patch id -> `Patch`, in row order; a patch's module is imported the first time the
    patch is asked for (`rows` answers what a row holds without that)."""

    def __init__(self, rows: Iterable[Row], loaded: Mapping[str, Patch] | None = None) -> None:
        self.rows: dict[str, Row] = {r.id: r for r in rows}
        self._loaded: dict[str, Patch] = dict(loaded or {})

    def __getitem__(self, patch_id: str) -> Patch:
        patch = self._loaded.get(patch_id)
        if patch is None:
            patch = self._loaded[patch_id] = _import(self.rows[patch_id])
        return patch

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, patch_id: object) -> bool:
        return patch_id in self.rows

    def facts(self, ids: Iterable[str]) -> Mapping[str, tuple[Fact, ...]]:
        """The facts of the patches `ids`, each read (its module imported) when asked for."""
        return _Facts(self, tuple(ids))

    def imported(self) -> list[str]:
        """The ids whose patch is imported so far (a test's view of the laziness)."""
        return list(self._loaded)


class _Facts(Mapping[str, tuple[Fact, ...]]):
    """`Registry.facts`: a profile's patches' facts, each read when asked for."""

    def __init__(self, registry: Registry, ids: tuple[str, ...]) -> None:
        self._registry = registry
        self._ids = ids

    def __getitem__(self, patch_id: str) -> tuple[Fact, ...]:
        if patch_id not in self._ids:
            raise KeyError(patch_id)
        return self._registry[patch_id].facts

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def rows_in(text: str, package: str, pack: Pack) -> list[Row]:
    """A pack's registry.toml as rows, in module order (the order the package lists its
    modules); the first problem raises naming the pack."""
    where = Path(pack.location, REGISTRY_FILE) if pack.location else REGISTRY_FILE
    try:
        data = parse_toml(text)
    except TOMLDecodeError as exc:
        raise PackError(pack, f"{where} is not valid TOML ({exc})") from None
    if data.get("schema") != REGISTRY_SCHEMA:
        raise PackError(
            pack, f"{where}: schema {data.get('schema')!r}, expected {REGISTRY_SCHEMA}"
        )
    rows = []
    for pid, raw in data.get("patches", {}).items():
        problem = _row_problem(raw)
        if problem:
            raise PackError(pack, f"{where}: patch {pid}: {problem}")
        files = tuple(raw["files"])
        rows.append(
            Row(pid, raw["target"], raw["title"], files, f"{package}.{raw['module']}", pack)
        )
    return sorted(rows, key=lambda r: r.module)


def _row_problem(raw: Any) -> str:
    if not isinstance(raw, dict) or set(raw) != {"module", "target", "title", "files"}:
        return "a row holds exactly module, target, title and files"
    if not isinstance(raw["module"], str) or not raw["module"].isidentifier():
        return f"module {raw['module']!r} is not a module name"
    if raw["target"] not in TARGETS:
        return f"target {raw['target']!r} is not one of {', '.join(TARGETS)}"
    if not isinstance(raw["title"], str) or not isinstance(raw["files"], list):
        return "title is text and files a list"
    return ""


def discover(module: Any, pack: Pack) -> Registry:
    """A pack without registry.toml: the `PATCH` of every module of its package (or of the
    module itself), each imported now and checked as a registered one is when imported."""
    found: dict[str, Patch] = {}
    rows: list[Row] = []

    def add(patch: Patch, name: str) -> None:
        problems = patch_problems(patch)
        if problems:
            raise PackError(pack, f"patch {patch.id}: {problems[0]}")
        if patch.id in found:
            raise PackError(pack, f"two patches declare the id {patch.id}")
        found[patch.id] = patch
        rows.append(Row.of(patch, name, pack))

    if isinstance(getattr(module, "PATCH", None), Patch):
        add(module.PATCH, module.__name__)
    for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", [])), key=lambda i: i.name):
        if info.name.startswith("test_"):
            continue  # a pack's own tests (new-patch writes one next to the module)
        name = f"{module.__name__}.{info.name}"
        try:
            sub = importlib.import_module(name)
        except Exception as exc:
            raise PackError(
                pack, f"module {info.name} does not import ({type(exc).__name__}: {exc})"
            ) from None
        patch = getattr(sub, "PATCH", None)
        if isinstance(patch, Patch):
            add(patch, name)
    return Registry(rows, found)


def _import(row: Row) -> Patch:
    """The patch of `row`, its module imported and held to the row."""
    short = row.module.rsplit(".", 1)[-1]
    try:
        module = importlib.import_module(row.module)
    except Exception as exc:  # a pack's import error must not be a traceback
        raise PackError(
            row.pack, f"module {short} does not import ({type(exc).__name__}: {exc})"
        ) from None
    patch = getattr(module, "PATCH", None)
    if not isinstance(patch, Patch):
        raise PackError(
            row.pack, f"module {short} declares no PATCH, but {REGISTRY_FILE} lists {row.id} there"
        )
    declared = Row.of(patch, row.module, row.pack)
    if declared != row:
        differ = [
            f"{name} {getattr(declared, name)!r} where {REGISTRY_FILE} has {getattr(row, name)!r}"
            for name in ("id", "target", "title", "files")
            if getattr(declared, name) != getattr(row, name)
        ]
        raise PackError(row.pack, f"module {short}'s PATCH has {'; '.join(differ)}")
    problems = patch_problems(patch)
    if problems:
        raise PackError(row.pack, f"patch {patch.id}: {problems[0]}")
    return patch


def patch_problems(patch: Patch) -> list[str]:
    """What makes `patch` unusable: an unknown target, no files, facts naming files it does
    not list, no transform, wiring or sought names that do not parse, facts that disagree."""
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


@lru_cache(maxsize=16)
def digest_dir(directory: str) -> str:
    h = hashlib.sha256()
    root = Path(directory)
    for f in sorted([*root.glob("*.py"), *root.glob("*.toml")]):
        if f.name.startswith("test_"):
            continue
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()
