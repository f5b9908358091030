"""The two ways a version counts as a release, named, and used everywhere a version is compared;
and the version setuptools-scm gives a commit (`scm_version`), computed from git's facts.

- `base_release`: what a pin or a known outcome means by a release. A `.postN` hotfix and a
  release candidate count as the release they patch or precede (0.5.9.post1 and 0.5.9rc1 are
  0.5.9 for `sglang = ">=0.5.8,<0.5.10"`); a checkout's local part is dropped, as PEP 440 drops
  it (0.5.9+gabc is 0.5.9). A dev build stays a dev build, compared as PEP 440 says: 0.5.24.dev3
  comes before 0.5.24, so it is neither inside `<0.5.24` nor inside `>=0.5.24`.
- `own_release`: what a fact (the code at a site) and a target's identity mean by a release. A
  `.postN` hotfix is its own release (0.5.4.post3 already carries what 0.5.4 lacks); only a
  checkout's local part is dropped (0.5.9+12.gabc is 0.5.9).

Both return None for a string that is not a PEP 440 version.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # packaging is imported where a version is compared: `status` never does
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version


def base_release(version: str) -> Version | None:
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.dev is not None:  # a dev build is not yet the release it leads to
        return Version(parsed.public)
    return Version(parsed.base_version)


def own_release(version: str) -> Version | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def contains(spec: str | SpecifierSet, version: Version | None) -> bool:
    """Whether the PEP 440 specifier `spec` admits `version` (pre-releases included: a
    release candidate of a pinned release is that release's code); False for no version."""
    from packaging.specifiers import SpecifierSet

    return version is not None and SpecifierSet(str(spec)).contains(version, prereleases=True)


# Lower bounds before upper ones, as people write a range (packaging sorts them as text).
_ORDER = {">=": 0, ">": 0, "~=": 0, "==": 1, "===": 1, "!=": 2, "<=": 3, "<": 3}


def range_text(spec: SpecifierSet) -> str:
    """A SpecifierSet as a range reads: `>=0.5.4,<0.5.24`, not `<0.5.24,>=0.5.4`."""
    items = sorted(spec, key=lambda s: (_ORDER.get(s.operator, 4), s.version))
    return ",".join(str(s) for s in items)


# ---- the version setuptools-scm gives a commit --------------------------------------------
# setuptools-scm's default `tag_regex`: an optional dashed prefix, then the version.
SCM_TAG_REGEX = r"^(?:[\w-]+-)?(?P<version>[vV]?\d+(?:\.\d+){0,2}[^\+]*)(?:\+.*)?$"
# setuptools-scm writes a commit id as `g` and 9 hex digits (its node, cut to 10 characters).
SCM_NODE_DIGITS = 9


def tag_version(tag: str, regex: str = SCM_TAG_REGEX) -> Version | None:
    """The version a tag names, read as setuptools-scm reads it (its `version` group, or its
    only group); None when the tag is no version."""
    import re

    from packaging.version import InvalidVersion, Version

    try:
        match = re.match(regex, tag)
    except re.error:
        return None
    if match is None:
        return None
    text = match.group("version") if "version" in match.groupdict() else match.group(1)
    try:
        return Version(text)
    except (InvalidVersion, TypeError):
        return None


def scm_version(
    tag: Version,
    distance: int,
    commit: str,
    *,
    version_scheme: str = "guess-next-dev",
    local_scheme: str = "node-and-date",
) -> str | None:
    """What setuptools-scm records for a clean commit `distance` commits past `tag`, with these
    schemes; None for a scheme it is not written for (the caller then reads `unknown`).

    guess-next-dev, the default: the tag itself on the tagged commit, else a dev build of the
    next release, `0.5.23` -> `0.5.24.dev3`, `0.5.10.post1` -> `0.5.10.post2.dev3`. The local
    part (node-and-date, the default) is `+g` and the commit's first 9 hex digits; the date is
    only added for uncommitted changes, which a commit does not have.
    """
    import re

    from packaging.version import InvalidVersion, Version

    public = str(tag).partition("+")[0]
    if distance == 0 or version_scheme == "only-version":
        main = public
    elif version_scheme == "guess-next-dev":
        if ".dev" in public:
            prefix, _, number = public.rpartition(".dev")
            if number != "0":  # setuptools-scm refuses to guess past a `.devN` tag
                return None
            guessed = prefix
        else:
            bumped = re.match(r"(.*?)(\d+)$", public)
            if bumped is None:
                return None
            guessed = f"{bumped[1]}{int(bumped[2]) + 1}"
        main = f"{guessed}.dev{distance}"
    elif version_scheme == "post-release":
        main = f"{public}.post{distance}"
    elif version_scheme == "no-guess-dev":
        if ".dev" in public or "post" in public:
            return None
        main = f"{public}.post1.dev{distance}"
    else:
        return None
    if local_scheme in ("node-and-date", "node-and-timestamp"):
        local = "" if distance == 0 else f"+g{commit[:SCM_NODE_DIGITS]}"
    elif local_scheme in ("no-local-version", "dirty-tag"):
        local = ""
    else:
        return None
    try:
        return str(Version(main + local))
    except InvalidVersion:  # `0.5.10.post1` with post-release: not a version
        return None


def highest(tags: dict[str, Version]) -> str | None:
    """The tag naming the highest version (PEP 440 order), or None."""
    return max(tags, key=lambda t: tags[t], default=None)


# ---- what a tree's packaging files say ------------------------------------------------------
def assigned_version(data: bytes | None) -> str | None:
    """`__version__ = "x"` (or `version = "x"`, or both chained, as setuptools-scm and
    FlashInfer's build write them) at the top of a version file, read with ast."""
    import ast

    try:
        tree = ast.parse(data) if data is not None else None
    except (SyntaxError, ValueError):
        return None
    for node in tree.body if tree else ():
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            value, assigned = node.value, node.targets
        elif isinstance(node, ast.AnnAssign):
            value, assigned = node.value, [node.target]
        else:
            continue
        if not isinstance(value, ast.Constant) or not isinstance(value.value, str):
            continue
        if {t.id for t in assigned if isinstance(t, ast.Name)} & {"__version__", "version"}:
            return value.value
    return None


@dataclass(frozen=True)
class Packaging:
    """Where a `pyproject.toml` says the version comes from: a static `[project] version`,
    setuptools-scm (its table), or a module's `__version__` (the module's file, relative to
    the pyproject's directory); `why` when none of them."""

    static: str | None = None
    scm: dict[str, Any] | None = None
    module_file: str | None = None
    why: str = ""


def read_pyproject(text: bytes) -> Packaging:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    try:
        doc = tomllib.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return Packaging(why="its pyproject.toml is not valid TOML")

    def table(parent: dict[str, Any], key: str) -> dict[str, Any]:
        found = parent.get(key)
        return found if isinstance(found, dict) else {}

    project, tool = table(doc, "project"), table(doc, "tool")
    if isinstance(project.get("version"), str) and "version" not in project.get("dynamic", ()):
        return Packaging(static=project["version"])
    if "setuptools_scm" in tool:
        return Packaging(scm=table(tool, "setuptools_scm"))
    attr = table(table(table(tool, "setuptools"), "dynamic"), "version").get("attr")
    module, _, name = str(attr or "").rpartition(".")
    if module and name in ("__version__", "version"):
        return Packaging(module_file=module.replace(".", "/") + ".py")
    return Packaging(why="its pyproject.toml names no version sm120patch can read")
