"""Finding a target: the package in a path the user names (or the one this Python imports),
walked without following a link, its layout and its version (`versions.py`), into a `Target`
holding the tree open (`handle.TreeHandle`). Nothing of the target is imported or run."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

from sm120patch.errors import Refused, UsageError
from sm120patch.handle import TreeHandle, first_link
from sm120patch.patchkit.kinds import Kind
from sm120patch.targets import DISPLAY, Layout, Target, checkout_root, versions


def find(kind: str, path: str | Path | None, stated: str | None = None) -> Target:
    """The target of `kind` at `path` (checkout root, package parent, site-packages or the
    package itself), or the one installed in this interpreter when `path` is None; `stated`,
    the version the command line gives it (`config.Config.stated`), else what it reads."""
    name = DISPLAY[kind]
    if path is None:
        spec = importlib.util.find_spec(kind)
        if spec is None or not spec.submodule_search_locations:
            raise Refused(
                f"{name} is not installed in this Python ({_python()})",
                f"pass --{kind} PATH to point at a {name} checkout or site-packages",
            )
        # This interpreter's own environment, named by no one: its sys.path is as trusted as
        # the code running now (a venv's lib64 link is its installer's), so it is resolved
        # once; the handle holds the real path. A named path is never resolved (`_package_in`).
        package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    else:
        package_dir = _package_in(kind, Path(path))
    return _describe(kind, package_dir, stated)


def find_quiet(
    kind: str, path: str | Path | None, *, required: bool, stated: str | None = None
) -> Target | None:
    """`find`, or None when `kind` is not there and the user did not ask for it by path."""
    try:
        return find(kind, path, stated)
    except Refused:
        if required:
            raise
        return None


def _python() -> str:
    return sys.executable


def _linked(kind: str, given: Path, path: Path) -> None:
    """Refuse, naming the link and where it points, a symbolic link anywhere on the absolute
    `path`: a path the user names is walked from `/` without following one (`handle`), so a
    link swapped onto it, or one the user did not know of, never redirects root."""
    found = first_link(path)
    if found is None:
        return
    link, points = found
    real = os.path.realpath(path)
    raise Refused(
        f"--{kind} {given}: {link} is a symbolic link (to {points}); sm120patch follows no "
        "link in a path it is given",
        f"give the real path: --{kind} {shlex.quote(real)}",
    )


def _package_in(kind: str, path: Path) -> Path:
    name = DISPLAY[kind]
    given = path
    # Absolute from the working directory, lexically: `..` is taken off the path as written
    # (never through a link, which is refused below); the working directory has none.
    path = Path(os.path.abspath(path))
    _linked(kind, given, path)
    if not path.exists():
        raise UsageError(
            f"--{kind} {given}: no such file or directory",
            f"give a {name} checkout root, the package's parent directory or a site-packages",
        )
    if not path.is_dir():
        raise UsageError(
            f"--{kind} {given}: is a file, expected a directory",
            f"give a {name} checkout root, the package's parent directory or a site-packages",
        )
    candidates = [path / kind, path / "python" / kind]
    if path.name == kind:
        candidates.append(path)
    found = [c for c in candidates if (c / "__init__.py").is_file()]
    for c in found:
        _linked(kind, given, c / "__init__.py")  # the package (or python/) a link elsewhere
    if not found and all((path / p).exists() for p in ("HEAD", "objects", "refs")):
        raise Refused(
            f"--{kind} {path}: a bare git repository (no work tree to patch)",
            f"clone it (`git clone {shlex.quote(str(path))} DIR`) and point --{kind} at the "
            "checkout",
        )
    if not found:
        raise Refused(
            f"--{kind} {path}: not a {name} tree (no {kind}/__init__.py here or under python/)",
            f"point --{kind} at a {name} checkout root, its package's parent or a site-packages",
        )
    if len(found) > 1:
        listed = ", ".join(str(f) for f in found)
        raise Refused(
            f"--{kind} {path}: two {name} packages found ({listed})",
            f"point --{kind} at the one to patch",
        )
    return found[0]


def _describe(kind: str, package_dir: Path, stated: str | None = None) -> Target:
    parent = package_dir.parent
    git_root = checkout_root(package_dir)
    layout = Layout.GIT if git_root is not None else Layout.INSTALLED
    if git_root is not None:
        version, source = versions.checkout_version(kind, package_dir, git_root)
    else:
        version, source = versions.installed_version(kind, package_dir)
    version, source = versions.stated_or(kind, version, source, stated)
    return Target(
        kind=Kind(kind),
        package_dir=package_dir,
        parent=parent,
        root=git_root or parent,
        layout=layout,
        version=version,
        version_source=source,
        handle=TreeHandle(git_root or parent),
    )
