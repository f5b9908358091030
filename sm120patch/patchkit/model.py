"""The patch model: what a patch is (`Patch`), what running it says (`Result`, `Outcome`, `Status`).

A patch's transform gets a parsed libcst module and returns a `Result`, in the style of
`libcst.codemod`: success (`applied`, with the new module), or a skip with a reason
(`already-applied`, `upstream`). Where it stops early it raises, as a codemod raises
`SkipFile`: `NotApplicable` (the site is not in this file) or `Refuse` (a shape the patch does
not know: what it expected, what it found). Finders (`operations.one_def`, `one_of_defs`)
return the node they find and raise the same two. The runner catches both into the `Result`
they stand for (`runner.run_transform`), and turns any other exception inside a transform into
a refusal too, because a wrong patch is worse than no patch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.facts import Status as Status

# Status is named here too: a patch module takes its result vocabulary from the model.
from sm120patch.patchkit.kinds import TARGETS as TARGETS
from sm120patch.patchkit.kinds import Kind as Kind
from sm120patch.patchkit.readers import Explain

if TYPE_CHECKING:
    import libcst as cst

    from sm120patch.patchkit.sitecheck import Check

# The two kinds of target a patch may name, in the order commands report them.



@dataclass(frozen=True)
class Import:
    """A name the code of a result needs at module level, as `from MODULE import name`: put
    right after `next_to` in the one import that brings `next_to` (from `module` when given,
    else from whichever module that is). A transform requests it (`Result.imports`); the
    runner places it, once, or refuses where it cannot (`patchkit.runner`)."""

    name: str
    next_to: str
    module: str | None = None


@dataclass(frozen=True)
class Result:
    """What one transform says about one site."""

    status: Status
    site: str
    reason: str
    shape: str = ""
    module: Any = None  # the new libcst.Module, only when status is APPLIED
    # The imports the site's code needs: placed by the runner where the result applied (a name
    # already imported is left alone), required present where the change was already there.
    imports: tuple[Import, ...] = ()

    def needing(self, *imports: Import | None) -> Result:
        """This result, requesting `imports` as well (None: nothing to import). A refusal or
        a skip requests nothing."""
        wanted = tuple(i for i in imports if i is not None)
        if not wanted or self.status not in (Status.APPLIED, Status.ALREADY_APPLIED):
            return self
        return replace(self, imports=(*self.imports, *wanted))


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


class Stop(Exception):
    """A transform (or a finder it calls) stopping at a site: `result` is the outcome the
    runner records. Raised as one of its two kinds, never itself."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.reason)
        self.result = result

    @property
    def site(self) -> str:
        return self.result.site


class Refuse(Stop):
    """The site has a shape the patch does not know: refused, saying what it expected and
    what it found (the same words `refused` writes)."""

    def __init__(self, site: str, expected: str, found: str) -> None:
        super().__init__(refused(site, expected, found))
        self.expected = expected
        self.found = found


class NotApplicable(Stop):
    """The site is not in this file (this release has no such code): not-applicable, with
    why."""

    def __init__(self, site: str, reason: str) -> None:
        super().__init__(not_applicable(site, reason))


def files_of(facts: tuple[Fact, ...]) -> tuple[str, ...]:
    """The files `facts` name, the last fact's first (facts run oldest release first, and the
    newest layout is the one to look for first)."""
    return tuple(dict.fromkeys(f.file for f in reversed(facts) if f.file))


class Seen(str, Enum):
    """What a server's log says of one patch's path."""

    RAN = "ran"
    SKIPPED = "skipped"
    NOT_SEEN = "not-seen"

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Evidence:
    """What a log showed of one patch's path, and the line that showed it."""

    seen: Seen
    line: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"seen": self.seen.value, "line": self.line}


@dataclass(frozen=True)
class Wiring:
    """The server log lines that show at run time whether a patch's path ran or was skipped:
    regular expressions searched in each line (`re.search`), one list per side. A patch can
    apply and start cleanly and still never run its path (a runtime check upstream turns the
    feature off): only the log tells."""

    ran: tuple[str, ...]
    skipped: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        import re

        out = [] if self.ran else ["wiring: no `ran` pattern"]
        for pattern in (*self.ran, *self.skipped):
            try:
                re.compile(pattern)
            except re.error as exc:
                out.append(f"wiring: {pattern!r} is not a regular expression ({exc})")
        return out

    def read(self, log: str) -> Evidence:
        """The last line matching either side decides: a path that ran and was turned off
        later (a workspace that failed to grow) counts as skipped, and the other way round."""
        import re

        ran = [re.compile(p) for p in self.ran]
        skipped = [re.compile(p) for p in self.skipped]
        seen, line = Seen.NOT_SEEN, ""
        for text in log.splitlines():
            if any(p.search(text) for p in skipped):
                seen, line = Seen.SKIPPED, text.strip()
            elif any(p.search(text) for p in ran):
                seen, line = Seen.RAN, text.strip()
        return Evidence(seen, line)


def wiring_evidence(patches: Sequence[Patch], log: str) -> dict[str, Evidence]:
    """Per patch that declares its wiring: ran, skipped or not-seen in `log` (a server's
    output). Patches that declare none are left out: their log says nothing either way."""
    return {p.id: p.wiring.read(log) for p in patches if p.wiring is not None}


@dataclass(frozen=True)
class Sought:
    """The names a patch's finder looks up first (the def, class or attribute its site is
    named by), and the site it reports when it finds none.

    A promise the patch makes: on a file whose text holds none of `names`, its transform says
    not-applicable. A name is an identifier, and an identifier can only be spelt whole in
    Python source, so its absence from the bytes is proof the finder cannot find it; the
    runner then records that outcome without a parse (`runner.transform_text`). `marker`
    cannot serve: it picks among candidate files and may hold spaces a file can spell
    otherwise (`def  f`), so its absence proves nothing."""

    site: str
    names: tuple[str, ...]

    def absent_from(self, text: str) -> Result | None:
        """The not-applicable outcome when `text` holds none of `names`, else None."""
        if any(name in text for name in self.names):
            return None
        listed = ", ".join(f"`{name}`" for name in self.names)
        return not_applicable(self.site, f"no {listed} anywhere in this file: no site here")

    def problems(self) -> list[str]:
        if not self.names:
            return ["sought: no names"]
        return [f"sought: {n!r} is not an identifier" for n in self.names if not n.isidentifier()]


@dataclass(frozen=True)
class Patch:
    """One site, one transform. Declared by a module under patches/ as `PATCH = Patch(...)`."""

    id: str
    target: str  # "sglang" or "flashinfer"
    title: str
    why: str
    # The first candidate file (see `files`) whose text contains `marker` holds the site.
    marker: str
    transform: Transform
    # What the patch does on which release (sm120patch.patchkit.facts): shapes, expected
    # outcomes, where a missing site is fine, where the release carries the change itself, and
    # what a user should know there. The one place a release range is written.
    facts: tuple[Fact, ...] = ()
    # Candidate files relative to the directory holding the package, in order of preference:
    # the files the facts name, the newest release's first, when not given (a patch without
    # facts names them here).
    files: tuple[str, ...] = ()
    # The shapes in words; derived from `facts` when not given.
    shapes: tuple[str, ...] = ()
    upstream: str | None = None  # the upstream issue or PR this patch relates to
    # What `sm120patch explain` reads at the site and how it shows it (patchkit.readers).
    explain: Explain | None = None
    # The server log lines that show its path ran or was skipped (`wiring_evidence`).
    wiring: Wiring | None = None
    # Its independent check on `ast` (sm120patch.patchkit.sitecheck): what the real-release
    # tier runs on every release the patch applies to. Every patch of the library declares one
    # (tests/test_one_home.py); None only for a pack's patch, which the real tier does not run.
    check: Check | None = None
    # The names its finder looks up first (`Sought`): a file holding none of them is not
    # parsed for this patch.
    sought: Sought | None = None

    def __post_init__(self) -> None:
        stamped = tuple(f if f.patch == self.id else replace(f, patch=self.id) for f in self.facts)
        object.__setattr__(self, "facts", stamped)
        if not self.shapes and stamped:
            object.__setattr__(self, "shapes", tuple(f.describe() for f in stamped))
        if not self.files:
            object.__setattr__(self, "files", files_of(stamped))

    def facts_at(self, version: str) -> list[Fact]:
        return [f for f in self.facts if f.covers(version)]

    def upstream_at(self, version: str) -> bool:
        """Whether `version` itself carries this patch's change (an `upstream` fact)."""
        return any(f.status is Status.UPSTREAM for f in self.facts_at(version))

    def note_at(self, version: str) -> str:
        """What a user should know about this site on `version` (its facts' `user_note`)."""
        return " ".join(f.user_note for f in self.facts_at(version) if f.user_note)

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
