"""A content-addressed cache of target plans, so the commands that run most often need no parse.

A plan of one target depends only on bytes: the files its patches may touch, the files whose
names the patches import from the target's own package (checked by the planner), the target's
version, and all the code that can change a plan: sm120patch, the built-in patch library and
every pack loaded (each of its modules and data files). The key hashes the first and the
last; the value records the second (each file's sha256) and is used only when they still
match. So `apply` after a reviewed `--dry-run` on the same bytes, and `ensure` at every service
start, never import libcst.

An entry is a second source of the bytes an apply writes, so the cache is trusted only as far
as who may write it: a directory of the effective user's own (owned by them, writable by no
one else, nor any directory above it; entries 0600 and theirs). Any other (a shared
`SM120PATCH_CACHE`, a user's cache directory when root runs with that user's HOME) is
ignored with one warning, and every plan is made afresh.

Entries live in `$SM120PATCH_CACHE/plans/` (default: the user cache directory), compressed JSON,
written atomically; a corrupt or unreadable entry is ignored (and planned afresh), never an
error. `SM120PATCH_PLAN_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch import __version__
from sm120patch.patchkit.model import Outcome, Status
from sm120patch.patchkit.runner import FileResult, TextFileResult

if TYPE_CHECKING:
    from sm120patch.plan.catalog import Profile
    from sm120patch.plan.plans import TargetPlan
    from sm120patch.targets import Target

ENV = "SM120PATCH_PLAN_CACHE"
FORMAT = 2  # 2: each file keeps the imports its patches added


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "", "off", "no")


def _stderr(text: str) -> None:
    import sys

    print(f"sm120patch: warning: {text}", file=sys.stderr)


# How a warning reaches the user (the command layer may point it elsewhere).
warn: Callable[[str], None] = _stderr
_judged: dict[str, Path | None] = {}


def cache_dir() -> Path | None:
    """The plan cache's directory, made (0700) where missing; None when it is not the
    effective user's own (warned once): then nothing is read from it or written to it."""
    base = os.environ.get("SM120PATCH_CACHE")
    if base:
        plans = Path(base).absolute() / "plans"
    else:
        import platformdirs

        plans = Path(platformdirs.user_cache_dir("sm120patch")) / "plans"
    key = str(plans)
    if key not in _judged:
        _judged[key] = _own(plans)
    return _judged[key]


def _own(plans: Path) -> Path | None:
    from sm120patch.targets.files import owner_name, untrusted_by

    uid = os.geteuid()
    problem = untrusted_by(plans, uid, owner_only=True)
    if problem is None and not plans.is_dir():
        try:
            plans.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None  # nowhere to keep plans: plan every time, as with the cache off
        problem = untrusted_by(plans, uid, owner_only=True)
    if problem is None:
        return plans
    warn(
        f"ignoring the plan cache {plans}: {problem}; a cache must be {owner_name(uid)}'s "
        "own (owned by them, writable by no one else), so every plan is made afresh"
    )
    return None


def _own_file(fd: int) -> bool:
    """An entry this user wrote and no one else may write."""
    st = os.fstat(fd)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def has(entry: str) -> bool:
    """Whether an entry is there to be read (it may still turn out stale or not this user's)."""
    directory = cache_dir() if enabled() else None
    return directory is not None and (directory / f"{entry}.json.z").is_file()


def read_entry(path: Path) -> bytes | None:
    """The bytes of a cache file, None unless it is a regular file of this user's alone."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not _own_file(fd):
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


@lru_cache(maxsize=1)
def code_digest() -> str:
    """The planner's and the patch library's code (every module and data file): any edit to
    either makes every entry a miss. Conservative on purpose: a stale plan is never used."""
    import sm120patch
    from sm120patch import patches  # type: ignore[attr-defined]  # shipped from patches/ (package-dir)

    h = hashlib.sha256(__version__.encode())
    for package in (sm120patch, patches):
        root = Path(next(iter(package.__path__)))
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".toml") and "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode() + b"\0")
                h.update(path.read_bytes())
    return h.hexdigest()


def code_key() -> str:
    """`code_digest` and the code of every pack loaded now (each module and data file of
    each): an edited pack makes every entry a miss, as an edited built-in patch does."""
    from sm120patch.plan import catalog

    packs = catalog.load().packs
    if not packs:
        return code_digest()
    return _with_packs(code_digest(), tuple((p.name, p.location, p.module_file) for p in packs))


@lru_cache(maxsize=8)
def _with_packs(base: str, packs: tuple[tuple[str, str, str], ...]) -> str:
    from sm120patch.plan.catalog import Pack

    h = hashlib.sha256(base.encode())
    for name, location, module_file in packs:
        h.update(f"\0{name}\0".encode())
        for path in Pack(name, location, module_file).code_files():
            h.update(f"{path}\0".encode())
            try:
                h.update(path.read_bytes())
            except OSError:
                h.update(b"\0unreadable")
    return h.hexdigest()


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def key(profile: Profile, patch_files: list[str], target: Target) -> str | None:
    """The entry of `profile` on `target`, from the bytes of every file its patches may touch;
    None (plan, never cache) when one of them is there but is not a regular file: the planner
    refuses that with its own words."""
    h = hashlib.sha256(f"{FORMAT}\0{code_key()}\0{profile.name}\0".encode())
    h.update(f"{target.kind}\0{target.version}\0".encode())
    for rel in sorted(set(patch_files)):
        path = target.path_of(rel)
        digest = _sha(path)
        if digest is None and os.path.lexists(path):
            return None
        h.update(f"{rel}\0{digest}\0".encode())
    return h.hexdigest()


def load(entry: str, target: Target) -> list[FileResult] | None:
    """The file results of the entry's plan, or None (plan afresh)."""
    if not enabled():
        return None
    directory = cache_dir()
    raw = None if directory is None else read_entry(directory / f"{entry}.json.z")
    if raw is None:
        return None
    try:
        doc = json.loads(zlib.decompress(raw))
        if doc.get("format") != FORMAT:
            return None
        for rel, sha in doc["deps"].items():
            if _sha(target.parent / rel) != sha:
                return None  # a file the plan read has changed: plan afresh
        files: list[FileResult] = []
        names = {f.name for f in fields(Outcome)}
        for f in doc["files"]:
            before = "" if not f["file"] else (target.path_of(f["file"]).read_bytes().decode())
            result = TextFileResult(
                file=f["file"],
                before=before,
                after=f["after"],
                texts=[(pid, f["after"] if text is None else text) for pid, text in f["steps"]],
                added=frozenset((module, name) for module, name in f["added"]),
            )
            result.outcomes = [
                Outcome(**{**{k: v for k, v in o.items() if k in names},
                           "status": Status(o["status"])})  # fmt: skip
                for o in f["outcomes"]
            ]
            if f["before_sha"] != hashlib.sha256(before.encode()).hexdigest():
                return None
            files.append(result)
        return files
    except (OSError, ValueError, KeyError, TypeError, zlib.error, UnicodeDecodeError):
        return None  # missing, corrupt, or from another format: plan afresh


def store(entry: str, plan: TargetPlan, deps: list[str]) -> None:
    """Keep `plan` under `entry`; `deps` are the other files (relative to the package's
    parent) whose bytes the plan depends on. Never fails the command."""
    if not enabled():
        return
    directory = cache_dir()
    if directory is None:
        return
    target = plan.target
    files = []
    for f in plan.files:
        steps = f.step_texts()
        files.append(
            {
                "file": f.file,
                "before_sha": hashlib.sha256(f.before.encode()).hexdigest(),
                "after": f.after,
                # The last step's text is `after`: not written twice.
                "steps": [[pid, None if i == len(steps) - 1 else text]
                          for i, (pid, text) in enumerate(steps)],  # fmt: skip
                "outcomes": [o.to_dict() for o in f.outcomes],
                "added": sorted(f.imports_added()),
            }
        )
    doc = {
        "format": FORMAT,
        "files": files,
        "deps": {rel: _sha(target.parent / rel) for rel in sorted(set(deps))},
    }
    data = zlib.compress(json.dumps(doc).encode("utf-8"), 6)
    try:
        from sm120patch.targets.files import atomic_write

        atomic_write(directory / f"{entry}.json.z", data, durable=False)  # 0600, this user's
    except OSError:
        pass


def import_deps(target: Target, plan: TargetPlan) -> list[str]:
    """The files the planner's import check read for `plan`: for every module of the target's
    own package that a patch imports, the `.py` files of that package and of its parent (star
    imports are followed among siblings). Over-approximated on purpose."""
    out: set[str] = set()
    for f in plan.files:
        if not f.changed:
            continue
        for module, _ in f.imports_added():
            if module != target.kind and not module.startswith(target.kind + "."):
                continue
            base = target.parent.joinpath(*module.split("."))
            for directory in (base, base.parent):
                if directory.is_dir():
                    out.update(
                        p.relative_to(target.parent).as_posix() for p in directory.glob("*.py")
                    )
    return sorted(out)
