"""The patch model: what a patch is (`Patch`), what running it says (`Result`, `Outcome`, `Status`).

A patch's transform gets a parsed libcst module and returns a `Result`, in the style of
`libcst.codemod`: success (`applied`, with the new module), a skip with a reason
(`already-applied`, `upstream`, `not-applicable`) or a failure (`refused`). It never raises
for an unexpected shape; the runner turns a crash inside a transform into a refusal too,
because a wrong patch is worse than no patch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# Status is named here too: a patch module takes its result vocabulary from the model.
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.facts import Status as Status

if TYPE_CHECKING:
    import libcst as cst

# The two kinds of target a patch may name, in the order commands report them.
TARGETS = ("sglang", "flashinfer")


@dataclass(frozen=True)
class Result:
    """What one transform says about one site."""

    status: Status
    site: str
    reason: str
    shape: str = ""
    module: Any = None  # the new libcst.Module, only when status is APPLIED


def applied(site: str, module: cst.Module, shape: str, reason: str = "") -> Result:
    return Result(Status.APPLIED, site, reason or f"patched ({shape})", shape, module)


def already_applied(site: str, shape: str) -> Result:
    return Result(Status.ALREADY_APPLIED, site, f"SM120 change already present ({shape})", shape)


def upstream(site: str, reason: str, shape: str = "") -> Result:
    return Result(Status.UPSTREAM, site, reason, shape)


def not_applicable(site: str, reason: str) -> Result:
    return Result(Status.NOT_APPLICABLE, site, reason)


def refused(site: str, expected: str, found: str) -> Result:
    return Result(Status.REFUSED, site, f"expected {expected}; found {found}")


Transform = Callable[["cst.Module"], Result]


@dataclass(frozen=True)
class Patch:
    """One site, one transform. Declared by a module under patches/ as `PATCH = Patch(...)`."""

    id: str
    target: str  # "sglang" or "flashinfer"
    title: str
    why: str
    # Candidate files relative to the directory holding the package, in order of preference;
    # the first one whose text contains `marker` holds the site in that release.
    files: tuple[str, ...]
    marker: str
    transform: Transform
    # What the patch does on which release (sm120patch.patchkit.facts): shapes, expected outcomes,
    # where a missing site is fine and where the release carries the change itself.
    facts: tuple[Fact, ...] = ()
    # The shapes in words; derived from `facts` when not given.
    shapes: tuple[str, ...] = ()
    upstream: str | None = None  # the upstream issue or PR this patch relates to
    # Versions of the target whose own code already carries this exact change: there an
    # `already-applied` reading means "upstream", not "ours". Facts with status upstream say
    # the same; this field stays for patches that declare no facts.
    upstream_in: str | None = None
    # (PEP 440 specifier of the target's release, text): what a user should know about this
    # site on those releases, e.g. where upstream already takes the SM120 path for a common
    # launch; the plan puts the text on the outcome (`Outcome.note`).
    notes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        from dataclasses import replace as _replace

        stamped = tuple(f if f.patch == self.id else _replace(f, patch=self.id) for f in self.facts)
        object.__setattr__(self, "facts", stamped)
        if not self.shapes and stamped:
            object.__setattr__(self, "shapes", tuple(f.describe() for f in stamped))

    def facts_at(self, version: str) -> list[Fact]:
        return [f for f in self.facts if f.covers(version)]

    def upstream_at(self, version: str) -> bool:
        """Whether `version` itself carries this patch's change (an `upstream` fact, or
        `upstream_in`)."""
        if any(f.status is Status.UPSTREAM for f in self.facts_at(version)):
            return True
        if not self.upstream_in:
            return False
        from sm120patch.patchkit import versions

        return versions.contains(self.upstream_in, versions.base_release(version))

    def pick_file(self, read: Callable[[str], str | None]) -> str | None:
        """The candidate file holding this site; `read` returns None for a missing file."""
        first_existing = None
        for rel in self.files:
            text = read(rel)
            if text is None:
                continue
            if self.marker in text:
                return rel
            first_existing = first_existing or rel
        return first_existing


@dataclass(frozen=True)
class Outcome:
    """One patch on one site of one target: what happened and why, in words a user can act on."""

    patch: str
    target: str
    file: str | None
    site: str
    status: Status
    reason: str
    shape: str = ""
    note: str = ""  # from the patch's `notes` for this release; empty when none applies

    def to_dict(self) -> dict[str, str | None]:
        return {
            "patch": self.patch,
            "target": self.target,
            "file": self.file,
            "site": self.site,
            "status": self.status.value,
            "reason": self.reason,
            "shape": self.shape,
            "note": self.note,
        }

    def describe(self) -> str:
        where = f"{self.file}::{self.site}" if self.file else self.site
        text = f"{self.patch}: {self.status.value} at {where}: {self.reason}"
        return f"{text} (note: {self.note})" if self.note else text
