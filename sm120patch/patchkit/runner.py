"""The runner: every patch of a profile that touches one file, run in order on one parse.

Text in, outcomes out, no I/O. A transform's raised `Refuse` or `NotApplicable` becomes the
`Result` it carries (`run_transform`), as libcst's codemod runner turns `SkipFile` into a skip;
any other exception inside a transform becomes a refusal (a wrong patch is worse than no
patch). The result must parse and compile, and a second run of the same patches must find
everything already applied.

A transform requests the imports its code needs (`Result.imports`), as a libcst codemod asks
`AddImportsVisitor` for them, and the runner places them (`settle_imports`): right after the
transform that asked, so that every step the engine commits is whole, and once (a name an
earlier patch or the file already imports is left alone). One it cannot place refuses that
patch, as a requested import missing beside a change already made does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

# libcst and the kit's tree modules are imported inside the functions that parse or rewrite:
# the engine's layouts and the plan wing import `FileResult` from here on every warm command
# (`status`, `ensure`, `revert` on an applied tree), which parse nothing.
if TYPE_CHECKING:
    import libcst as cst

from sm120patch.patchkit.model import (
    Import,
    Outcome,
    Patch,
    Result,
    Status,
    Stop,
    Transform,
    refused,
)


@dataclass
class FileResult:
    """All patches of a profile that touch one file, run in order on one parse."""

    file: str
    before: str
    after: str
    outcomes: list[Outcome] = field(default_factory=list)
    # The module after each applied patch, in order, and the text after it: the engine commits
    # one patch at a time.
    steps: list[tuple[str, Any]] = field(default_factory=list)
    texts: list[tuple[str, str]] = field(default_factory=list)
    tree: Any = None  # the parsed original, for checks that compare before and after

    @property
    def changed(self) -> bool:
        return self.after != self.before

    def step_texts(self) -> list[tuple[str, str]]:
        """(patch id, text after it) for each applied patch, in order."""
        return list(self.texts)

    def imports_added(self) -> set[tuple[str, str]]:
        """(module, name) of each module-level `from <module> import name` the patches added."""
        from sm120patch.patchkit import imports

        if not self.steps:
            return set()
        return imports.imported_from(self.steps[-1][1]) - imports.imported_from(self.tree)

    def forget_trees(self) -> None:
        """Keep the texts and outcomes, drop the trees (once the imports the patches added
        are checked: `imports_added` has nothing to compare after this)."""
        self.tree = None
        self.steps = []

    def drop_changes(self) -> None:
        """Keep the outcomes, forget every change (`refuse_all`)."""
        self.after = self.before
        self.steps = []
        self.texts = []


def forget_parses() -> None:
    """Drop the trees `_parsed` and the walks of `syntax` keep (`planner.plan`, once its plan
    is made)."""
    from sm120patch.patchkit import syntax

    _parsed.cache_clear()
    syntax.forget_walks()


@lru_cache(maxsize=4)
def _parsed(text: str) -> cst.Module:
    """The tree of `text`. libcst trees are immutable, so the plans of one text share it:
    `matrix` plans every profile on each release, and parsing server_args.py once instead of
    once per profile is most of its time. (A text that does not parse raises every time.)"""
    import libcst as cst

    return cst.parse_module(text)


def run_transform(transform: Transform, module: cst.Module) -> Result:
    """What `transform` says of `module`: the `Result` it returns, or the one its raised
    `Refuse` / `NotApplicable` carries. Any other exception goes on to the caller, which
    turns it into a refusal worded for where it ran (`transform_text`, `_rerun_problem`)."""
    try:
        return transform(module)
    except Stop as stop:
        return stop.result


def transform_text(
    patches: Sequence[Patch], file: str, text: str, *, sieve: bool = True
) -> FileResult:
    """`_transform_text`, where a file nested too deep for Python's parser, compiler or a
    walk of its tree (an expression thousands deep, planted) refuses each patch of it."""
    try:
        return _transform_text(patches, file, text, sieve=sieve)
    except RecursionError:
        result = FileResult(file=file, before=text, after=text)
        why = "the file nests too deep for Python to parse (RecursionError); restore it first"
        result.outcomes = [
            Outcome(p.id, p.target, file, "<module>", Status.REFUSED, why) for p in patches
        ]
        return result


def _transform_text(
    patches: Sequence[Patch], file: str, text: str, *, sieve: bool = True
) -> FileResult:
    """Parse `text` once and run each patch on it in order, chaining the applied changes.

    A patch whose sought names (`Patch.sought`) are all absent from `text` is not-applicable
    without running, as its transform promises; when that is every patch of the file, the
    file is not parsed at all (on SGLang 0.5.8, modelopt_quant.py and flashinfer_comm_fusion.py
    in a plan of `all`: about 0.2 s of CPU). `sieve=False` runs every transform on the parse,
    for the tests that hold the two ways equal."""
    import libcst as cst

    result = FileResult(file=file, before=text, after=text)
    absent = {
        p.id: res for p in patches if sieve and p.sought and (res := p.sought.absent_from(text))
    }
    if len(absent) == len(patches):
        result.outcomes = [_outcome(p, file, absent[p.id]) for p in patches]
        return result
    try:
        module = _parsed(text)
        result.tree = module
    except cst.ParserSyntaxError as exc:
        line = f"line {exc.raw_line}" if exc.raw_line else "unknown line"
        for patch in patches:
            if patch.id in absent:  # as when no patch of the file needs the parse
                result.outcomes.append(_outcome(patch, file, absent[patch.id]))
                continue
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
        if patch.id in absent:
            result.outcomes.append(_outcome(patch, file, absent[patch.id]))
            continue
        try:
            res = settle_imports(run_transform(patch.transform, module), module)
        except Exception as exc:  # a patch bug must not half-apply anything
            res = refused(
                "<module>",
                "a shape this patch knows",
                f"an error inside the patch ({type(exc).__name__}: {exc})",
            )
        if res.status is Status.APPLIED:
            module = res.module
            result.steps.append((patch.id, module))
        result.outcomes.append(_outcome(patch, file, res))
    if result.steps:
        # Each step's change spliced into the text before it: the few statements one patch
        # rebuilt, where splicing every change into the original at once can mean generating
        # the one statement that holds them all (SGLang's whole ServerArgs class).
        tree = result.tree
        for pid, step in result.steps:
            text, tree = spliced_code(tree, text, step), step
            result.texts.append((pid, text))
        result.after = text
        problem = _compile_problem(result.after, file) or _rerun_problem(patches, result, module)
        if problem:
            # A bug in the library: apply none of this file's patches rather than guess.
            refuse_all(result, problem)
    return result


def _outcome(patch: Patch, file: str, res: Result) -> Outcome:
    return Outcome(patch.id, patch.target, file, res.site, res.status, res.reason, res.shape)


def settle_imports(res: Result, module: cst.Module) -> Result:
    """`res` with the imports it requests in place. Applied: each one not yet bound at module
    level goes into `res.module` (`patchkit.imports.add_import_after`, or `import_next_to`
    when the request names no module), and the shape says so; refused when one has no single
    import to join. Already applied: each must be bound in `module` already, else refused (a
    half-done edit whose code would raise NameError)."""
    from sm120patch.patchkit import imports

    if not res.imports or res.status not in (Status.APPLIED, Status.ALREADY_APPLIED):
        return res
    tree = res.module if res.status is Status.APPLIED else module
    added: list[str] = []
    for imp in dict.fromkeys(res.imports):
        if imports.binds_at_module_level(tree, imp.name):
            continue
        if res.status is Status.ALREADY_APPLIED:
            return refused(res.site, f"`{imp.name}` imported where it is used", "no such import")
        placed = _place(tree, imp)
        if placed is None:
            sources = imports.import_sources(tree, imp.next_to)
            holders = [m for m in sources if m == (imp.module or m)]
            return refused(
                res.site,
                f"one module-level `from {imp.module or '...'} import` naming {imp.next_to}, "
                f"to add {imp.name}",
                f"{len(holders)} such imports",
            )
        tree = placed
        added.append(imp.name)
    if not added:
        return res
    shape = "; ".join([*filter(None, [res.shape]), *(f"{name} imported" for name in added)])
    reason = f"patched ({shape})" if res.reason == f"patched ({res.shape})" else res.reason
    return replace(res, module=tree, shape=shape, reason=reason)


def _place(tree: cst.Module, imp: Import) -> cst.Module | None:
    from sm120patch.patchkit import imports

    if imp.module is None:
        return imports.import_next_to(tree, imp.name, imp.next_to)
    return imports.add_import_after(tree, imp.module, imp.name, after=imp.next_to)


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
    result.drop_changes()


def _rerun_problem(patches: Sequence[Patch], result: FileResult, final: cst.Module) -> str | None:
    """Running the patches again on their own result must change nothing (the verify step)."""
    applied_ids = {pid for pid, _ in result.steps}
    for patch in patches:
        if patch.id not in applied_ids:
            continue
        try:
            again = settle_imports(run_transform(patch.transform, final), final)
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
