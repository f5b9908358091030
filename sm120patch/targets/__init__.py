"""What a target is (`Target`: an SGLang, FlashInfer or vLLM tree, its layout and version), and
whether a directory is a git checkout, and whose.

Finding a target is `finding.py` (`find`), its version `versions.py`. This package's init
imports none of its own modules (they import it): Python runs a package's init before any
module of it, so an init importing one of them would be an import circle. The read-only git
that deciding a checkout needs (is the package tracked, which commit is the patch branch's
base) is run here, as every git command is (`run_git`); the commands that write, and a
checkout's repository, are in git.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from sm120patch.errors import Refused
from sm120patch.handle import TreeHandle
from sm120patch.patchkit.kinds import DISPLAY as DISPLAY  # defined with the kinds, read here
from sm120patch.patchkit.kinds import DIST_NAMES as DIST_NAMES
from sm120patch.patchkit.kinds import TARGETS, Kind
from sm120patch.safeio import SAFE_CONFIG as SAFE_CONFIG  # git's rules, kept with its runner
from sm120patch.safeio import run_git as run_git  # the one git runner, called here by git.py
from sm120patch.safeio import user_name

KINDS = TARGETS  # the kinds, in the order targets are listed and handled


class Layout(str, Enum):
    """How a target is kept: a git checkout (git restores), or an installed package (pristine
    copies in the state directory restore)."""

    GIT = "git"
    INSTALLED = "installed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Target:
    kind: Kind
    package_dir: Path  # .../sglang
    parent: Path  # the directory holding the package: patch file paths are relative to it
    root: Path  # git work tree root for a git target, else `parent`; diff paths are relative to it
    layout: Layout
    version: str
    version_source: str
    handle: TreeHandle = field(compare=False, repr=False)  # the root, held open (handle.py)

    @property
    def name(self) -> str:
        return DISPLAY[self.kind]

    @property
    def at(self) -> str:
        """`SGLang at /root`: which target a line is about (two may share one root)."""
        return f"{self.name} at {self.root}"

    def path_of(self, file: str) -> Path:
        return self.parent / file

    def rel(self, file: str) -> str:
        """`file` (relative to the package parent) as a path relative to the target root."""
        return (self.parent / file).relative_to(self.root).as_posix()

    def to_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "root": str(self.root),
            "package": str(self.package_dir),
            "layout": self.layout,
            "version": self.version,
            "version_source": self.version_source,
        }


UNKNOWN = "unknown"  # the version of a target whose packaging says none


def state_hint(kind: str) -> str:
    """The one line saying how to state a target's version."""
    return f"state it with --{kind}-version VERSION"


# ---- is it a checkout, and whose --------------------------------------------------------------
def work_tree_of(path: Path) -> Path | None:
    """The nearest directory at or above `path` holding a `.git` (found without running git)."""
    for directory in (path, *path.parents):
        if os.path.lexists(directory / ".git"):
            return directory
    return None


def git_dir_of(root: Path) -> Path:
    """The git directory of a work tree: `.git`, or where a `.git` file points (worktrees)."""
    dot = root / ".git"
    if dot.is_file():
        text = dot.read_text(encoding="utf-8", errors="replace").strip()
        if text.startswith("gitdir:"):
            target = Path(text.split(":", 1)[1].strip())
            return target if target.is_absolute() else (root / target).resolve()
    return dot


def head_branch(root: Path) -> str | None:
    """The branch checked out in the work tree at `root` (None: detached or unreadable), read
    from its HEAD file without running git: `status` stays a process without git."""
    try:
        text = (git_dir_of(root) / "HEAD").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    prefix = "ref: refs/heads/"
    return text[len(prefix) :] if text.startswith(prefix) else None


def _owner(path: Path) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def checkout_root(package_dir: Path) -> Path | None:
    """The root of the git checkout `package_dir` is part of, or None: an installed package.

    A `.git` above the package makes it a checkout only when that repository is its owner's:
    one owned by another user than the package (root's `/` kept in git, a venv inside someone
    else's project) is not read at all, so no git command runs in it. A repository of the
    package's owner is refused when that owner is not the user running sm120patch
    (`check_owner`); then it is a checkout only when git tracks the package's `__init__.py`.
    """
    root = work_tree_of(package_dir)
    if root is None:
        return None
    mine = _owner(package_dir)
    if any(_owner(p) not in (None, mine) for p in (root, root / ".git")):
        return None
    check_owner(root)  # before any git command runs there
    return root if is_tracked(root, package_dir / "__init__.py") else None


def check_owner(root: Path) -> None:
    """Refuse a checkout owned by another user than the effective one: its hooks, filters
    and configuration would run as this user (root, under sudo). git's own `safe.directory`
    check lets root through under sudo; sm120patch does not."""
    uid = os.geteuid()
    for path in (root, root / ".git"):
        owner = _owner(path)
        if owner is not None and owner != uid:
            raise Refused(
                f"{root} is a git checkout owned by another user ({user_name(owner)}), not "
                f"by {user_name(uid)}, who runs sm120patch: its hooks and configuration are "
                "its owner's code, which sm120patch does not run",
                f"run sm120patch as {user_name(owner)} (`sudo -u {user_name(owner)} "
                "sm120patch ...`)",
            )


def git_out(root: Path, *args: str) -> str | None:
    """A read-only git command's output, or None when it fails."""
    proc = run_git(root, *args)
    return proc.stdout.decode("utf-8", "replace").strip() if proc.returncode == 0 else None


def is_tracked(root: Path, path: Path) -> bool:
    """Whether git tracks `path`; refuses a repository git itself will not work in, rather
    than silently treating the checkout as an installed package."""
    proc = run_git(root, "ls-files", "--error-unmatch", "--", str(path.relative_to(root)))
    if proc.returncode == 0:
        return True
    stderr = proc.stderr.decode("utf-8", "replace")
    if "dubious ownership" in stderr:
        raise Refused(
            f"git refuses to work in {root}: it is owned by another user",
            "run sm120patch as the checkout's owner",
        )
    if "not a git repository" in stderr:
        raise Refused(
            f"{root}/.git is not a usable git repository",
            "repair or remove it, then run sm120patch again",
        )
    return False



# ---- the patch branch's base ------------------------------------------------------------------
PATCH_TRAILER = "Sm120patch-Patch:"  # every commit sm120patch makes carries it
PATCH_BRANCH_PREFIX = "sm120patch/"  # the branches sm120patch commits on

def patch_base(root: Path) -> str | None:
    """The commit a checkout's version is read at: HEAD, or, on sm120patch's patch branch (or
    a detached HEAD), the commit below sm120patch's own commits (commits of the user's on top of
    them are drift, which `status` reports, not another release). `HEAD` where the branch is
    another (no git command for it)."""
    branch = head_branch(root)
    if branch is not None and not branch.startswith(PATCH_BRANCH_PREFIX):
        return "HEAD"
    out = git_out(root, "log", "--first-parent", "-n", "256", "--format=%H%x00%B%x01", "HEAD")
    chain = [e.strip().partition("\x00") for e in (out or "").split("\x01") if e.strip()]
    ours = [i for i, (_, _, body) in enumerate(chain) if PATCH_TRAILER in body]
    below = ours[-1] + 1 if ours else 0
    return chain[below][0] if below < len(chain) else None
