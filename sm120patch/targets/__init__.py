"""Find a target (an SGLang or FlashInfer tree), its layout and its version, without importing it.

Importing SGLang needs torch and a GPU stack; we only ever read files.
"""

from __future__ import annotations

import ast
import importlib.util
import shlex
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from sm120patch.errors import Refused, UsageError
from sm120patch.patchkit.kinds import TARGETS, Kind
from sm120patch.targets import git

KINDS = TARGETS  # the kinds, in the order targets are listed and handled
DISPLAY = {"sglang": "SGLang", "flashinfer": "FlashInfer"}
DIST_NAMES = {"sglang": ("sglang",), "flashinfer": ("flashinfer_python", "flashinfer")}


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


def find(kind: str, path: str | Path | None) -> Target:
    """The target of `kind` at `path` (checkout root, package parent, site-packages or the
    package itself), or the one installed in this interpreter when `path` is None."""
    name = DISPLAY[kind]
    if path is None:
        spec = importlib.util.find_spec(kind)
        if spec is None or not spec.submodule_search_locations:
            raise Refused(
                f"{name} is not installed in this Python ({_python()})",
                f"pass --{kind} PATH to point at a {name} checkout or site-packages",
            )
        package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    else:
        package_dir = _package_in(kind, Path(path))
    return _describe(kind, package_dir)


def find_quiet(kind: str, path: str | Path | None, *, required: bool) -> Target | None:
    """`find`, or None when `kind` is not there and the user did not ask for it by path."""
    try:
        return find(kind, path)
    except Refused:
        if required:
            raise
        return None


def _python() -> str:
    import sys

    return sys.executable


def _package_in(kind: str, path: Path) -> Path:
    name = DISPLAY[kind]
    if not path.exists():
        raise UsageError(
            f"--{kind} {path}: no such file or directory",
            f"give a {name} checkout root, the package's parent directory or a site-packages",
        )
    if not path.is_dir():
        raise UsageError(
            f"--{kind} {path}: is a file, expected a directory",
            f"give a {name} checkout root, the package's parent directory or a site-packages",
        )
    path = path.resolve()
    candidates = [path / kind, path / "python" / kind]
    if path.name == kind:
        candidates.append(path)
    found = [c for c in candidates if (c / "__init__.py").is_file()]
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


def _describe(kind: str, package_dir: Path) -> Target:
    parent = package_dir.parent
    git_root = git.work_tree_of(package_dir)
    if git_root is not None:
        git.check_owner(git_root)  # before any git command runs there
    if git_root is not None and not git.is_tracked(git_root, package_dir / "__init__.py"):
        # An installed package inside some repository (a venv in a project): not a checkout.
        git_root = None
    layout = Layout.GIT if git_root is not None else Layout.INSTALLED
    version, source = _version(kind, package_dir, git_root)
    return Target(
        kind=Kind(kind),
        package_dir=package_dir,
        parent=parent,
        root=git_root or parent,
        layout=layout,
        version=version,
        version_source=source,
    )


def _version(kind: str, package_dir: Path, git_root: Path | None) -> tuple[str, str]:
    name = DISPLAY[kind]
    infos = [
        d
        for dist in DIST_NAMES[kind]
        for d in package_dir.parent.glob(f"{dist}-*.dist-info")
        if d.is_dir()
    ]
    if len(infos) > 1:
        listed = ", ".join(sorted(d.name for d in infos))
        raise Refused(
            f"two {name} installs recorded in {package_dir.parent} ({listed})",
            "remove the stale one (pip uninstall, then reinstall the version you run)",
        )
    if infos:
        version = _metadata_version(infos[0] / "METADATA")
        if version:
            return version, f"{infos[0].name}/METADATA"
    for file in ("version.py", "_version.py"):
        version = _assigned_version(package_dir / file)
        if version:
            return version, f"{kind}/{file}"
    if git_root is not None:
        described = git.describe_version(git_root)
        if described:
            return described, "git describe"
    return "unknown", "none found"


def _metadata_version(path: Path) -> str | None:
    try:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line.strip():
                    break
    except OSError:
        return None
    return None


def _assigned_version(path: Path) -> str | None:
    """`__version__ = "x"` (or `version = "x"`) from a version file, read with ast."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if names & {"__version__", "version"} and isinstance(node.value.value, str):
                return node.value.value
    return None


def record_hashes(target: Target) -> dict[str, str]:
    """sha256 (hex) of each file as pip installed it, from the dist-info RECORD (module paths).

    An independent "as installed" reference: empty for a checkout, or when the RECORD has no
    hashes (editable installs, some installers).
    """
    import base64
    import csv

    if target.layout != "installed":
        return {}
    out: dict[str, str] = {}
    for dist in DIST_NAMES[target.kind]:
        for info in target.parent.glob(f"{dist}-*.dist-info"):
            try:
                with (info / "RECORD").open(encoding="utf-8", newline="") as fh:
                    rows = list(csv.reader(fh))
            except OSError:
                continue
            for row in rows:
                if len(row) >= 2 and row[1].startswith("sha256="):
                    raw = row[1].removeprefix("sha256=")
                    try:
                        digest = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
                    except ValueError:
                        continue
                    out[row[0]] = digest.hex()
    return out
