"""Declared operations: the few shapes SM120 patches keep needing, each a libcst transform.

Each operation takes a parsed module (and, where the site is the patch's to find, the node it
works on) and returns a `model.Result`: `applied` with the new module, `already-applied`,
`upstream`, or `refused` with what it expected and what it found. A patch is then mostly a
declaration: which function, which keyword, which sibling, in which order.

Finding a site (as libcst's helpers do, a finder returns the node or raises; the runner turns
what it raises into the outcome, `runner.run_transform`):
- `one_def`: the one `def NAME` of a module (`NotApplicable` when absent, `Refuse` when
  several).
- `one_of_defs`: the one `def` of several names a site had across releases, else a method.

Changing it:
- `widen_arch_or`: `(sm90 or sm100)` gains one more check, SM120, in the release's own spelling
  (`is_sm120_supported()`, `get_platform().is_sm120`, `_is_sm120_supported`), and requests the
  import the call form needs.
- `extend_keyword_list`: `f(..., keyword=[9, 10])` inside one named function gains an element,
  the list keeping its layout for one element or many.
- `add_module_flag`: `NEW = <expr>` right after its sibling module flag.
- `add_elif`: a branch right after a branch found by its test.
- `add_first_branch`: a branch before the first branch of an if statement (which becomes an elif).
- `insert_before`: statements right before a statement of a block (after its comments).
- `switch_before_gate`: an `if` that lets a gate pass (an env switch back), right before that
  gate, an `if` that turns a feature off and returns.
- `insert_after`: statements right after a statement of a block (a class body included).
- `add_function_after`: a module-level function, from its source, right after a module-level def.
- `append_to_list`: a string appended to a module-level list of strings.
- `replace_statement`: a statement-level node (a class, a def) replaced by one the patch built.

Imports are not an operation: a result requests them (`Result.needing(Import(...))`) and the
runner places them once (`patchkit.runner.settle_imports`).

Like the patches, this module imports libcst inside the functions, so that loading the
catalog (`list`, `status`, `--help`) stays free of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import libcst as cst

from sm120patch.patchkit import arch
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.model import (
    NotApplicable,
    Refuse,
    Result,
    Status,
    already_applied,
    applied,
    refused,
    upstream,
)

SM120 = "sm120"


# ----------------------------------------------------------------------------- finding a site


def one_def(
    module: cst.Module, name: str, absent: str | None = None, *, site: str | None = None
) -> cst.FunctionDef:
    """The one `def name` (at any depth). Raises `NotApplicable` when there is none
    (`absent` says why), `Refuse` when there are several."""
    site = site or name
    funcs = h.functions(module, name)
    if not funcs:
        raise NotApplicable(site, absent or f"no `def {name}` in this file")
    if len(funcs) > 1:
        raise Refuse(site, f"one `def {name}`", f"{len(funcs)} definitions")
    return funcs[0]


def one_of_defs(
    module: cst.Module,
    names: Sequence[str],
    absent: str | None = None,
    *,
    fallback: tuple[str, str] | None = None,
    required: bool = False,
) -> tuple[str, cst.FunctionDef]:
    """(the name found, the def): the one `def` called one of `names` (a site renamed across
    releases), else the one method `fallback` (class, method) where the site lived before.

    None of them: raises `NotApplicable` (`absent` says why), or `Refuse` when `required`.
    Several (two names, or one defined twice): `Refuse`, naming them.
    """
    found = [(name, f) for name in names for f in h.functions(module, name)]
    site = " / ".join(names)
    every = [f"def {name}" for name in names] + ([".".join(fallback)] if fallback else [])
    if not found and fallback is not None:
        cls, method = fallback
        site = f"{cls}.{method}"
        found = [(site, f) for c in h.classes(module, cls) for f in h.functions(c, method)]
    if len(found) == 1:
        return found[0]
    wanted = f"one of {', '.join(every)}" if len(every) > 1 else f"one `{every[0]}`"
    if found:
        which = ", ".join(dict.fromkeys(name for name, _ in found))
        raise Refuse(site, wanted, f"{len(found)} definitions of {which}")
    if required:
        raise Refuse(site, wanted, "none of them")
    raise NotApplicable(site, absent or f"no {' nor '.join(every)} in this file")


# ----------------------------------------------------------------------------- widen an `or`


@dataclass(frozen=True)
class ArchGroup:
    """What an `or` of GPU-arch checks is, read with `cst_helpers.sglang_arch`."""

    archs: tuple[str, ...]  # in operand order; empty when an operand is not an arch check
    form: str  # "call", "platform" or "flag"; "" when operands mix forms or none is a check

    @property
    def known(self) -> bool:
        return bool(self.archs) and bool(self.form)


def read_arch_group(group: cst.BaseExpression) -> ArchGroup:
    """The archs and the one spelling of `a or b or ...` (a lone check counts as a group)."""
    operands = h.or_operands(group) or [group]
    found = [arch.sglang_arch(op) for op in operands]
    if any(f is None for f in found):
        return ArchGroup((), "")
    forms = {f[1] for f in found if f is not None}
    archs = tuple(f[0] for f in found if f is not None)
    return ArchGroup(archs, forms.pop() if len(forms) == 1 else "")


def widen_arch_or(
    module: cst.Module,
    group: cst.BaseExpression,
    scope: cst.CSTNode,
    *,
    site: str,
    expected: str,
    forms: Sequence[str] = ("call", "platform"),
    widen: frozenset[str] = frozenset({"sm90", "sm100"}),
    others_ok: bool = True,
    upstream_ok: bool = True,
    found: str | None = None,
) -> Result:
    """`(sm90 or sm100)` -> `(sm90 or sm100 or sm120)`, SM120 spelled as the group spells SM100.

    `group` lies inside `scope` (a statement: only it is rebuilt). Already-applied where the
    group tests SM120 (with `others_ok` False, only beside archs of `widen`); upstream where it
    tests every Blackwell (`is_blackwell_supported()`, when `upstream_ok`); refused for a group
    that is not exactly the archs of `widen` in one of `forms`. The applied shape reads
    `<old> -> <new>`. `found` overrides the text quoted in a refusal.
    """
    read = read_arch_group(group)
    shape = h.code(group)
    quoted = found or f"`{shape}`"
    if not read.known or read.form not in forms:
        return refused(site, expected, quoted)
    needs = arch.sglang_arch_import(SM120, read.form)
    if SM120 in read.archs and (others_ok or set(read.archs) - {SM120} <= widen):
        return already_applied(site, shape).needing(needs)
    if "blackwell" in read.archs and upstream_ok:
        return upstream(
            site, f"the release accepts every Blackwell GPU (SM120 included): `{shape}`"
        )
    if len(read.archs) != len(widen) or set(read.archs) != widen:  # any order
        return refused(site, expected, quoted)

    if not isinstance(group, cst.BooleanOperation):
        return refused(site, expected, quoted)  # one check alone: not an `or` to widen
    new_group = h.widen_or(group, arch.sglang_arch_check(SM120, read.form))
    new_module = h.replace(module, group, new_group, scope=scope)
    return applied(site, new_module, f"{shape} -> {h.code(new_group)}").needing(needs)


# ----------------------------------------------------------------------------- a list keyword


def extend_keyword_list(
    module: cst.Module, *, function: str, keyword: str, expect: Sequence[int], add: int,
    absent: str | None = None,
) -> Result:
    """`keyword=[*expect]` in the one call of the one `def function` -> `[*expect, add]`.

    The new element takes the separator the others use (`[9, 10]` -> `[9, 10, 12]`); a
    one-element list gets `, ` (`[10]` -> `[10, 12]`), and a trailing comma stays last.
    Already-applied where `add` is in the list; refused for any other list or call. It finds
    its function with `one_def`, so it raises as that finder does.
    """

    func = one_def(module, function, absent)
    want = f"`{keyword}={list(expect)}`"
    args = h.keyword_args(func, keyword)
    if len(args) != 1:
        return refused(function, f"one {want} argument", f"{len(args)} such arguments")
    value = args[0].value
    if not isinstance(value, cst.List) or not all(
        isinstance(el.value, cst.Integer) for el in value.elements
    ):
        return refused(function, want, f"`{h.code(args[0])}`")
    found = [el.value.evaluated_value for el in value.elements]  # type: ignore[attr-defined]
    if add in found:
        return already_applied(function, f"{keyword}={found}")
    if found != list(expect):
        return refused(function, want, f"`{h.code(args[0])}`")
    last = value.elements[-1]
    if len(value.elements) > 1:
        sep = value.elements[0].comma
    else:
        sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    elements = [
        *value.elements[:-1],
        last.with_changes(comma=sep),
        cst.Element(cst.Integer(str(add)), comma=last.comma),
    ]
    new_module = h.replace(module, value, value.with_changes(elements=elements), scope=func)
    new = [*expect, add]
    return applied(function, new_module, f"{keyword}={list(expect)} -> {new}")


# ----------------------------------------------------------------------------- a module flag


def add_module_flag(
    module: cst.Module, *, name: str, sibling: str, value: str, same: bool,
    expected: str | None = None,
) -> Result:
    """`name = value` right after the module-level `sibling = ...`.

    `same` says whether an existing `name = ...` is the intended one (the caller compares it):
    already-applied then, refused otherwise, as when `sibling` is not assigned exactly once.
    """
    anchors = h.module_assignments(module, sibling)
    if len(anchors) != 1:
        found = "none" if not anchors else f"{len(anchors)} assignments of {sibling}"
        return refused(name, expected or f"one module flag `{sibling} = ...`", found)
    existing = h.module_assignments(module, name)
    if len(existing) > 1:
        return refused(name, f"at most one `{name} = {value}`", f"{len(existing)} assignments")
    if existing:
        if not same:
            return refused(name, f"`{name} = {value}`", f"`{h.code(existing[0])}`")
        return already_applied(name, f"{name} = {value}")
    flag = h.parse_statement(f"{name} = {value}{module.default_newline}", module)
    return applied(name, h.insert_after(module, anchors[0], [flag]), f"{name} = {value}")


def then(first: Result, second: Result, *, shape: str | None = None) -> Result:
    """`first` followed by `second` on first's module, for a site that takes two changes:
    applied when `first` applied and `second` applied or had nothing to do; `first` unchanged
    when it did not apply; `second` when it refused. The shape and reason stay `first`'s (or
    `shape`); the imports both request are kept."""
    if first.status is not Status.APPLIED:
        return first
    if second.status is Status.REFUSED:
        return second
    module = second.module if second.status is Status.APPLIED else first.module
    both = (*first.imports, *second.imports)
    if shape is None:
        return applied(first.site, module, first.shape, first.reason).needing(*both)
    return applied(first.site, module, shape).needing(*both)


# ----------------------------------------------------------------------------- an elif branch


def if_chain(node: cst.If) -> list[cst.If]:
    """An if statement and its elif branches, in order."""
    out = [node]
    while isinstance(out[-1].orelse, cst.If):
        out.append(out[-1].orelse)
    return out


def branches_in(suite: cst.BaseSuite) -> list[cst.If]:
    """The if and elif branches of the if statements directly in `suite`."""
    body = suite.body if isinstance(suite, cst.IndentedBlock) else ()
    return [b for stmt in body if isinstance(stmt, cst.If) for b in if_chain(stmt)]


def new_elif(after: cst.If, test: cst.BaseExpression, body: cst.BaseSuite) -> cst.If:
    """The branch `elif test: body` to follow `after`, keeping `after`'s whitespace around the
    test; an elif or else that followed `after` follows the new branch."""
    return cst.If(
        test=test,
        body=body,
        orelse=after.orelse,
        whitespace_before_test=after.whitespace_before_test,
        whitespace_after_test=after.whitespace_after_test,
    )


def add_elif(module: cst.Module, after: cst.If, branch: cst.If, *, site: str, shape: str) -> Result:
    """`branch` (made by `new_elif`, checked by the caller) right after the branch `after`."""
    new_module = h.replace(module, after, after.with_changes(orelse=branch), scope=after)
    return applied(site, new_module, shape)


# ----------------------------------------------------------------------------- before a statement


def insert_before(
    module: cst.Module, anchor: cst.BaseStatement, new: Sequence[cst.BaseStatement], *,
    site: str, shape: str,
) -> Result:
    """`new` right before `anchor`, a compound statement of a block (or of the module), after
    the comment lines above `anchor`: those stay on top, `new` then `anchor` follow them."""

    block = h.parent_of(module, anchor)
    if not isinstance(block, (cst.Module, cst.IndentedBlock)):
        return refused(site, "a statement of an indented block", f"`{h.code(anchor)}`")
    body = list(block.body)
    index = next(i for i, stmt in enumerate(body) if stmt is anchor)
    first, *rest = new
    if not isinstance(anchor, cst.BaseCompoundStatement | cst.SimpleStatementLine) or not (
        isinstance(first, cst.BaseCompoundStatement | cst.SimpleStatementLine)
    ):
        return refused(site, "a statement with its leading lines", f"`{h.code(anchor)}`")
    moved = [
        first.with_changes(leading_lines=[*anchor.leading_lines, *first.leading_lines]),
        *rest,
        anchor.with_changes(leading_lines=()),
    ]
    body[index : index + 1] = moved
    new_block = block.with_changes(body=body)
    if isinstance(block, cst.Module):
        return applied(site, new_block, shape)  # type: ignore[arg-type]
    return applied(site, h.replace(module, block, new_block, scope=block), shape)


def switch_before_gate(
    module: cst.Module, gate: cst.If, switch: cst.If, *,
    is_switch: Callable[[cst.CSTNode], bool], env: str, shape: str,
) -> Result:
    """`switch` (an `if` setting the variable `gate` tests, so that it passes unless `env` says
    otherwise) right before `gate`, an `if` ending in `return` inside a function: the
    pcie-allreduce patches' one statement. Already applied where the one statement
    `is_switch` finds sits right before `gate`; refused where `gate` is not such an `if`, where
    one sits elsewhere, or where `gate` itself was edited to read `env`."""

    site = h.qualified_name(module, gate)
    block = h.parent_of(module, gate)
    siblings = list(block.body) if isinstance(block, cst.IndentedBlock) else []
    index = next((i for i, s in enumerate(siblings) if s is gate), None)
    wanted = f"`if {h.code(gate.test)}:`"
    if index is None:
        raise Refuse(site, f"{wanted} in an indented block", f"`if {h.code(gate.test)}`")
    if not (
        isinstance(gate.body, cst.IndentedBlock)
        and isinstance(gate.body.body[-1], cst.SimpleStatementLine)
        and isinstance(gate.body.body[-1].body[-1], cst.Return)
        and gate.orelse is None
    ):
        raise Refuse(site, f"{wanted} ending in `return`", f"`{h.code(gate)}`")
    ours = [n for n in h.statements(module) if is_switch(n)]
    if ours:
        if len(ours) == 1 and index > 0 and siblings[index - 1] is ours[0]:
            return already_applied(site, shape)
        raise Refuse(site, f"at most one {shape.partition(' before ')[0]}, right before the "
                     "gate", f"{len(ours)}, elsewhere")
    if env in module.code_for_node(gate):  # a hand edit of the gate itself
        raise Refuse(site, f"{wanted} as released", f"`if {h.code(gate.test)}`")
    return insert_before(module, gate, [switch], site=site, shape=shape)


# ----------------------------------------------------------------------------- a first branch


def add_first_branch(
    module: cst.Module, chain: cst.If, test: cst.BaseExpression, body: cst.BaseSuite, *,
    site: str, shape: str,
) -> Result:
    """`if test: body` before the first branch of the if statement `chain`, which follows it
    as an `elif` (its own elif and else branches after it): the comment lines above `chain`
    stay above the new `if`, and the new `if` takes `chain`'s whitespace around its test."""

    new_if = cst.If(
        test=test,
        body=body,
        orelse=chain.with_changes(leading_lines=()),
        leading_lines=chain.leading_lines,
        whitespace_before_test=chain.whitespace_before_test,
        whitespace_after_test=chain.whitespace_after_test,
    )
    return applied(site, h.replace(module, chain, new_if, scope=chain), shape)


# ----------------------------------------------------------------------------- after a statement


def insert_after(
    module: cst.Module, anchor: cst.BaseStatement, new: Sequence[cst.BaseStatement], *,
    site: str, shape: str,
) -> Result:
    """`new` right after `anchor`, a statement of a block (or of the module, or of a class
    body); the statement that followed `anchor` follows `new`."""

    block = h.parent_of(module, anchor)
    if not isinstance(block, (cst.Module, cst.IndentedBlock)):
        return refused(site, "a statement of an indented block", f"`{h.code(anchor)}`")
    body = list(block.body)
    index = next(i for i, stmt in enumerate(body) if stmt is anchor)
    body[index + 1 : index + 1] = list(new)
    new_block = block.with_changes(body=body)
    if isinstance(block, cst.Module):
        return applied(site, new_block, shape)  # type: ignore[arg-type]
    return applied(site, h.replace(module, block, new_block, scope=block), shape)


def add_function_after(
    module: cst.Module, anchor: cst.FunctionDef, source: str, *, site: str, shape: str = ""
) -> Result:
    """The function `source` (written with "\\n" newlines) at module level right after the
    module-level def `anchor`, two blank lines above it, in the module's own newline."""

    new = h.parse_statement(source.replace("\n", module.default_newline), module)
    new = new.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    if not any(stmt is anchor for stmt in module.body):
        return refused(site, "a module-level function to add the helper after", "a nested one")
    return insert_after(module, anchor, [new], site=site, shape=shape)


# ----------------------------------------------------------------------------- a list of strings


def append_to_list(
    module: cst.Module, *, name: str, add: str, expect: Sequence[str] = (), site: str | None = None,
) -> Result:
    """`NAME = [..., "x"]` -> `[..., "x", "add"]`, for the one module-level assignment of NAME
    to a list of string literals holding every string of `expect`. The new element takes the
    separator the others use (one per line stays one per line) and the last element's comma;
    already-applied where `add` is in the list; refused for any other value."""

    site = site or name
    stmts = h.module_assignments(module, name)
    want = f"one module-level `{name} = [...]` of strings"
    if len(stmts) != 1:
        return refused(site, want, f"{len(stmts)} such assignments")
    assign = stmts[0].body[0]
    value = assign.value  # type: ignore[attr-defined]
    if not isinstance(value, cst.List) or not value.elements or not all(
        isinstance(el.value, cst.SimpleString) for el in value.elements
    ):
        return refused(site, want, f"`{h.code(stmts[0])}`")
    found = [el.value.evaluated_value for el in value.elements]  # type: ignore[attr-defined]
    if add in found:
        return already_applied(site, f"{name} holds {add!r}")
    missing = [s for s in expect if s not in found]
    if missing:
        return refused(site, f"{name} holding {', '.join(map(repr, expect))}",
                       f"{found} (no {', '.join(map(repr, missing))})")
    last = value.elements[-1]
    if len(value.elements) > 1:
        sep = value.elements[0].comma
    else:
        sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    quote = last.value.quote  # type: ignore[attr-defined]
    elements = [
        *value.elements[:-1],
        last.with_changes(comma=sep),
        cst.Element(cst.SimpleString(f"{quote}{add}{quote}"), comma=last.comma),
    ]
    new_stmt = stmts[0].with_changes(
        body=[assign.with_changes(value=value.with_changes(elements=elements))]
    )
    body = [new_stmt if s is stmts[0] else s for s in module.body]
    return applied(site, module.with_changes(body=body), f"{name} += [{add!r}]")


# ----------------------------------------------------------------------------- a whole statement


def replace_statement(
    module: cst.Module, old: cst.CSTNode, new: cst.CSTNode, *, site: str, shape: str
) -> Result:
    """`module` with the statement-level node `old` (a class, a def, an if) replaced by `new`,
    which the patch built from it (and checked); only the blocks above `old` are rebuilt."""
    return applied(site, h.replace(module, old, new, scope=old), shape)
