"""Everything that touches git. The one place branches are made; the only module importing git.

GitPython is imported lazily so commands that never touch git start fast.
"""

from __future__ import annotations

from pathlib import Path


def work_tree_of(path: Path) -> Path | None:
    """The root of the git work tree that tracks `path`, or None (found without running git)."""
    for directory in (path, *path.parents):
        if (directory / ".git").exists():
            return directory
    return None


def describe_version(root: Path) -> str | None:
    from sm120patch.targets import version_from_describe

    try:
        import git

        described = git.Repo(root).git.describe("--tags", "--match", "v*")
    except Exception:  # no tags, no git binary, odd repository: the caller reports "unknown"
        return None
    return version_from_describe(described)
