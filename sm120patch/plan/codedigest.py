"""A patch's code digest: what a lock pins of the code that decides what a patch writes.

The digest covers the patch's module and, of the shared helper modules, only the definitions
it reaches (followed name by name), each compared as its syntax tree without docstrings: a
comment, a docstring or an edit to a helper this patch does not use leaves the digest (and
every lock holding it) as it was. The trees are written out by `_dump`, the same on every
Python (`ast.dump` is not: 3.12 added fields, 3.13 hides empty ones), so that a lock pinned
on one Python applies on a node with another.

`source_key` is the cheap twin: a hash of the bytes of all that code. Equal keys mean equal
code, so equal digests, without walking a tree (what a fleet node checks first).
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sm120patch.patchkit.model import Patch

# The library code a patch's result may depend on besides its own module is the kit: every
# module of sm120patch.patchkit, found on disk (a helper module added there is digested without
# anyone listing it). The runner (`transform_text`) is a root for every patch: it chains,
# compiles and re-runs them.
KIT = "sm120patch.patchkit"
RUNNER = (f"{KIT}.runner", "transform_text")


@lru_cache(maxsize=1)
def kit_modules() -> tuple[str, ...]:
    """Every module of the kit, by name, read from its directory (nothing imported)."""
    kit = Path(__file__).resolve().parents[1] / "patchkit"
    return tuple(sorted(f"{KIT}.{p.stem}" for p in kit.glob("*.py") if p.stem != "__init__"))


def source_key(patch: Patch) -> str:
    """A hash of the bytes of every module `patch_digest` reads and of the code computing it
    (the plan cache's code digest covers sm120patch and the built-in patches), and of the
    patch's own module, which may come from a pack outside them."""
    from sm120patch.plan import plancache

    h = hashlib.sha256(f"{plancache.code_digest()}\0{patch.id}\0".encode())
    h.update(Path(sys.modules[patch.transform.__module__].__file__ or "").read_bytes())
    return "sha256:" + h.hexdigest()


def patch_digest(patch: Patch, key: str | None = None) -> str:
    """`_patch_digest`, kept on disk by `source_key` (`key`, when the caller has it):
    following a patch's helpers through their syntax trees is a tenth of a second, paid once
    per version of the code."""
    from sm120patch.plan import plancache

    directory = plancache.cache_dir() if plancache.enabled() else None
    name = f"digests-{plancache.code_digest()[:32]}.json"
    cache = None if directory is None else directory / name
    try:
        raw = None if cache is None else plancache.read_entry(cache)
        known = json.loads(raw) if raw else {}
    except ValueError:
        known = {}
    if not isinstance(known, dict):
        known = {}
    key = key or source_key(patch)
    if isinstance(known.get(key), str):
        return str(known[key])
    digest = _patch_digest(patch)
    if cache is not None:
        try:
            from sm120patch.targets.files import atomic_write

            atomic_write(cache, json.dumps({**known, key: digest}).encode(), durable=False)
        except OSError:
            pass
    return digest


def _patch_digest(patch: Patch) -> str:
    """A digest of the code that decides what a patch writes: its module, and of the shared
    helper modules only the definitions it reaches (followed name by name), each compared
    as its syntax tree without docstrings, so that a comment or a docstring, or an edit to a
    helper this patch does not use, leaves the digest (and every lock holding it) as it was."""
    module = sys.modules[patch.transform.__module__]
    helpers = {name: _source(name) for name in kit_modules()}
    return digest_of(Path(module.__file__ or "").read_text(encoding="utf-8"), helpers)


def _source(module_name: str) -> str:
    """A helper module's source, found without importing it (cst_helpers imports libcst)."""
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    return Path(spec.origin if spec and spec.origin else "").read_text(encoding="utf-8")


def digest_of(patch_source: str, helpers: dict[str, str]) -> str:
    """`patch_digest` over source texts: the patch module's and each helper module's."""
    import ast

    index = {name: _definitions(text) for name, text in helpers.items()}
    tree = _strip_docstrings(ast.parse(patch_source))
    h = hashlib.sha256(_dump(tree).encode())
    todo = sorted(_references(tree, index, _imports(tree, index))) + [RUNNER]
    seen: set[tuple[str, str]] = set()
    while todo:
        ref = todo.pop()
        if ref in seen or ref[1] not in index.get(ref[0], {}):
            continue
        seen.add(ref)
        todo += sorted(_helper_references(ref[0], ref[1], tuple(sorted(helpers.items()))) - seen)
    for mod, name in sorted(seen):
        h.update(f"\0{mod}.{name}\0{_dumped(helpers[mod], name)}".encode())
    return "sha256:" + h.hexdigest()


Index = dict[str, dict[str, Any]]
Imports = tuple[dict[str, str], dict[str, tuple[str, str]]]


@lru_cache(maxsize=32)
def _definitions(source: str) -> dict[str, Any]:
    """Top-level name -> its def, class or assignment (parsed once per source text)."""
    import ast

    tree = _strip_docstrings(ast.parse(source))
    out: dict[str, Any] = {"<module>": tree}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


@lru_cache(maxsize=512)
def _dumped(source: str, name: str) -> str:
    return _dump(_definitions(source)[name])


@lru_cache(maxsize=1024)
def _helper_references(
    home: str, name: str, helpers: tuple[tuple[str, str], ...]
) -> frozenset[tuple[str, str]]:
    """What one helper definition uses: names of its own module, and of the helper modules
    its module (at top level) or the definition itself imports."""
    import ast

    index = {mod: _definitions(text) for mod, text in helpers}
    defs = index[home]
    node = defs[name]
    top = ast.Module(body=[n for n in defs["<module>"].body if isinstance(n, ast.ImportFrom)],
                     type_ignores=[])
    aliases, names = _imports(top, index)
    local_aliases, local_names = _imports(node, index)
    imports = ({**aliases, **local_aliases}, {**names, **local_names})
    out = _references(node, index, imports)
    out |= {
        (home, n.id)
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and n.id in defs and n.id != "<module>"
    }
    return frozenset(out)


def _imports(node: Any, index: Index) -> Imports:
    """Local name -> helper module (`from sm120patch.patchkit import syntax as h`), and local name
    -> (helper module, name) (`from sm120patch.patchkit.operations import add_import`)."""
    import ast

    aliases: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                full = f"{n.module}.{a.name}"
                if full in index:
                    aliases[a.asname or a.name] = full
                elif n.module in index:
                    names[a.asname or a.name] = (n.module, a.name)
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name in index and a.asname:
                    aliases[a.asname] = a.name
    return aliases, names


def _references(node: Any, index: Index, imports: Imports) -> set[tuple[str, str]]:
    """(helper module, name) pairs `node` uses through `imports`."""
    import ast

    aliases, names = imports
    out: set[tuple[str, str]] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if n.value.id in aliases:
                out.add((aliases[n.value.id], n.attr))
        elif isinstance(n, ast.Name) and n.id in names:
            out.add(names[n.id])
    return out


def _dump(node: Any) -> str:
    """`ast.dump` without the fields that are None or empty, which Pythons differ on
    (3.12's `type_params=[]`, 3.13 leaving empty fields out): one text on every Python."""
    import ast

    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={_dump(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_dump(v) for v in node) + "]"
    return repr(node)


def _strip_docstrings(tree: Any) -> Any:
    """The tree without docstrings, changed in place (comments are not in it to begin with)."""
    import ast

    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if (
            isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            n.body = body[1:] or [ast.Pass()]
    return tree
