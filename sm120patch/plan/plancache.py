"""A content-addressed cache of target plans, so the commands that run most often need no parse.

A plan of one target depends only on bytes: the files its patches may touch, the files whose
names the patches import from the target's own package (checked by the planner), the target's
version, and the code of the planner and the patch library. The key hashes the first and the
last; the value records the second (each file's sha256) and is used only when they still
match. So `apply` after a reviewed `--dry-run` on the same bytes, and `ensure` at every service
start, never import libcst.

Entries live in `$SM120PATCH_CACHE/plans/` (default: the user cache directory), compressed JSON,
written atomically; a corrupt or unreadable entry is ignored (and planned afresh), never an
error. `SM120PATCH_PLAN_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch import __version__
from sm120patch.patchkit.model import Outcome, Status
from sm120patch.patchkit.runner import FileResult

if TYPE_CHECKING:
    from sm120patch.plan.catalog import Profile
    from sm120patch.plan.plans import TargetPlan
    from sm120patch.targets import Target

ENV = "SM120PATCH_PLAN_CACHE"
FORMAT = 1


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "", "off", "no")


def cache_dir() -> Path:
    base = os.environ.get("SM120PATCH_CACHE")
    if base:
        return Path(base).absolute() / "plans"
    import platformdirs

    return Path(platformdirs.user_cache_dir("sm120patch")) / "plans"


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


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def key(profile: Profile, patch_files: list[str], target: Target) -> str | None:
    """The entry of `profile` on `target`, from the bytes of every file its patches may touch;
    None (plan, never cache) when one of them is there but is not a regular file: the planner
    refuses that with its own words."""
    h = hashlib.sha256(f"{FORMAT}\0{code_digest()}\0{profile.name}\0".encode())
    h.update(f"{target.kind}\0{target.version}\0".encode())
    for rel in sorted(set(patch_files)):
        path = target.path_of(rel)
        digest = _sha(path)
        if digest is None and os.path.lexists(path):
            return None
        h.update(f"{rel}\0{digest}\0".encode())
    return h.hexdigest()


class CachedFileResult(FileResult):
    """A FileResult read back from the cache: the texts of every step, no trees."""

    texts: list[tuple[str, str]]

    def step_texts(self) -> list[tuple[str, str]]:
        return list(self.texts)


def load(entry: str, target: Target) -> list[FileResult] | None:
    """The file results of the entry's plan, or None (plan afresh)."""
    if not enabled():
        return None
    try:
        doc = json.loads(zlib.decompress((cache_dir() / f"{entry}.json.z").read_bytes()))
        if doc.get("format") != FORMAT:
            return None
        for rel, sha in doc["deps"].items():
            if _sha(target.parent / rel) != sha:
                return None  # a file the plan read has changed: plan afresh
        files: list[FileResult] = []
        names = {f.name for f in fields(Outcome)}
        for f in doc["files"]:
            before = "" if not f["file"] else (target.path_of(f["file"]).read_bytes().decode())
            result = CachedFileResult(file=f["file"], before=before, after=f["after"])
            result.texts = [(pid, f["after"] if text is None else text) for pid, text in f["steps"]]
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

        atomic_write(cache_dir() / f"{entry}.json.z", data, durable=False)
    except OSError:
        pass


def import_deps(target: Target, plan: TargetPlan) -> list[str]:
    """The files the planner's import check read for `plan`: for every module of the target's
    own package that a patch imports, the `.py` files of that package and of its parent (star
    imports are followed among siblings). Over-approximated on purpose."""
    from sm120patch.patchkit import syntax

    out: set[str] = set()
    for f in plan.files:
        if not f.changed or not f.steps:
            continue
        added = syntax.imported_from(f.steps[-1][1]) - syntax.imported_from(f.tree)
        for module, _ in added:
            if module != target.kind and not module.startswith(target.kind + "."):
                continue
            base = target.parent.joinpath(*module.split("."))
            for directory in (base, base.parent):
                if directory.is_dir():
                    out.update(
                        p.relative_to(target.parent).as_posix() for p in directory.glob("*.py")
                    )
    return sorted(out)
