"""Plan a profile on its targets without touching anything: outcomes per site and the unified diff.

Each file is read once and parsed once; every patch of the profile that lives in it runs on
that one parse, in profile order.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from sm120patch.errors import Refused
from sm120patch.patchkit.model import Outcome, Patch, Status
from sm120patch.patchkit.runner import FileResult, forget_parses, refuse_all, transform_text
from sm120patch.plan import catalog, pins
from sm120patch.plan.catalog import Profile
from sm120patch.plan.plans import Plan, PlanRefused, TargetPlan
from sm120patch.targets import Target
from sm120patch.targets.resolved import Given, owned, resolved

# (patches, file, text): one call of `transform_text`.
Job = tuple[list[Patch], str, str]


def checked(profile_name: str, paths: Given, *, force: bool = False) -> Plan:
    """`plan`, raising PlanRefused when any site refuses (for pin, export)."""
    result = plan(profile_name, paths, force=force)
    if result.refused:
        raise PlanRefused(result)
    return result


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector off while files are parsed and patched: a parse of
    server_args.py builds about a million objects, none in a cycle (libcst trees hold no
    parent links), and the collector walking them again and again as they are made was 45 ms
    of a 700 ms cold plan. Reference counting still frees everything; cycles made meanwhile
    wait for the collector's next run once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plan(
    profile_name: str,
    paths: Given | None = None,
    *,
    force: bool = False,
    found: list[Target] | None = None,
    texts: Mapping[str, Mapping[str, str]] | None = None,
) -> Plan:
    """Outcomes and diff of `profile_name` on the targets at `paths` (None: installed ones).

    `texts` (per target kind, module path -> text) stands in for files on disk: the pristine
    side of an applied tree, which `export` plans from. Raises Refused when a target is
    outside the profile's pins, unless `force`.
    """
    with owned(paths or {}) as named:
        profile = catalog.load(named.config).profile(profile_name)
        found = found if found is not None else pins.resolve_targets(profile, named)
        pins.require_pins(profile, found, named, force=force, verb="plan")
        return plan_admitted(profile_name, found, named, texts=texts)


def plan_admitted(
    profile_name: str,
    found: list[Target],
    paths: Given | None = None,
    *,
    texts: Mapping[str, Mapping[str, str]] | None = None,
) -> Plan:
    """The plan of targets the caller has admitted already: a verb checks the pins once, where
    it finds its targets (`pins.require_pins`, with the user's --force), and a report shows
    what is outside them. This checks no pin; the plan records what is outside them
    (`pins.check_pins`), which only --force lets through."""
    named = resolved(paths or {})
    cat = catalog.load(named.config)
    profile = cat.profile(profile_name)
    outside = pins.check_pins(profile, found, named)  # kept on the plan
    patches = cat.patches_of(profile)
    with no_cycle_collection():
        plans = [
            plan_target(profile, patches, t, texts.get(t.kind) if texts else None) for t in found
        ]
        # A plan carries texts. Its trees (server_args.py's alone is about a million nodes)
        # go now, with the parse cache, or every full collection of the cyclic collector for
        # the rest of the process walks them: 0.2 s of CPU in a 1.2 s cold dry run.
        for tp in plans:
            for f in tp.files:
                f.forget_trees()
        forget_parses()
    order = {pid: i for i, pid in enumerate(profile.patches)}
    outcomes = sorted(
        (o for tp in plans for f in tp.files for o in f.outcomes), key=lambda o: order[o.patch]
    )
    return Plan(profile, plans, outcomes, outside, catalog=cat)


def plan_target(
    profile: Profile,
    patches: list[Patch],
    target: Target,
    given: Mapping[str, str] | None = None,
    run: Callable[[list[Patch], str, str], FileResult] = transform_text,
) -> TargetPlan:
    """The plan of one target: each file it reads parsed once, its patches run in order.

    `run` is the file's transform; the real-release tests pass one that remembers results by
    the file's bytes (a pure function of the patches, the file's path and its text)."""
    pending = _prepare(patches, target, given)
    return _finish(profile, pending, [run(*job) for job in pending.jobs()])


@dataclass
class _Pending:
    """A target's files read and grouped, before their transforms: each entry is a result
    already known (missing or unreadable files) or a job for the runner."""

    target: Target
    mine: list[Patch]
    entries: list[FileResult | Job]

    def jobs(self) -> list[Job]:
        return [e for e in self.entries if not isinstance(e, FileResult)]


def _prepare(
    patches: list[Patch],
    target: Target,
    given: Mapping[str, str] | None = None,
) -> _Pending:
    mine = [p for p in patches if p.target == target.kind]
    texts: dict[str, str | None] = dict(given or {})
    problems: dict[str, str] = {}

    def read(rel: str) -> str | None:
        if rel not in texts:
            texts[rel] = None
            path = target.path_of(rel)  # named in messages; read through the tree's handle
            try:
                data = target.handle.read(target.rel(rel))
            except FileNotFoundError:
                return None
            except OSError as exc:
                problems[rel] = f"cannot read {path} ({exc.strerror})"
                texts[rel] = ""
                return ""
            try:
                # newline="" semantics: keep \r\n exactly as it is in the file.
                texts[rel] = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems[rel] = f"{path} is not UTF-8 (byte {exc.start}); restore it first"
                texts[rel] = ""
        return texts[rel]

    by_file: dict[str | None, list[Patch]] = {}
    for patch in mine:
        by_file.setdefault(patch.pick_file(read), []).append(patch)

    entries: list[FileResult | Job] = []
    for rel, group in by_file.items():
        if rel is None:
            entries.append(_missing(group))
        elif rel in problems:
            entries.append(_unreadable(group, rel, problems[rel], texts[rel] or ""))
        else:
            entries.append((group, rel, texts[rel] or ""))
    return _Pending(target, mine, entries)


def _finish(profile: Profile, pending: _Pending, done: list[FileResult]) -> TargetPlan:
    """The target's plan from its jobs' results (in `jobs()` order): imports checked against
    the release, outcomes judged by the profile and the facts."""
    results = iter(done)
    result = TargetPlan(pending.target)
    for entry in pending.entries:
        if isinstance(entry, FileResult):
            result.files.append(entry)
        else:
            result.files.append(_check_imports(pending.target, next(results)))
    by_id = {p.id: p for p in pending.mine}
    for file_result in result.files:
        file_result.outcomes = [
            _judge(profile, by_id[o.patch], pending.target, o) for o in file_result.outcomes
        ]
    return result


def _check_imports(target: Target, result: FileResult) -> FileResult:
    """Every name a patch imports from the target's own package must exist in this release.

    A patch sees one file; whether `sglang.srt.utils` defines `is_sm120_supported` (it does
    from 0.5.4 on) is only known here. An import that would fail at start-up refuses every
    patch of the file, nothing half-applied.
    """
    missing = [
        f"{module}.{name}"
        for module, name in sorted(result.imports_added())
        if (module == target.kind or module.startswith(target.kind + "."))
        and not _defines(target, module, name, depth=0)
    ]
    if not missing:
        return result
    refuse_all(
        result,
        f"expected {', '.join(missing)} to exist in {target.name} {target.version}; found no "
        "such name, so the import the patch adds would fail at start-up",
    )
    return result


def _defines(target: Target, module: str, name: str, depth: int) -> bool:
    """Whether `module` (of the target's package) binds `name`, following `import *`."""
    import ast
    import re

    base = "/".join(module.split("."))
    for file in (f"{base}.py", f"{base}/__init__.py"):
        try:  # through the tree's handle: no link followed, no FIFO waited on
            data = target.handle.read(target.rel(file))
        except (OSError, Refused):
            continue
        # Fast path: a top-level `def name(`, `class name` or `name = ...` outside a triple-quoted
        # string is a binding; anything else needs the tree (40 ms for sglang's utils/common.py).
        n = re.escape(name.encode())
        found = re.search(
            rb"^(?:(?:async\s+)?def\s+" + n + rb"\s*\(|class\s+" + n + rb"\b|"
            + n + rb"\s*(?::[^=\n]*)?=(?!=))",
            data,
            re.M,
        )
        if found and all(data.count(q, 0, found.start()) % 2 == 0 for q in (b'"""', b"'''")):
            return True
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        package = module if file.endswith("/__init__.py") else module.rpartition(".")[0]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == name:
                    return True
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return True
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return True
                    if alias.name == "*" and isinstance(node, ast.ImportFrom) and depth < 3:
                        source = _absolute(package, node)
                        if source and _defines(target, source, name, depth + 1):
                            return True
        return False
    return False


def _absolute(package: str, node: object) -> str | None:
    import ast

    assert isinstance(node, ast.ImportFrom)
    if node.level == 0:
        return node.module
    parts = package.split(".")
    if node.level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _missing(group: list[Patch]) -> FileResult:
    """Patches none of whose files exist, each naming its own files (they share this result)."""
    res = FileResult(file="", before="", after="")
    for p in group:
        names = ", ".join(p.files)
        res.outcomes.append(
            Outcome(
                p.id,
                p.target,
                None,
                "<file>",
                Status.NOT_APPLICABLE,
                f"none of its files exist ({names})",
            )
        )
    return res


def _unreadable(group: list[Patch], rel: str, problem: str, text: str) -> FileResult:
    res = FileResult(file=rel, before=text, after=text)
    for p in group:
        res.outcomes.append(Outcome(p.id, p.target, rel, "<file>", Status.REFUSED, problem))
    return res


def _judge(profile: Profile, patch: Patch, target: Target, outcome: Outcome) -> Outcome:
    """Apply what the profile and the patch's facts know about this release to a raw outcome."""
    from dataclasses import replace

    outcome = _with_note(patch, target, outcome)
    if outcome.status is Status.NOT_APPLICABLE and not profile.absent_ok(patch.id, target.version):
        return replace(
            outcome,
            status=Status.REFUSED,
            reason=f"{outcome.reason}, but profile {profile.name} expects this site in "
            f"{target.name} {target.version}",
        )
    if outcome.status is Status.ALREADY_APPLIED and patch.upstream_at(target.version):
        return replace(
            outcome,
            status=Status.UPSTREAM,
            reason=f"{target.name} {target.version} already enables SM120 here",
        )
    return outcome


def _with_note(patch: Patch, target: Target, outcome: Outcome) -> Outcome:
    """The patch's note for this release (its facts' `user_note`) on an outcome that changes
    or found the site."""
    from dataclasses import replace

    if outcome.status not in (Status.APPLIED, Status.ALREADY_APPLIED):
        return outcome
    note = patch.note_at(target.version)
    return replace(outcome, note=note) if note else outcome
