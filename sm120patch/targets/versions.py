"""A target's version, read and never run: an installed package's dist-info (or its version
file); a checkout's own packaging at the patch branch's base (`checkout_version`:
`version.txt`, `pyproject.toml`'s static version or setuptools-scm configuration, committed
`version.py`, an editable install's record); a version the command line states over both
(`stated_or`). The version rules and setuptools-scm's schemes are the kit's
(`patchkit/versions.py`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from sm120patch.errors import Refused
from sm120patch.patchkit import versions
from sm120patch.safeio import read_regular, run_git
from sm120patch.targets import DISPLAY, DIST_NAMES, UNKNOWN, git_out, patch_base, state_hint

if TYPE_CHECKING:
    from packaging.version import Version


# ---- a version stated on the command line ---------------------------------------------------
def stated_or(kind: str, version: str, source: str, stated: str | None) -> tuple[str, str]:
    """The version and its source where the command line states `stated` (already checked,
    `config.Config.made`), saying what the tree reads where that differs."""
    if stated is None:
        return version, source
    flag = f"--{kind}-version"
    if version in (stated, UNKNOWN):
        return stated, flag
    return stated, f"{flag}; the tree reads {version} ({source})"


# ---- an installed package -------------------------------------------------------------------
def installed_version(kind: str, package_dir: Path) -> tuple[str, str]:
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


# The files an editable install writes into the package and git does not track: setuptools-
# scm's `version_file` (SGLang), FlashInfer's build metadata.
_RECORDS = {
    "sglang": ("_version.py",),
    "flashinfer": ("_build_meta.py", "_version.py"),
    "vllm": ("_version.py",),
}


# ---- a checkout's version ---------------------------------------------------------------------
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
        return git_out(self.root, "rev-parse", "--verify", f"{self.rev}^{{commit}}") or self.rev

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
        proc = run_git(
            self.root, "cat-file", "--batch", stdin="".join(f"{name}\n" for name in asked).encode()
        )
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
            out = git_out(
                self.root,
                "for-each-ref",
                "--format=%(refname:strip=2) %(*objectname) %(objectname)",
                "refs/tags",
            )
            self._tags = {}
            for line in (out or "").splitlines():
                name, *shas = line.split()
                if shas:
                    self._tags[name] = shas[0]  # the peeled commit of an annotated tag
        return self._tags

    def ancestors_of_tags(self) -> set[str]:
        """The tags whose commit is the base or below it."""
        out = git_out(self.root, "tag", "--merged", self.commit)
        return set((out or "").split())

    def distance_from(self, commit: str) -> int | None:
        """Commits from the merge base of `commit` and the base, to the base."""
        base = git_out(self.root, "merge-base", commit, self.commit)
        if not base:
            return None
        count = git_out(self.root, "rev-list", "--count", f"{base}..{self.commit}")
        return int(count) if count and count.isdigit() else None


def checkout_version(kind: str, package_dir: Path, root: Path) -> tuple[str, str]:
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
    at.prefetch(
        [
            project / "version.txt",
            project / "pyproject.toml",
            package / "version.py",
            package / "_version.py",
        ]
    )
    if base is None or not at.exists:  # no commit yet: the files are all there is
        return installed_version(kind, package_dir)
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

    out = git_out(
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
