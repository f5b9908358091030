"""Lock files (`sm120patch.lock`): freeze, for one deployment, the SGLang and FlashInfer versions,
the profile, its patches, each touched file's hash before and after and each patch's step (its
after-hash and the diff a reviewer read), so that `apply --locked` on another machine
reproduces exactly those bytes, or refuses saying what differs.

File paths in a lock are module paths (`sglang/srt/server_args.py`), so a lock made on a git
checkout applies to an installed package of the same release and the other way round.

A lock is a claim to verify, never a source of bytes: `apply --locked` plans with the patches
loaded here, and goes on only when that plan is the lock, file for file (each before- and
after-hash) and step for step (each step's after-hash and diff text). The bytes are what a
lock pins: patch code that changed and still writes the same bytes applies the same lock. A
lock naming a file that no patch of its profile touches is refused; one naming a path that is
no plain relative path is a usage error.

Schema 1 (sm120patch 0.2.x) also recorded a digest of each patch's code (`digest`, `source`);
such a lock still applies: those two fields are kept as read, so that it writes back to the
same bytes, and never compared.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sm120patch import __version__
from sm120patch.errors import Refused, UsageError
from sm120patch.patchkit.kinds import TARGETS
from sm120patch.plan.profiles import BUILT_IN, TOMLDecodeError, parse_toml

if TYPE_CHECKING:  # a lock is read at every `ensure --locked`: no plan module for that
    from sm120patch.plan.plans import Plan

SCHEMA = 2  # 2: no patch code digests (schema 1, 0.2.x, had them: still read)
# What a schema 1 lock says of a patch's code, kept as read, never compared (the module's doc).
_LEGACY_KEYS = ("digest", "source")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A profile name a hint may paste (`catalog` holds profiles to names of this shape).
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_PROFILE_LINE = re.compile(r'^profile = "([A-Za-z0-9][A-Za-z0-9_.-]*)"$', re.MULTILINE)


@dataclass(frozen=True)
class LockedFile:
    """A file the lock pins: its hash before the profile is applied and after."""

    target: str  # the target kind
    path: str  # module path (`sglang/srt/server_args.py`)
    before: str  # sha256 hex
    after: str


@dataclass(frozen=True)
class LockedStep:
    """One patch's step on one file, as a reviewer read it."""

    target: str
    path: str
    patch: str  # the patch id
    after: str  # sha256 hex of the text after this step
    diff: str  # from the text before this step to `after`'s


# The order of a table's keys is the order of its record's fields: `to_toml` writes them so,
# and the bytes of a lock (its digest, a reviewer's diff of two locks) depend on it.
_FILE_KEYS = tuple(f.name for f in fields(LockedFile))
_STEP_KEYS = tuple(f.name for f in fields(LockedStep))
_HASH_KEYS = ("before", "after")


class PlanCheck(Protocol):
    """What `check` returns: refuses a plan that is not the lock's; `skip` names the target
    kinds already applied exactly as the lock says."""

    def __call__(self, plan: Plan, skip: frozenset[str] = ...) -> None: ...


@dataclass
class Lock:
    profile: str
    versions: dict[str, str]
    patches: list[str]  # the profile's patch ids, in its order
    files: list[LockedFile] = field(default_factory=list)
    tool_version: str = __version__
    # The reviewed result, step by step: a node whose files have the locked before-hashes
    # writes exactly these bytes.
    steps: list[LockedStep] = field(default_factory=list)
    # id -> the pack it came from ("built-in", "entry point X", "directory /p"); pack -> its
    # digest (catalog.Pack.digest), recorded to say which version of a pack made the lock.
    # A lock without them (written before packs) reads as all built-in.
    pack_of: dict[str, str] = field(default_factory=dict)
    packs: dict[str, str] = field(default_factory=dict)
    schema: int = SCHEMA
    # id -> a schema 1 lock's `digest` and `source` of that patch, written back as read.
    legacy: dict[str, dict[str, str]] = field(default_factory=dict)
    # The file it was read from (hints name it); not part of what the lock pins.
    path: Path | None = field(default=None, compare=False)

    def digest(self) -> str:
        """What the lock pins, as one digest (recorded in the manifest of an `--locked` apply)."""
        return "sha256:" + hashlib.sha256(self.to_toml().encode("utf-8")).hexdigest()

    def to_toml(self) -> str:
        q = json.dumps  # a TOML basic string is a JSON string for the text we write
        out = [
            "# sm120patch lock file: `sm120patch apply --locked <this file>` reproduces exactly",
            "# this patch set, or refuses (changing nothing) when anything below differs.",
            f"schema = {self.schema}",
            f"tool_version = {q(self.tool_version)}",
            f"profile = {q(self.profile)}",
            "",
            "[versions]",
            *(f"{kind} = {q(v)}" for kind, v in sorted(self.versions.items())),
        ]
        for pid in self.patches:
            old = self.legacy.get(pid, {})
            out += ["", "[[patches]]", f"id = {q(pid)}"]
            out += [f"digest = {q(old['digest'])}"] if "digest" in old else []
            out.append(f"pack = {q(self.pack_of.get(pid, BUILT_IN))}")
            out += [f"source = {q(old['source'])}"] if "source" in old else []
        for name, digest in self.packs.items():
            out += ["", "[[packs]]", f"name = {q(name)}", f"digest = {q(digest)}"]
        for f in self.files:
            out += [
                "",
                "[[files]]",
                *(f"{k} = {q(getattr(f, k))}" for k in _FILE_KEYS),
            ]
        for s in self.steps:
            out += [
                "",
                "[[steps]]",
                *(f"{k} = {q(getattr(s, k))}" for k in _STEP_KEYS),
            ]
        return "\n".join(out) + "\n"


def from_plan(plan: Plan, *, steps: bool = True) -> Lock:
    """The lock of `plan`; `steps=False` leaves out the reviewed diffs (making them is difflib
    over each whole file: `differences` checks a lock's diffs by applying them instead)."""
    files = [
        LockedFile(tp.target.kind, f.file, _sha(f.before), _sha(f.after))
        for tp in plan.targets
        for f in tp.changed
    ]
    from sm120patch.plan.diffs import diff_texts

    reviewed = [
        replace(step, diff=diff_texts(step.path, before, after))
        for step, before, after in (_planned_steps(plan) if steps else ())
    ]
    # A lock made here (not read from a file) names the packs of the plan's catalog (the
    # command's); `read` passes what the file says.
    cat = plan.catalog
    return Lock(
        profile=plan.profile.name,
        versions={tp.target.kind: tp.target.version for tp in plan.targets},
        patches=list(plan.profile.patches),
        pack_of={pid: cat.source(pid).name for pid in plan.profile.patches},
        packs={p.name: p.digest() for p in cat.packs_of(plan.profile)},
        files=files,
        steps=reviewed,
    )


def _planned_steps(plan: Plan) -> list[tuple[LockedStep, str, str]]:
    """Each patch's step of `plan` on each file, as a lock records it but with no diff yet,
    with the file's text before and after the step."""
    out = []
    for tp in plan.targets:
        for f in tp.changed:
            before = f.before
            for pid, text in f.step_texts():
                out.append((LockedStep(tp.target.kind, f.file, pid, _sha(text), ""), before, text))
                before = text
    return out


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read(path: Path) -> Lock:
    """The lock file at `path`, a file the user named: read by `safeio.read_named` (no link
    followed at its name, no FIFO waited on, at most `safeio.LOCK_LIMIT` bytes), parsed, and
    each thing wrong with it said in one line in the lock's own terms."""
    from sm120patch import safeio

    raw = safeio.read_named(path, "lock file", limit=safeio.LOCK_LIMIT)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(
            f"lock file {path} is not UTF-8 text (byte {exc.start})", remake_hint(path)
        ) from None
    lock = _parse(path, text)
    _check_paths(path, lock)
    return lock


def remake_hint(path: Path, profile: str | None = None) -> str:
    """What to do about a lock that cannot be used: make it again where it was made (a
    command that pastes when the profile is known; a pattern to fill in when it is not)."""
    import os
    import shlex

    # --force: pin replaces an existing lock only with it (the broken one is there).
    out = shlex.quote(os.path.abspath(path)) + " --force"
    if profile and _PROFILE_NAME.fullmatch(profile):
        return f"on the box it was made on, make it again: `sm120patch pin {profile} -o {out}`"
    return f"on the box it was made on, make it again: `sm120patch pin PROFILE -o {out}`"


def _entries(lock: Lock) -> list[LockedFile | LockedStep]:
    return [*lock.files, *lock.steps]


def _check_paths(path: Path, lock: Lock) -> None:
    """Every file a lock names is a plain relative path of a target kind (else exit 2)."""
    from pathlib import PurePosixPath

    for entry in _entries(lock):
        rel, kind = entry.path, entry.target
        p = PurePosixPath(rel)
        if (
            kind not in TARGETS
            or not rel
            or "\0" in rel
            or "\\" in rel
            or p.is_absolute()
            or ".." in p.parts
            or p.parts[0] != kind
        ):
            raise UsageError(
                f"lock file {path} names {kind} {rel!r}, which is not a path inside a "
                f"{kind} package",
                remake_hint(path, lock.profile),
            )
    values = [*lock.versions.values(), *lock.patches]
    if not all(isinstance(v, str) and v for v in values):
        raise UsageError(
            f"lock file {path}: versions or patches hold a value that is not a string",
            remake_hint(path, lock.profile),
        )


def check_files_of_profile(lock: Lock, plan: Plan, path: Path) -> None:
    """A lock may name only files that a patch of its plan's profile touches."""
    profile = plan.profile
    allowed = {(p.target, f) for p in plan.catalog.patches_of(profile) for f in p.files}
    for entry in _entries(lock):
        if (entry.target, entry.path) not in allowed:
            raise Refused(
                f"{path} names {entry.target} {entry.path}, which no patch of profile "
                f"{profile.name} touches; nothing was changed",
                "use the lock `sm120patch pin` wrote, or make a new one",
            )
    known = {pid for pid in profile.patches}
    for entry in lock.steps:
        if entry.patch not in known:
            raise Refused(
                f"{path} has a step of patch {entry.patch}, which is not in profile "
                f"{profile.name}; nothing was changed",
                "use the lock `sm120patch pin` wrote, or make a new one",
            )


class _Bad(ValueError):
    """What is wrong with a lock's document, in the lock's own terms."""


def _parse(path: Path, raw: str) -> Lock:
    if not raw.strip():
        raise Refused(f"lock file {path} is empty", remake_hint(path))
    try:
        doc: dict[str, Any] = parse_toml(raw)
    except TOMLDecodeError as exc:
        # tomllib says where (line, column) and what it expected, never the text itself. A
        # truncated lock still has its profile line (the third `pin` writes): the hint names it.
        line = _PROFILE_LINE.search(raw)
        raise Refused(
            f"lock file {path} is not TOML: {exc} (truncated or edited?)",
            remake_hint(path, line.group(1) if line else None),
        ) from None
    except RecursionError:
        raise Refused(
            f"lock file {path} nests tables or arrays too deep to be a lock", remake_hint(path)
        ) from None
    profile = doc.get("profile")
    try:
        return _document(path, doc)
    except (_Bad, KeyError, TypeError, AttributeError, ValueError) as exc:
        why = str(exc) if isinstance(exc, _Bad) else "a key holds a value of the wrong kind"
        raise Refused(
            f"lock file {path} is not a lock sm120patch pin wrote: {why}",
            remake_hint(path, profile if isinstance(profile, str) else None),
        ) from None


_KIND_WORDS = {int: "a number", str: "a string", dict: "a table"}


def _document(path: Path, doc: dict[str, Any]) -> Lock:
    for key, kind in (("schema", int), ("profile", str), ("versions", dict)):
        if key not in doc:
            raise _Bad(f"it has no `{key}`")
        if not isinstance(doc[key], kind) or isinstance(doc[key], bool):
            raise _Bad(f"its `{key}` is not {_KIND_WORDS[kind]}")
    schema = doc["schema"]
    if schema > SCHEMA:
        raise Refused(
            f"lock file {path} has schema {schema}; this sm120patch reads up to {SCHEMA}",
            "use the sm120patch version that wrote it",
        )
    patches = _tables(doc, "patches")
    for n, p in enumerate(patches, 1):
        if not isinstance(p, dict) or not isinstance(p.get("id"), str):
            raise _Bad(f"[[patches]] entry {n} has no `id` string")
    packs = _tables(doc, "packs")
    for n, p in enumerate(packs, 1):
        if not (isinstance(p, dict) and all(isinstance(p.get(k), str) for k in ("name", "digest"))):
            raise _Bad(f"[[packs]] entry {n} has no `name` and `digest` strings")
    return Lock(
        path=path,
        schema=schema,
        profile=doc["profile"],
        versions={str(k): str(v) for k, v in doc["versions"].items()},
        patches=[str(p["id"]) for p in patches],
        pack_of={str(p["id"]): str(p.get("pack", BUILT_IN)) for p in patches},
        packs={str(p["name"]): str(p["digest"]) for p in packs},
        legacy={
            str(p["id"]): {k: str(p[k]) for k in _LEGACY_KEYS if k in p}
            for p in patches
            if schema < 2 and any(k in p for k in _LEGACY_KEYS)
        },
        files=[
            LockedFile(**_entry(f, "files", i, _FILE_KEYS))
            for i, f in enumerate(_tables(doc, "files"), 1)
        ],
        tool_version=str(doc.get("tool_version", "")),
        steps=[
            LockedStep(**_entry(s, "steps", i, _STEP_KEYS))
            for i, s in enumerate(_tables(doc, "steps"), 1)
        ],
    )


def _tables(doc: dict[str, Any], name: str) -> list[Any]:
    found = doc.get(name, [])
    if not isinstance(found, list):
        raise _Bad(f"`{name}` is not an array of tables ([[{name}]])")
    return found


def _entry(table: object, name: str, n: int, keys: tuple[str, ...]) -> dict[str, str]:
    """The values of one [[files]] or [[steps]] table, each a string (a hash one a sha256):
    a number or a table where a path or a diff belongs is a lock no `pin` wrote."""
    if not isinstance(table, dict):
        raise _Bad(f"[[{name}]] entry {n} is not a table")
    out = {}
    for key in keys:
        if key not in table:
            raise _Bad(f"[[{name}]] entry {n} has no `{key}`")
        value = table[key]
        if not isinstance(value, str):
            raise _Bad(f"[[{name}]] entry {n}: `{key}` is not a string")
        if key in _HASH_KEYS and not _SHA256.fullmatch(value):
            raise _Bad(f"[[{name}]] entry {n}: `{key}` is not a sha256")
        out[key] = value
    return out


def differences(lock: Lock, plan: Plan, skip: frozenset[str] = frozenset()) -> list[str]:
    """Everything in which `plan` (on pristine trees) differs from `lock`; empty when identical:
    the profile, versions, packs, the patches, each file's before- and after-hash, and (when
    the lock records them) each step's after-hash and diff text.

    `skip`: target kinds already applied exactly as the lock says (checked from their bytes).
    """
    now = from_plan(plan, steps=False)
    if skip:
        lock = replace(
            lock,
            versions={k: v for k, v in lock.versions.items() if k not in skip},
            files=[f for f in lock.files if f.target not in skip],
        )
        now.versions = {k: v for k, v in now.versions.items() if k not in skip}
        now.files = [f for f in now.files if f.target not in skip]
    problems = []
    profile = now.profile
    if lock.profile != profile:
        problems.append(f"profile: lock has {lock.profile}, asked for {profile}")
    for kind in sorted(set(lock.versions) | set(now.versions)):
        a, b = lock.versions.get(kind), now.versions.get(kind)
        if a is not None and b is None:
            # Not a version found: the profile as it is here does not patch that target.
            problems.append(
                f"the lock pins {kind} {a}, but profile {profile} here patches no "
                f"{kind} (the profile changed since the lock was made?)"
            )
        elif a is None and b is not None:
            problems.append(
                f"profile {profile} here patches {kind} {b}, which the lock does not pin"
            )
        elif a != b:
            problems.append(f"{kind} version: lock has {a}, found {b}")
    for pid in sorted(set(lock.pack_of) & set(now.pack_of)):
        a, b = lock.pack_of[pid], now.pack_of[pid]
        if a != b:
            problems.append(f"patch {pid}: lock has it from {a}, here it comes from {b}")
    known = set(plan.catalog.patches)
    for pid in sorted(set(lock.patches) ^ set(now.patches)):
        if pid in now.patches:
            problems.append(f"patch {pid}: in profile {profile} here, not in the lock")
        elif pid in known:
            problems.append(f"patch {pid}: in the lock, not in profile {profile} here")
        else:
            problems.append(f"patch {pid}: in the lock, unknown to this sm120patch and its packs")
    locked = {(f.target, f.path): f for f in lock.files}
    found = {(f.target, f.path): f for f in now.files}
    for key in sorted(set(locked) | set(found)):
        mine, theirs = locked.get(key), found.get(key)
        where = f"{key[0]} {key[1]}"
        if mine is None:
            problems.append(f"{where}: would be patched but is not in the lock")
        elif theirs is None:
            problems.append(f"{where}: in the lock but would not be patched here")
        elif mine.before != theirs.before:
            problems.append(
                f"{where}: file differs from the locked original "
                f"({_short(mine.before)} locked, {_short(theirs.before)} here)"
            )
        elif mine.after != theirs.after:
            problems.append(f"{where}: patched text would differ from the locked result")
    if lock.steps and not problems:
        problems += _step_differences(lock, plan, skip)
    return problems


def _step_differences(lock: Lock, plan: Plan, skip: frozenset[str]) -> list[str]:
    """What was reviewed is what is written: each step of the lock is this plan's, with the
    same after-hash, and the lock's diff of it, applied to the text before the step, gives
    exactly the text this plan writes (so every byte the step writes is a line the reviewer
    read). Applying the diff is linear; making ours to compare texts would be difflib over
    each whole file."""
    locked = [s for s in lock.steps if s.target not in skip]
    found = [step for step in _planned_steps(plan) if step[0].target not in skip]
    if [_step_of(s) for s in locked] != [_step_of(s) for s, _, _ in found]:
        return ["steps: the lock's patch steps are not the ones these patches make here"]
    problems = []
    for a, (b, before, after) in zip(locked, found, strict=True):
        where = f"{a.target} {a.path} ({a.patch})"
        if a.after != b.after:
            problems.append(f"{where}: the step's result differs from the locked one")
        elif not _diff_shows(a.diff, a.path, before, after):
            problems.append(f"{where}: the lock's diff is not the change these patches make")
    return problems


def _diff_shows(diff: str, path: str, before: str, after: str) -> bool:
    """Whether `diff` is a diff of `path` (the header `diffs.diff_texts` writes, nothing else
    before the first hunk) that turns `before` into exactly `after`."""
    from sm120patch.plan.diffs import apply_diff, diff_header

    if before == after:
        return diff == ""
    return diff.startswith(diff_header(path) + "@@ ") and apply_diff(before, diff) == after


def _step_of(s: LockedStep) -> tuple[str, str, str]:
    return s.target, s.path, s.patch


def _short(digest: str | None) -> str:
    if digest is None:
        return "none"
    return digest.removeprefix("sha256:")[:12]


def check(lock: Lock, path: Path) -> PlanCheck:
    """A plan check for `engine.apply`: refuse, naming each difference, unless identical.

    The check is called with the kinds of the targets already applied as the lock says."""

    def verify(plan: Plan, skip: frozenset[str] = frozenset()) -> None:
        check_files_of_profile(lock, plan, path)
        problems = differences(lock, plan, skip)
        if problems:
            hint = "use the releases the lock was made on, or make a new lock"
            if lock.schema < SCHEMA:
                # Its patches may have written other bytes than this release's do.
                hint = (
                    f"it was written by sm120patch {lock.tool_version or '0.2 or older'}: pin "
                    f"again with this one (`sm120patch pin {lock.profile}`)"
                )
            raise Refused(
                f"{path} does not match these trees: " + "; ".join(problems),
                "nothing was changed; " + hint,
            )

    return verify
