"""Run patches on one source text and say what happened. No I/O here: text in, outcomes out.

A patch's transform gets a parsed libcst module and returns a `Result`, in the style of
`libcst.codemod`: success (`applied`, with the new module), a skip with a reason
(`already-applied`, `upstream`, `not-applicable`) or a failure (`refused`). It never raises
for an unexpected shape; the runner turns a crash inside a transform into a refusal too,
because a wrong patch is worse than no patch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import libcst as cst

    from sm120patch.patchkit.facts import Fact


class Status(str, Enum):
    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    UPSTREAM = "upstream"
    NOT_APPLICABLE = "not-applicable"
    REFUSED = "refused"

    def __str__(self) -> str:
        return self.value


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

    def absent_at(self, version: str) -> bool:
        """Whether a fact says the site does not exist in `version` (and that is fine)."""
        return any(f.status is Status.NOT_APPLICABLE for f in self.facts_at(version))

    def upstream_at(self, version: str) -> bool:
        """Whether `version` itself carries this patch's change (an `upstream` fact, or
        `upstream_in`)."""
        if any(f.status is Status.UPSTREAM for f in self.facts_at(version)):
            return True
        if not self.upstream_in:
            return False
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            release = Version(Version(version).base_version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.upstream_in).contains(release, prereleases=True)

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


@dataclass
class FileResult:
    """All patches of a profile that touch one file, run in order on one parse."""

    file: str
    before: str
    after: str
    outcomes: list[Outcome] = field(default_factory=list)
    # The module after each applied patch, in order: the engine commits one patch at a time.
    # Kept as trees: turning a 5,000-line module back into text is the costly part of a plan,
    # and a dry run needs only the last one (`after`).
    steps: list[tuple[str, Any]] = field(default_factory=list)
    tree: Any = None  # the parsed original, for checks that compare before and after

    @property
    def changed(self) -> bool:
        return self.after != self.before

    def step_texts(self) -> list[tuple[str, str]]:
        """(patch id, text after it) for each applied patch, in order."""
        texts = []
        tree, text = self.tree, self.before
        for pid, module in self.steps[:-1]:
            text = spliced_code(tree, text, module) if tree is not None else module.code
            tree = module
            texts.append((pid, text))
        if self.steps:
            texts.append((self.steps[-1][0], self.after))
        return texts


@lru_cache(maxsize=4)
def _parsed(text: str) -> cst.Module:
    """The tree of `text`. libcst trees are immutable, so the plans of one text share it:
    `matrix` plans every profile on each release, and parsing server_args.py once instead of
    once per profile is most of its time. (A text that does not parse raises every time.)"""
    import libcst as cst

    return cst.parse_module(text)


def transform_text(patches: Sequence[Patch], file: str, text: str) -> FileResult:
    """Parse `text` once and run each patch on it in order, chaining the applied changes."""
    import libcst as cst

    result = FileResult(file=file, before=text, after=text)
    try:
        module = _parsed(text)
        result.tree = module
    except cst.ParserSyntaxError as exc:
        line = f"line {exc.raw_line}" if exc.raw_line else "unknown line"
        for patch in patches:
            result.outcomes.append(
                Outcome(
                    patch.id,
                    patch.target,
                    file,
                    "<module>",
                    Status.REFUSED,
                    f"the file does not parse ({line}: {exc.message}); fix or restore it first",
                )
            )
        return result

    for patch in patches:
        try:
            res = patch.transform(module)
        except Exception as exc:  # a patch bug must not half-apply anything
            res = refused(
                "<module>",
                "a shape this patch knows",
                f"an error inside the patch ({type(exc).__name__}: {exc})",
            )
        if res.status is Status.APPLIED:
            module = res.module
            result.steps.append((patch.id, module))
        result.outcomes.append(
            Outcome(patch.id, patch.target, file, res.site, res.status, res.reason, res.shape)
        )
    if result.steps:
        result.after = spliced_code(result.tree, text, module)
        problem = _compile_problem(result.after, file) or _rerun_problem(patches, result, module)
        if problem:
            # A bug in the library: apply none of this file's patches rather than guess.
            refuse_all(result, problem)
    return result


def spliced_code(before: Any, before_text: str, after: Any) -> str:
    """`after.code`, generated only for the statements that differ from `before` (whose code is
    `before_text`) and spliced into that text.

    A patch rebuilds a few statements of a 5,000-line module; generating the whole module's
    text again was the costliest part of a plan. libcst keeps every untouched node as the
    same object, so the changed statements are found by identity (down through blocks and
    `elif` chains), generated with the indentation of the blocks around them (the same
    tokens the whole module's codegen emits there), and their old text, which must occur
    exactly once, is replaced. Anything else (a changed module header, an ambiguous old text,
    a libcst without this internal API) falls back to generating the whole module.
    """
    try:
        from libcst._nodes.internal import CodegenState

        spans = _changed_statements(before, after)
        if spans is None:
            return str(after.code)
        old_nodes, new_nodes, indents, elif_ = spans

        def generate(nodes: Sequence[Any]) -> str:
            state = CodegenState(
                default_indent=after.default_indent, default_newline=after.default_newline
            )
            state.indent_tokens.extend(indents)
            for node in nodes:
                if elif_:
                    node._codegen(state, is_elif=True)
                else:
                    node._codegen(state)
            return "".join(state.tokens)

        old, new = generate(old_nodes), generate(new_nodes)
        if not old or before_text.count(old) != 1:
            return str(after.code)
        return before_text.replace(old, new, 1)
    except Exception:  # an internal API that moved: the whole module, as before
        return str(after.code)


def _only_changed(old: Any, new: Any, field_name: str) -> bool:
    """Whether `old` and `new` (one node type) differ in `field_name` alone, by identity."""
    return type(old) is type(new) and all(
        getattr(old, f) is getattr(new, f) for f in old.__dataclass_fields__ if f != field_name
    )


def _changed_statements(
    before: Any, after: Any
) -> tuple[list[Any], list[Any], list[str], bool] | None:
    """The smallest run of statements (or one `elif`) that differ, in both trees, the
    indentation of the blocks holding them, and whether it is an `elif`; None when the change
    is not inside statement lists alone."""
    import libcst as cst

    if before is after or (before.header, before.footer) != (after.header, after.footer):
        return None
    old_body, new_body = list(before.body), list(after.body)
    indents: list[str] = []
    while True:
        a = 0
        while a < min(len(old_body), len(new_body)) and old_body[a] is new_body[a]:
            a += 1
        b = 0
        while (
            b < min(len(old_body), len(new_body)) - a
            and old_body[len(old_body) - 1 - b] is new_body[len(new_body) - 1 - b]
        ):
            b += 1
        old_run, new_run = old_body[a : len(old_body) - b], new_body[a : len(new_body) - b]
        if not old_run:
            # A pure insertion: anchor it on a neighbour that did not change.
            if a > 0:
                a -= 1
            elif b > 0:
                b -= 1
            else:
                return None
            old_run, new_run = old_body[a : len(old_body) - b], new_body[a : len(new_body) - b]
        if len(old_run) != 1 or len(new_run) != 1:
            return old_run, new_run, indents, False
        old, new = old_run[0], new_run[0]
        elif_ = False
        # Down an `elif` chain whose earlier branches did not change.
        while isinstance(old, cst.If) and _only_changed(old, new, "orelse"):
            if isinstance(old.orelse, cst.If) and isinstance(new.orelse, cst.If):
                old, new, elif_ = old.orelse, new.orelse, True
                continue
            if isinstance(old.orelse, cst.Else) and _only_changed(old.orelse, new.orelse, "body"):
                old, new = old.orelse, new.orelse
            break
        block_old, block_new = getattr(old, "body", None), getattr(new, "body", None)
        if (
            isinstance(block_old, cst.IndentedBlock)
            and isinstance(block_new, cst.IndentedBlock)
            and _only_changed(old, new, "body")
            and _only_changed(block_old, block_new, "body")
        ):
            # Only the statements inside this block changed: look inside it.
            indent = block_old.indent
            indents.append(before.default_indent if indent is None else indent)
            old_body, new_body = list(block_old.body), list(block_new.body)
            continue
        if isinstance(old, cst.Else):
            return None  # an `else:` header alone is not a statement to generate
        return [old], [new], indents, elif_


def refuse_all(result: FileResult, reason: str) -> None:
    """Turn every applied patch of `result` into a refusal and drop its changes."""
    applied_ids = {pid for pid, _ in result.steps}
    result.outcomes = [
        replace(o, status=Status.REFUSED, reason=reason) if o.patch in applied_ids else o
        for o in result.outcomes
    ]
    result.after = result.before
    result.steps = []


def _rerun_problem(patches: Sequence[Patch], result: FileResult, final: cst.Module) -> str | None:
    """Running the patches again on their own result must change nothing (DESIGN s3 verify)."""
    applied_ids = {pid for pid, _ in result.steps}
    for patch in patches:
        if patch.id not in applied_ids:
            continue
        try:
            again = patch.transform(final)
        except Exception as exc:
            return f"expected a second run to be a no-op; {patch.id} raised {exc!r}"
        if again.status not in (Status.ALREADY_APPLIED, Status.UPSTREAM):
            return (
                f"expected a second run to be a no-op; {patch.id} said {again.status.value} "
                f"({again.reason})"
            )
    return None


def _compile_problem(text: str, file: str) -> str | None:
    try:
        compile(text, file, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"a syntax error at line {exc.lineno}: {exc.msg}"
    return None
