"""Find a target (an SGLang or FlashInfer tree), its layout and its version, without importing it.

Importing SGLang needs torch and a GPU stack; we only read files. A checkout's version is what
its packaging says at the base of sm120patch's patch branch (`_checkout_version`).

This package's init imports none of its own modules (git.py, files.py and procscan.py import
it): Python runs a package's init before any module of it, so an init importing one of them
would be an import circle. The read-only git a target's finding needs (is the package tracked,
which commit is the base, which tags and files it has) is run here, as every git command is
(`run_git`); the commands that write, and a checkout's repository, are in git.py.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shlex
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from sm120patch.errors import Refused, UsageError
from sm120patch.handle import TreeHandle
from sm120patch.patchkit import versions
from sm120patch.patchkit.kinds import DISPLAY as DISPLAY  # defined with the kinds, read here
from sm120patch.patchkit.kinds import DIST_NAMES as DIST_NAMES
from sm120patch.patchkit.kinds import TARGETS, Kind
from sm120patch.safeio import SAFE_CONFIG as SAFE_CONFIG  # git's rules, kept with its runner
from sm120patch.safeio import read_regular, user_name
from sm120patch.safeio import run_git as run_git  # the one git runner, called here by git.py

if TYPE_CHECKING:
    from collections.abc import Mapping

    from packaging.version import Version

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
        # This interpreter's own environment, named by no one: its sys.path is as trusted as
        # the code running now (a venv's lib64 link is its installer's), so it is resolved
        # once; the handle holds the real path. A named path is never resolved (`_package_in`).
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
    return sys.executable


def _linked(kind: str, given: Path, path: Path) -> None:
    """Refuse, naming the link and where it points, a symbolic link anywhere on the absolute
    `path`: a path the user names is walked from `/` without following one (`handle`), so a
    link swapped onto it, or one the user did not know of, never redirects root."""
    from sm120patch.handle import first_link

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


def _describe(kind: str, package_dir: Path) -> Target:
    parent = package_dir.parent
    git_root = checkout_root(package_dir)
    layout = Layout.GIT if git_root is not None else Layout.INSTALLED
    version, source = (_checkout_version(kind, package_dir, git_root) if git_root is not None
                       else _installed_version(kind, package_dir))  # fmt: skip
    version, source = _stated_or(kind, version, source)
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


# ---- a version stated on the command line ---------------------------------------------------
_stated: dict[str, str] = {}


def state_versions(stated: Mapping[str, str | None]) -> None:
    """The versions the command line states (`--sglang-version`, `--flashinfer-version`), for
    every target of those kinds found in this process; called once per command (`app.Session`),
    also with none, since one process may run several commands. UsageError for one that is not
    a PEP 440 version."""
    _stated.clear()  # first: a refused statement leaves none of an earlier command's
    _stated.update({k: _checked(k, v) for k, v in stated.items() if v})


def state_hint(kind: str) -> str:
    """The one line saying how to state a target's version."""
    return f"state it with --{kind}-version VERSION"


def _stated_or(kind: str, version: str, source: str) -> tuple[str, str]:
    stated = _stated.get(kind)
    if stated is None:
        return version, source
    flag = f"--{kind}-version"
    if version in (stated, UNKNOWN):
        return stated, flag
    return stated, f"{flag}; the tree reads {version} ({source})"


def _checked(kind: str, version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(version))
    except InvalidVersion:
        raise UsageError(
            f"--{kind}-version {version}: not a PEP 440 version",
            f"give the {DISPLAY[kind]} release this tree is, e.g. --{kind}-version 0.5.23",
        ) from None


# ---- an installed package -------------------------------------------------------------------
UNKNOWN = "unknown"


def _installed_version(kind: str, package_dir: Path) -> tuple[str, str]:
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
    for file in dict.fromkeys(("version.py", "_version.py", *_RECORDS[kind])):
        version = versions.assigned_version(_read_file(package_dir / file))
        if version:
            return version, f"{kind}/{file}"
    return UNKNOWN, f"no dist-info, version.py or _version.py; {state_hint(kind)}"


def _metadata_version(path: Path) -> str | None:
    try:
        text = read_regular(path).decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
        if not line.strip():
            break
    return None


def _read_file(path: Path) -> bytes | None:
    try:
        return read_regular(path)  # a FIFO or a link there never blocks nor redirects the read
    except (OSError, Refused):
        return None


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


def _git_out(root: Path, *args: str) -> str | None:
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


# ---- a checkout's version ---------------------------------------------------------------------
PATCH_TRAILER = "Sm120patch-Patch:"  # every commit sm120patch makes carries it
PATCH_BRANCH_PREFIX = "sm120patch/"  # the branches sm120patch commits on
# The files an editable install writes into the package and git does not track: setuptools-
# scm's `version_file` (SGLang), FlashInfer's build metadata.
_RECORDS = {"sglang": ("_version.py",), "flashinfer": ("_build_meta.py", "_version.py"),
            "vllm": ("_version.py",)}  # fmt: skip


def patch_base(root: Path) -> str | None:
    """The commit a checkout's version is read at: HEAD, or, on sm120patch's patch branch (or
    a detached HEAD), the commit below sm120patch's own commits (commits of the user's on top of
    them are drift, which `status` reports, not another release). `HEAD` where the branch is
    another (no git command for it)."""
    branch = head_branch(root)
    if branch is not None and not branch.startswith(PATCH_BRANCH_PREFIX):
        return "HEAD"
    out = _git_out(root, "log", "--first-parent", "-n", "256", "--format=%H%x00%B%x01", "HEAD")
    chain = [e.strip().partition("\x00") for e in (out or "").split("\x01") if e.strip()]
    ours = [i for i, (_, _, body) in enumerate(chain) if PATCH_TRAILER in body]
    below = ours[-1] + 1 if ours else 0
    return chain[below][0] if below < len(chain) else None


class _AtCommit:
    """A checkout's files and tags as they are at one commit, read through git."""

    def __init__(self, root: Path, rev: str) -> None:
        self.root, self.rev = root, rev
        self._tags: dict[str, str] | None = None
        self._files: dict[str, bytes | None] = {}
        self._exists: bool | None = None

    @functools.cached_property
    def commit(self) -> str:
        """The commit's id (`rev` may be `HEAD`)."""
        return _git_out(self.root, "rev-parse", "--verify", f"{self.rev}^{{commit}}") or self.rev

    def prefetch(self, rels: list[PurePosixPath]) -> None:
        """Read these files at the commit with one git command (`cat-file --batch`): a
        checkout's version is looked for in a few files, and `status` runs this every time.
        The first call also learns whether the commit exists (`exists`: no commit yet)."""
        wanted = [r.as_posix() for r in rels if r.as_posix() not in self._files]
        asked = [f"{self.rev}:{r}" for r in wanted]
        if self._exists is None:
            asked.insert(0, self.rev)
        if not asked:
            return
        proc = run_git(self.root, "cat-file", "--batch",
                       stdin="".join(f"{name}\n" for name in asked).encode())
        out, at, found = proc.stdout, 0, []
        for _ in asked:
            end = out.find(b"\n", at)
            header = out[at:end].split() if end >= 0 else []
            size = int(header[2]) if len(header) == 3 and header[2].isdigit() else None
            found.append(out[end + 1 : end + 1 + size] if size is not None else None)
            kind = header[1] if size is not None else b""
            found[-1] = found[-1] if kind in (b"blob", b"commit") else None
            at = (end + 1 + size + 1) if size is not None else (end + 1 if end >= 0 else len(out))
        if self._exists is None:
            self._exists = found.pop(0) is not None
        self._files.update(zip(wanted, found, strict=True))

    @property
    def exists(self) -> bool:
        self.prefetch([])
        return bool(self._exists)

    def read(self, rel: PurePosixPath) -> bytes | None:
        self.prefetch([rel])
        return self._files[rel.as_posix()]

    def tags(self) -> dict[str, str]:
        """Every tag of the repository: name -> the commit it points at."""
        if self._tags is None:
            out = _git_out(
                self.root, "for-each-ref", "--format=%(refname:strip=2) %(*objectname) "
                "%(objectname)", "refs/tags",
            )  # fmt: skip
            self._tags = {}
            for line in (out or "").splitlines():
                name, *shas = line.split()
                if shas:
                    self._tags[name] = shas[0]  # the peeled commit of an annotated tag
        return self._tags

    def ancestors_of_tags(self) -> set[str]:
        """The tags whose commit is the base or below it."""
        out = _git_out(self.root, "tag", "--merged", self.commit)
        return set((out or "").split())

    def distance_from(self, commit: str) -> int | None:
        """Commits from the merge base of `commit` and the base, to the base."""
        base = _git_out(self.root, "merge-base", commit, self.commit)
        if not base:
            return None
        count = _git_out(self.root, "rev-list", "--count", f"{base}..{self.commit}")
        return int(count) if count and count.isdigit() else None


def _checkout_version(kind: str, package_dir: Path, root: Path) -> tuple[str, str]:
    """A checkout's version as its own packaging gives it, read without running its code:

    1. FlashInfer: `version.txt` beside the package (what its build records; a build's dev
       or local suffix, from the editable install's `_build_meta.py`, where it extends it);
    2. `pyproject.toml` beside the package: a static `[project] version`, setuptools-scm's
       configuration (SGLang: `scm_checkout_version`), or a version attribute's file;
    3. `version.py`, `_version.py` in the package, as committed;
    4. the editable install's record (`_version.py`), where the tree gives none;
    else `unknown`, with why and the hint to state it. All at `patch_base` (in the work tree
    before a first commit).
    """
    base = patch_base(root)
    at = _AtCommit(root, base or "HEAD")
    project = PurePosixPath(package_dir.parent.relative_to(root).as_posix())
    package = project / package_dir.name
    at.prefetch([project / "version.txt", project / "pyproject.toml", package / "version.py",
                 package / "_version.py"])  # fmt: skip
    if base is None or not at.exists:  # no commit yet: the files are all there is
        return _installed_version(kind, package_dir)
    short = "HEAD" if base == "HEAD" else base[:9]
    record, record_file = _record(kind, package_dir)
    if kind == "flashinfer":
        text = at.read(project / "version.txt")
        stated = text.decode("utf-8", "replace").strip() if text else ""
        if stated:
            if record and (record == stated or record.startswith((f"{stated}.dev", f"{stated}+"))):
                return record, f"{kind}/{record_file} (version.txt {stated} at {short})"
            return stated, f"{(project / 'version.txt').as_posix()} at {short}"
    why = ""
    text = at.read(project / "pyproject.toml")
    if text is not None:
        version, why = _pyproject_version(at, project, text)
        if version:
            return version, f"{(project / 'pyproject.toml').as_posix()} at {short}: {why}"
    for file in ("version.py", "_version.py"):
        version = versions.assigned_version(at.read(package / file))
        if version:
            return version, f"{(package / file).as_posix()} at {short}"
    if record:
        return record, f"{kind}/{record_file}, written by its editable install"
    return UNKNOWN, f"{why or 'no version file in the tree'}; {state_hint(kind)}"


def _record(kind: str, package_dir: Path) -> tuple[str | None, str]:
    """The version an editable install wrote into the package (untracked), and its file."""
    for file in _RECORDS[kind]:
        version = versions.assigned_version(_read_file(package_dir / file))
        if version and version not in _FALLBACKS:
            return version, file
    return None, ""


# What a build records when it found no version: not this tree's version.
_FALLBACKS = ("0.0.0.dev0", "0.0.0+unknown", "0.0.0")


def _pyproject_version(
    at: _AtCommit, project: PurePosixPath, text: bytes
) -> tuple[str | None, str]:
    """The version a `pyproject.toml` gives the commit, and how; (None, why) when it gives none
    that can be trusted."""
    said = versions.read_pyproject(text)
    if said.static:
        return said.static, "[project] version"
    if said.scm is not None:
        return scm_checkout_version(at, project, said.scm)
    rel = (project / said.module_file).as_posix() if said.module_file else ""
    version = versions.assigned_version(at.read(PurePosixPath(rel))) if rel else None
    if version:
        return version, f"[tool.setuptools.dynamic] version from {rel}"
    return None, said.why or f"{rel} has no version"


def scm_checkout_version(
    at: _AtCommit, project: PurePosixPath, scm: dict[str, Any]
) -> tuple[str | None, str]:
    """What `pip install -e` records for the commit under this `[tool.setuptools_scm]`, as a
    clean commit; (None, why) where that would not be the tree's version. The tag counted from
    depends on `git_describe_command` (docs/operator.md, "A checkout's version"): none is
    setuptools-scm's `git describe` (`_nearest_tag`, and its rule against an old release still
    reachable from main); SGLang's `python/tools/get_version_tag.py` is read, not run
    (`_sglang_tag`; its `--tag-only` form around 0.5.10 counted as the later form does); any
    other would run a program of the checkout's. No tag is `unknown`, never `fallback_version`.
    """
    setting = scm.get("root", ".")
    root_at = os.path.normpath((project / str(setting)).as_posix())
    if root_at != ".":
        return None, f"its setuptools-scm root ({setting}) is not the repository's root"
    regex = str(scm.get("tag_regex", versions.SCM_TAG_REGEX))
    command = scm.get("git_describe_command")
    words = command if isinstance(command, list) else str(command or "").split()
    named = {t: v for t, v in ((t, versions.tag_version(t, regex)) for t in at.tags()) if v}
    if command is None:
        found = _nearest_tag(at, named)
    elif any(str(w).endswith("get_version_tag.py") for w in words):
        found = _sglang_tag(at, named)
    else:
        return None, "its git_describe_command runs a program of the checkout's"
    if isinstance(found, str):
        return None, found
    tag, distance = found
    version = versions.scm_version(
        named[tag],
        distance,
        at.commit,
        version_scheme=str(scm.get("version_scheme", "guess-next-dev")),
        local_scheme=str(scm.get("local_scheme", "node-and-date")),
    )
    if version is None:
        return None, "its setuptools-scm schemes are ones sm120patch does not compute"
    return version, f"setuptools-scm, tag {tag}" + (f" + {distance}" if distance else "")


def _tags_at(at: _AtCommit, named: dict[str, Version]) -> dict[str, Version]:
    return {t: v for t, v in named.items() if at.tags().get(t) == at.commit}


def _nearest_tag(at: _AtCommit, named: dict[str, Version]) -> tuple[str, int] | str:
    """setuptools-scm's default (`git describe --tags --long --match *[0-9]*`: the nearest tag
    below the commit), with the rule against an old release still reachable from main."""
    import re

    out = _git_out(
        at.root, "describe", "--tags", "--long", "--abbrev=40", "--match", "*[0-9]*", at.commit
    )
    match = re.match(r"^(?P<tag>.+)-(?P<n>\d+)-g[0-9a-f]+$", out or "")
    if match is None or match["tag"] not in named:
        return "no version tag below this commit (a clone without tags?)"
    nearest, distance = match["tag"], int(match["n"])
    if distance == 0:
        return nearest, 0
    below = at.ancestors_of_tags()
    higher = {
        t: v
        for t, v in named.items()
        if v > named[nearest] and not v.is_devrelease and t not in below
    }
    if higher:
        return (
            f"git describe reaches tag {nearest}, but release tag {versions.highest(higher)} is "
            "not below this commit, so that tag may be an old release still reachable from main"
        )
    return nearest, distance


def _sglang_tag(at: _AtCommit, named: dict[str, Version]) -> tuple[str, int] | str:
    """SGLang's rule (`python/tools/get_version_tag.py`), read rather than run."""
    from fnmatch import fnmatchcase

    exact = versions.highest({t: v for t, v in _tags_at(at, named).items() if t.startswith("v")})
    if exact:
        return exact, 0
    release = {t: v for t, v in named.items() if fnmatchcase(t, "v*.*.*")}
    tag = versions.highest(release)
    if tag is None:
        return "no v*.*.* tag in the repository (a clone without tags?)"
    distance = at.distance_from(at.tags()[tag])
    if distance is None:
        return f"tag {tag} shares no commit with this one (a shallow clone?)"
    return tag, distance
