"""What a patch does on which release: one machine-readable table per patch (`Patch.facts`).

A fact names a range of releases (a PEP 440 specifier on the release, so 0.5.9.post1 counts as
0.5.9), the shape of the code there and the outcome the patch must give. Everything else that
used to restate this knowledge is derived from the facts:

- `Patch.shapes` (what `sm120patch show` prints) and the per-site tables of docs/compatibility.md;
- where a profile accepts a missing site (`not-applicable` facts: `Profile.absent_ok`);
- where an `already-applied` reading means the release itself carries the change (`upstream`
  facts: `Patch.upstream_at`);
- the files a patch reads (`Patch.files`), the release cache's site files and range
  (sm120patch.maintain.releases), what a user is told on a release (`user_note`:
  `Patch.note_at`);
- the real-release tier's expectations (tests/real/expected.py), which fails a release inside a
  profile's pins that no fact covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from sm120patch.patchkit import versions


class Status(str, Enum):
    """What running a patch on a file gives, and what a fact says it must give there."""

    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    UPSTREAM = "upstream"
    NOT_APPLICABLE = "not-applicable"
    REFUSED = "refused"

    def __str__(self) -> str:
        return self.value


# Keyword-only: a fact has up to ten fields, most of them strings, and a positional one would
# let `file` and `function` (or `source` and `note`) trade places without an error.
@dataclass(frozen=True, kw_only=True)
class Fact:
    releases: str  # PEP 440 specifier on the release
    status: Status
    shape: str  # the code at the site in these releases, in words (show, docs/compatibility.md)
    file: str | None = None  # relative to the package's parent; None where the site is absent
    function: str | None = None  # qualified name of the function holding the site
    form: str = ""  # the spelling at the site, where the real tier's checks depend on it
    # Where the fact was read: the released files (every fact is held to them by tests/real)
    source: str = "released files"
    note: str = ""  # for maintainers: where the fact comes from, what it leaves out
    # For users: what to know about the site on these releases (e.g. where upstream already
    # takes the SM120 path for a common launch); the plan puts it on the outcome (`note`).
    user_note: str = ""
    patch: str = ""  # filled in by Patch

    def covers(self, version: str) -> bool:
        # A post release is its own release here (0.5.4.post3 already carries what 0.5.4
        # lacks); a checkout's local version (`0.5.9+12.gabc`) counts as its release.
        return versions.contains(self.releases, versions.own_release(version))

    def describe(self) -> str:
        where = f"{self.file}" + (f"::{self.function}" if self.function else "")
        return f"{self.releases or 'every release'}: {self.status.value}" + (
            f" ({where})" if self.file else ""
        ) + f": {self.shape}"


def check(facts: Sequence[Fact]) -> list[str]:
    """Problems with a patch's facts: a specifier that does not parse, an unknown status."""
    problems = []
    for f in facts:
        try:
            SpecifierSet(f.releases)
        except InvalidSpecifier:
            problems.append(f"fact {f.releases!r}: not a PEP 440 specifier")
        if not isinstance(f.status, Status):
            problems.append(f"fact {f.releases!r}: status {f.status!r} is not a Status")
    return problems
