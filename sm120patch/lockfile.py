"""Lock files (`sm120patch.lock`): freeze, for one deployment, the SGLang and FlashInfer versions,
the profile, each patch's code digest and each touched file's hash before and after, so that
`apply --locked` on another machine reproduces exactly that, or refuses saying what differs.

File paths in a lock are module paths (`sglang/srt/server_args.py`), so a lock made on a git
checkout applies to an installed package of the same release and the other way round.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from sm120patch import __version__, catalog
from sm120patch.errors import Refused, UsageError
from sm120patch.plan import Plan
from sm120patch.transform import Patch

SCHEMA = 1


# The library code a patch's result may depend on besides its own module. The runner
# (`transform_text`) is a root for every patch: it chains, compiles and re-runs them.
HELPER_MODULES = (
    "sm120patch.operations",
    "sm120patch.cst_helpers",
    "sm120patch.transform",
    "sm120patch.facts",
)
RUNNER = ("sm120patch.transform", "transform_text")


def patch_digest(patch: Patch) -> str:
    """`_patch_digest`, kept on disk per version of the code (the plan cache's code digest):
    following a patch's helpers through their syntax trees is a tenth of a second that every
    `apply --locked` on a fleet node would otherwise pay again."""
    from sm120patch import plancache

    cache = plancache.cache_dir() / f"digests-{plancache.code_digest()[:32]}.json"
    try:
        known = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    # The patch's own module may come from a pack outside the code digest: its bytes too.
    source = Path(sys.modules[patch.transform.__module__].__file__ or "").read_bytes()
    key = f"{patch.id}\0{hashlib.sha256(source).hexdigest()}"
    if isinstance(known.get(key), str):
        return str(known[key])
    digest = _patch_digest(patch)
    if plancache.enabled():
        try:
            from sm120patch.state import atomic_write

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
    helpers = {name: _source(name) for name in HELPER_MODULES}
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
    """Local name -> helper module (`from sm120patch import cst_helpers as h`), and local name
    -> (helper module, name) (`from sm120patch.operations import add_import`)."""
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
    import ast

    return ast.dump(node)


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
            n.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return tree


@dataclass
class Lock:
    profile: str
    versions: dict[str, str]
    patches: dict[str, str]  # id -> digest
    files: list[dict[str, str]] = field(default_factory=list)  # target, path, before, after
    tool_version: str = __version__
    # The reviewed result, step by step (target, path, patch, after, diff): a node whose files
    # have the locked before-hashes writes exactly these bytes without parsing anything.
    steps: list[dict[str, str]] = field(default_factory=list)

    def digest(self) -> str:
        """What the lock pins, as one digest (recorded in the manifest of an `--locked` apply)."""
        return "sha256:" + hashlib.sha256(self.to_toml().encode("utf-8")).hexdigest()

    # id -> the pack it came from ("built-in", "entry point X", "directory /p"); pack -> its
    # digest (catalog.Pack.digest), recorded to say which version of a pack made the lock.
    # A lock without them (written before packs) reads as all built-in.
    pack_of: dict[str, str] = field(default_factory=dict)
    packs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A lock made here (not read from a file) names the packs of the catalog in effect,
        # whichever code path built it; `read` passes what the file says.
        if self.patches and not self.pack_of:
            cat = catalog.load()
            self.pack_of = {pid: cat.source(pid).name for pid in self.patches}
            if not self.packs and self.profile in cat.profiles:
                self.packs = {p.name: p.digest() for p in cat.packs_of(cat.profile(self.profile))}

    def to_toml(self) -> str:
        q = json.dumps  # a TOML basic string is a JSON string for the text we write
        out = [
            "# sm120patch lock file: `sm120patch apply --locked <this file>` reproduces exactly",
            "# this patch set, or refuses (changing nothing) when anything below differs.",
            f"schema = {SCHEMA}",
            f"tool_version = {q(self.tool_version)}",
            f"profile = {q(self.profile)}",
            "",
            "[versions]",
            *(f"{kind} = {q(v)}" for kind, v in sorted(self.versions.items())),
        ]
        for pid, digest in self.patches.items():
            out += ["", "[[patches]]", f"id = {q(pid)}", f"digest = {q(digest)}"]
            out.append(f"pack = {q(self.pack_of.get(pid, catalog.BUILT_IN))}")
        for name, digest in self.packs.items():
            out += ["", "[[packs]]", f"name = {q(name)}", f"digest = {q(digest)}"]
        for f in self.files:
            out += [
                "",
                "[[files]]",
                *(f"{k} = {q(f[k])}" for k in ("target", "path", "before", "after")),
            ]
        for s in self.steps:
            out += [
                "",
                "[[steps]]",
                *(f"{k} = {q(s[k])}" for k in ("target", "path", "patch", "after", "diff")),
            ]
        return "\n".join(out) + "\n"

    def plan(self, profile: Any, found: list[Any]) -> Plan | None:
        """The plan this lock records, on `found` targets whose files have the locked
        before-hashes; None (plan instead) where anything does not match exactly."""
        from sm120patch.plan import Plan, TargetPlan, apply_diff
        from sm120patch.plancache import CachedFileResult
        from sm120patch.transform import Outcome, Status

        if not self.steps or {t.kind for t in found} != set(self.versions):
            return None
        plans = []
        outcomes = []
        for target in found:
            tp = TargetPlan(target)
            for f in (f for f in self.files if f["target"] == target.kind):
                try:
                    before = target.path_of(f["path"]).read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    return None
                if _sha(before) != f["before"]:
                    return None
                text, texts = before, []
                for s in self.steps:
                    if (s["target"], s["path"]) != (target.kind, f["path"]):
                        continue
                    nxt = apply_diff(text, s["diff"])
                    if nxt is None or _sha(nxt) != s["after"]:
                        return None
                    texts.append((s["patch"], nxt))
                    outcomes.append(
                        Outcome(s["patch"], target.kind, f["path"], "(as locked)",
                                Status.APPLIED, "the lock's reviewed change")
                    )  # fmt: skip
                    text = nxt
                if not texts or _sha(text) != f["after"]:
                    return None
                result = CachedFileResult(file=f["path"], before=before, after=text)
                result.texts = texts
                result.outcomes = [o for o in outcomes if o.file == f["path"]]
                tp.files.append(result)
            plans.append(tp)
        order = {pid: i for i, pid in enumerate(profile.patches)}
        return Plan(profile, plans, sorted(outcomes, key=lambda o: order.get(o.patch, 0)))


def from_plan(plan: Plan) -> Lock:
    cat = catalog.load()
    files = [
        {
            "target": tp.target.kind,
            "path": f.file,
            "before": _sha(f.before),
            "after": _sha(f.after),
        }
        for tp in plan.targets
        for f in tp.changed
    ]
    from sm120patch.plan import diff_texts

    steps = []
    for tp in plan.targets:
        for f in tp.changed:
            before = f.before
            for pid, text in f.step_texts():
                steps.append({"target": tp.target.kind, "path": f.file, "patch": pid,
                              "after": _sha(text),
                              "diff": diff_texts(f.file, before, text)})  # fmt: skip
                before = text
    return Lock(
        profile=plan.profile.name,
        versions={tp.target.kind: tp.target.version for tp in plan.targets},
        patches={pid: patch_digest(cat.patches[pid]) for pid in plan.profile.patches},
        files=files,
        steps=steps,
    )


def make(profile_name: str, paths: Any, *, force: bool = False) -> Lock:
    """The lock of `profile_name` on the trees at `paths`.

    A reference box is usually patched already: where the profile is applied (checked from the
    bytes), the lock records the applied state from its manifest; on pristine trees (or where
    the patch is gone) it records what the plan would write.
    """
    from sm120patch import assess
    from sm120patch import plan as planner

    cat = catalog.load()
    profile = cat.profile(profile_name)
    found = planner.resolve_targets(profile, paths)
    outside = planner.check_pins(profile, found)
    if outside and not force:
        raise Refused("; ".join(outside), "use a pinned release, or --force to pin anyway")
    states = {s.target.kind: s for s in assess.status(paths) if s.target.kind in profile.targets}
    applied = [s for s in states.values() if s.state == assess.APPLIED]
    for s in states.values():
        if s.state in (assess.PRISTINE, assess.GONE, assess.REPLACED):
            continue
        if s.state == assess.APPLIED and s.profile == profile.name:
            continue
        raise Refused(
            f"{s.target.root}: {s.assessment.message}",
            "pin on trees where this profile is applied or nothing is",
        )
    if applied and len(applied) != len(found):
        raise Refused(
            f"profile {profile.name} is applied on some of its targets only",
            f"apply it everywhere (`sm120patch apply {profile.name}`), then pin",
        )
    if applied:
        files = [
            {"target": s.target.kind, "path": f.module, "before": f.before, "after": f.after}
            for s in applied
            for f in (s.assessment.manifest.files if s.assessment.manifest else ())
        ]
        return Lock(
            profile=profile.name,
            versions={s.target.kind: s.target.version for s in applied},
            patches={pid: patch_digest(cat.patches[pid]) for pid in profile.patches},
            files=files,
        )
    lock = from_plan(planner.checked(profile.name, paths, force=True))
    if not lock.files:
        raise Refused(
            f"profile {profile.name} changes no file here (every site is already SM120-ready)",
            "nothing to pin on these releases",
        )
    return lock


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read(path: Path) -> Lock:
    from sm120patch.catalog import tomllib

    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"lock file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Refused(f"cannot read lock file {path} ({exc})") from None
    try:
        doc: dict[str, Any] = tomllib.loads(raw)
        schema = doc["schema"]
        if not isinstance(schema, int) or schema > SCHEMA:
            raise Refused(
                f"lock file {path} has schema {schema!r}; this sm120patch reads up to {SCHEMA}",
                "use the sm120patch version that wrote it",
            )
        return Lock(
            profile=str(doc["profile"]),
            versions={str(k): str(v) for k, v in doc["versions"].items()},
            patches={str(p["id"]): str(p["digest"]) for p in doc.get("patches", [])},
            pack_of={
                str(p["id"]): str(p.get("pack", catalog.BUILT_IN)) for p in doc.get("patches", [])
            },
            packs={str(p["name"]): str(p["digest"]) for p in doc.get("packs", [])},
            files=[
                {k: str(f[k]) for k in ("target", "path", "before", "after")}
                for f in doc.get("files", [])
            ],
            tool_version=str(doc.get("tool_version", "")),
            steps=[
                {k: str(s[k]) for k in ("target", "path", "patch", "after", "diff")}
                for s in doc.get("steps", [])
            ],
        )
    except (tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise Refused(
            f"lock file {path} is not a valid sm120patch lock ({exc})",
            "regenerate it with `sm120patch pin`",
        ) from None


def differences(lock: Lock, plan: Plan, skip: frozenset[str] = frozenset()) -> list[str]:
    """Everything in which `plan` (on pristine trees) differs from `lock`; empty when identical.

    `skip`: target kinds already applied exactly as the lock says (checked from their bytes).
    """
    now = from_plan(plan)
    if skip:
        lock = Lock(lock.profile, {k: v for k, v in lock.versions.items() if k not in skip},
                    lock.patches, [f for f in lock.files if f["target"] not in skip])  # fmt: skip
        now.versions = {k: v for k, v in now.versions.items() if k not in skip}
        now.files = [f for f in now.files if f["target"] not in skip]
    problems = []
    if lock.profile != now.profile:
        problems.append(f"profile: lock has {lock.profile}, asked for {now.profile}")
    for kind in sorted(set(lock.versions) | set(now.versions)):
        a, b = lock.versions.get(kind), now.versions.get(kind)
        if a != b:
            problems.append(f"{kind} version: lock has {a}, found {b}")
    for pid in sorted(set(lock.pack_of) & set(now.pack_of)):
        a, b = lock.pack_of[pid], now.pack_of[pid]
        if a != b:
            problems.append(f"patch {pid}: lock has it from {a}, here it comes from {b}")
    for pid in sorted(set(lock.patches) | set(now.patches)):
        a, b = lock.patches.get(pid), now.patches.get(pid)
        if a != b:
            problems.append(
                f"patch {pid}: lock digest {_short(a)}, this sm120patch has {_short(b)}"
            )
    locked = {(f["target"], f["path"]): f for f in lock.files}
    found = {(f["target"], f["path"]): f for f in now.files}
    for key in sorted(set(locked) | set(found)):
        a, b = locked.get(key), found.get(key)
        where = f"{key[0]} {key[1]}"
        if a is None:
            problems.append(f"{where}: would be patched but is not in the lock")
        elif b is None:
            problems.append(f"{where}: in the lock but would not be patched here")
        elif a["before"] != b["before"]:
            problems.append(
                f"{where}: file differs from the locked original "
                f"({_short(a['before'])} locked, {_short(b['before'])} here)"
            )
        elif a["after"] != b["after"]:
            problems.append(f"{where}: patched text would differ from the locked result")
    return problems


def _short(digest: str | None) -> str:
    if digest is None:
        return "none"
    return digest.removeprefix("sha256:")[:12]


def check(lock: Lock, path: Path) -> Any:
    """A plan check for `engine.apply`: refuse, naming each difference, unless identical.

    The check is called with the kinds of the targets already applied as the lock says."""

    def verify(plan: Plan, skip: frozenset[str] = frozenset()) -> None:
        problems = differences(lock, plan, skip)
        if problems:
            raise Refused(
                f"{path} does not match these trees: " + "; ".join(problems),
                "nothing was changed; use the releases the lock was made on, or make a new lock",
            )

    return verify
