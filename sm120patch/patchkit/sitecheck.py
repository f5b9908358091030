"""A patch's independent check: on Python's own syntax tree (`ast`), did the patch change the
node it means to and nothing else?

Every patch module declares one (`Patch(check=...)`, a `Check`); the real-release tier
(tests/real/test_sites.py) runs it on the file before and after the patch, on every release of
its pins. A check is written with `ast` and these helpers only, never with libcst or the
patch's own transform helpers, so that a mistake of the transform is not repeated by what
checks it. String search would pass a patch that put `_is_sm120_supported` into a comment, a
docstring or the wrong function; a check parses both sides and compares nodes.

A check fails by raising AssertionError with what it found (it is a test's oracle, run by
pytest, never by the engine), and returns the line spans (1-based, inclusive, before and after)
that the patch was allowed to touch, which `only_in` holds the diff to.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from sm120patch.patchkit.facts import Fact

Span = tuple[int, int]
T = TypeVar("T")

_ARCH = re.compile(r"^_?is_sm(\d+)(?:_supported)?$")


@dataclass
class Spans:
    """The lines a patch may touch: removed or changed in `before`, added or changed in
    `after`."""

    before: list[Span] = field(default_factory=list)
    after: list[Span] = field(default_factory=list)


# A patch's independent check: the release's tree, the patched tree, the fact covering the
# release -> the lines the patch may touch; AssertionError where the patch did something else.
Check = Callable[[ast.Module, ast.Module, Fact], Spans]

Located = ast.stmt | ast.expr  # the nodes that carry line numbers


# ----------------------------------------------------------------------------- finding nodes


def walk_scoped(tree: ast.AST) -> Iterator[tuple[str, ast.AST, list[ast.AST]]]:
    """Every node in a fixed pre-order with the qualified name of its enclosing function or
    class ("" at module level) and its ancestors, nearest last."""

    def visit(
        node: ast.AST, scope: list[str], parents: list[ast.AST]
    ) -> Iterator[tuple[str, ast.AST, list[ast.AST]]]:
        for child in ast.iter_child_nodes(node):
            yield ".".join(scope), child, parents
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
            yield from visit(child, inner, [*parents, child])

    yield from visit(tree, [], [tree])


def arch_of(node: ast.AST) -> int | None:
    """The SM major an operand tests: `_is_sm100_supported`, `is_sm100_supported()` and
    `get_platform().is_sm100` all test 100."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        node = node.func
    name = None
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    match = _ARCH.match(name or "")
    return int(match.group(1)) if match else None


def or_groups(tree: ast.AST) -> list[tuple[str, ast.BoolOp, list[ast.AST]]]:
    """Every `a or b ...` whose operands include an SM-arch test, with scope and ancestors."""
    return [
        (scope, node, parents)
        for scope, node, parents in walk_scoped(tree)
        if isinstance(node, ast.BoolOp)
        and isinstance(node.op, ast.Or)
        and any(arch_of(v) is not None for v in node.values)
    ]


Function = ast.FunctionDef | ast.AsyncFunctionDef


def functions(tree: ast.AST, qualname: str) -> list[Function]:
    """The functions named `qualname` (`Class.method` for a method), at any depth."""
    return [
        node
        for scope, node, _ in walk_scoped(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and ".".join(filter(None, [scope, node.name])) == qualname
    ]


def one_function(tree: ast.AST, qualname: str | None) -> Function:
    return one(functions(tree, qualname or ""), f"`def {qualname}`")


def one(found: Sequence[T], what: str) -> T:
    """The one item of `found`; AssertionError naming `what` when there are none or more."""
    assert len(found) == 1, f"expected one {what}, found {len(found)}"
    return found[0]


def direct_if(body: Sequence[ast.stmt], test: str) -> ast.If:
    """The one `if` directly in `body` whose test unparses to `test`."""
    return one([s for s in body if isinstance(s, ast.If) and ast.unparse(s.test) == test],
               f"`if {test}:`")


def ifs_testing(scope: ast.AST, test: str) -> list[ast.If]:
    """The `if` statements under `scope`, at any depth, whose test unparses to `test`."""
    return [n for n in ast.walk(scope) if isinstance(n, ast.If) and ast.unparse(n.test) == test]


def one_if(scope: ast.AST, test: str) -> ast.If:
    """The one `if` under `scope`, at any depth, whose test unparses to `test`."""
    return one(ifs_testing(scope, test), f"`if {test}:`")


def span(node: Located) -> Span:
    return node.lineno, node.end_lineno or node.lineno


def statement_span(parents: list[ast.AST], node: ast.AST) -> Span:
    """The lines of the nearest statement holding `node`; for a compound statement only its
    header expression (an `if`'s test), never its body."""
    chain = [*parents, node]
    for i in range(len(chain) - 1, -1, -1):
        stmt = chain[i]
        if isinstance(stmt, ast.stmt):
            child = chain[i + 1] if i + 1 < len(chain) else stmt
            if isinstance(stmt, (ast.If, ast.While)) and child is stmt.test:
                return span(stmt.test)
            return span(stmt)
    raise AssertionError("node outside any statement")


def with_blank_lines(node: Located, lines: int) -> Span:
    """The node's lines and the blank lines the patch put with it (a diff may count the ones
    above or the ones below the node as the added ones)."""
    lo, hi = span(node)
    return lo - lines, hi + lines


# ----------------------------------------------------------------------------- names and imports


def imported(tree: ast.Module) -> dict[str, tuple[str, Span]]:
    """Name bound by a module-level `from X import name` -> (X, the statement's lines)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, span(node))
    return out


def module_bindings(tree: ast.Module) -> set[str]:
    """The names a module binds at module level: imports, assignments, defs and classes."""
    names: set[str] = set(imported(tree))
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def defines(text: str, name: str) -> bool:
    """Whether a module's source binds `name` at module level (a def or an assignment)."""
    return name in module_bindings(ast.parse(text))


def sm120_names_used(tree: ast.AST) -> set[str]:
    return {
        n.id for n in ast.walk(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and arch_of(n) == 120
    }


def import_changes(before: ast.Module, after: ast.Module) -> Spans:
    """Imports may only gain SM120 names; their statements' lines may change."""
    b, a = imported(before), imported(after)
    lost = set(b) - set(a)
    gained = set(a) - set(b)
    assert not lost, f"imports removed: {sorted(lost)}"
    assert all(arch_of(ast.Name(n)) == 120 for n in gained), f"imports added: {sorted(gained)}"
    spans = Spans()
    for name in gained:
        module, lines = a[name]
        spans.after.append(lines)
        # the statement it joined, if it joined one (same module, overlapping lines)
        spans.before += [s for m, s in b.values() if m == module and s[0] <= lines[1]
                         and s[1] >= lines[0] - 1]
    return spans


def requires_sm120_import(after: ast.Module) -> None:
    assert "is_sm120_supported" in module_bindings(after), "is_sm120_supported not imported"


def drop_import(tree: ast.Module, name: str) -> ast.Module:
    """`tree` with `name` taken out of the module-level `from ... import` that brings it."""
    tree = copy.deepcopy(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            node.names = [a for a in node.names if a.name != name]
    return tree


# ----------------------------------------------------------------------------- taking a change out


def without(tree: ast.Module, drop: list[ast.stmt]) -> ast.Module:
    """A copy of `tree` without the statements `drop` (nodes of `tree`, at any depth)."""
    memo: dict[int, object] = {}
    copied = copy.deepcopy(tree, memo)
    gone = {id(memo[id(n)]) for n in drop}
    for node in ast.walk(copied):
        for name in ("body", "orelse"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                block[:] = [s for s in block if id(s) not in gone]
    return copied


def same_but(before: ast.Module, restored: ast.Module, what: str) -> None:
    """`restored` (the patched tree with the patch's change taken out) is the release's."""
    assert ast.dump(restored) == ast.dump(before), f"more than {what} changed"


def switch_before_gate(
    before: ast.Module, after: ast.Module, fact: Fact, gate: str, switch: str
) -> tuple[ast.If, Spans]:
    """The check of `operations.switch_before_gate`: in the fact's function, the statement
    right before the one `if` whose test unparses to `gate` is exactly `switch` (source), and
    with it taken out the file is the release's. The gate and the spans of the switch and the
    two comment lines above it."""

    def is_gate(stmt: ast.stmt) -> bool:
        return isinstance(stmt, ast.If) and ast.unparse(stmt.test) == gate

    holders: list[list[ast.stmt]] = []
    for node in ast.walk(one_function(after, fact.function)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and any(is_gate(s) for s in body):
            holders.append(body)
    body = one(holders, "block holding the gate")
    i = next(i for i, s in enumerate(body) if is_gate(s))
    assert i > 0, "nothing before the gate"
    new, found = body[i - 1], body[i]
    want = ast.parse(switch).body[0]
    assert ast.dump(new) == ast.dump(want), f"before the gate: `{ast.unparse(new)}`"
    same_but(before, without(after, [new]), "the switch")
    assert isinstance(found, ast.If)
    return found, Spans([], [(new.lineno - 2, new.end_lineno or new.lineno)])


def helper_after(after: ast.Module, site: str | None, helper: str, source: str) -> ast.FunctionDef:
    """The module-level `def helper` right after `def site`, exactly `source`."""

    def defs(name: str | None) -> list[int]:
        return [i for i, n in enumerate(after.body)
                if isinstance(n, ast.FunctionDef) and n.name == name]

    [i] = defs(site) or [-1]
    assert i >= 0, f"no module-level def {site}"
    assert defs(helper) == [i + 1], f"def {helper} is not right after def {site}"
    node = after.body[i + 1]
    assert isinstance(node, ast.FunctionDef)
    assert ast.dump(node) == ast.dump(ast.parse(source).body[0]), f"def {helper} is not ours"
    return node


def only_in(before: str, after: str, allowed: Spans) -> None:
    """Every line the patch removed or changed lies in `allowed.before`; every line it added or
    changed lies in `allowed.after`."""
    import difflib

    old, new = before.splitlines(), after.splitlines()

    def inside(lo: int, hi: int, spans: list[Span]) -> bool:  # 0-based [lo, hi)
        return all(any(s <= line + 1 <= e for s, e in spans) for line in range(lo, hi))

    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        assert inside(i1, i2, allowed.before), (
            f"lines {i1 + 1}-{i2} changed outside the site: {old[i1:i2]!r}"
        )
        assert inside(j1, j2, allowed.after), (
            f"lines {j1 + 1}-{j2} added outside the site: {new[j1:j2]!r}"
        )


# ----------------------------------------------------------------------------- shared checks


def widened_or(before: ast.Module, after: ast.Module, fact: Fact, tp: int | None = None
               ) -> Spans:
    """Exactly one `(sm90 or sm100)` group, in the fact's function, gains one operand that
    tests SM120 in the same form as its SM100 operand; every other group and every operand it
    had stay as they were (the fusion gate, backend and auto-enable sites). With `tp`, the new
    operand is `(<sm120> and <first parameter>.tp_size == tp)` (the auto-enable)."""
    old, new = or_groups(before), or_groups(after)
    assert len(old) == len(new), f"{len(old)} arch or-groups before, {len(new)} after"
    changed = [(o, n) for o, n in zip(old, new, strict=True)
               if ast.dump(o[1]) != ast.dump(n[1])]
    assert len(changed) == 1, f"{len(changed)} arch or-groups changed, expected 1"
    (_, group_o, parents_o), (scope_n, group_n, parents_n) = changed[0]
    assert scope_n == fact.function, f"the widened group is in {scope_n}, not {fact.function}"
    archs = [arch_of(v) for v in group_o.values]
    assert 90 in archs and 100 in archs, f"the widened group was `{ast.unparse(group_o)}`"
    assert len(group_n.values) == len(group_o.values) + 1, f"now `{ast.unparse(group_n)}`"
    receiver = _first_param(after, fact) if tp is not None else ""
    added = [v for v in group_n.values if _sm120_check(v, tp, receiver) is not None]
    assert len(added) == 1, f"now `{ast.unparse(group_n)}`"
    kept = [ast.dump(v) for v in group_n.values if v is not added[0]]
    assert kept == [ast.dump(v) for v in group_o.values], (
        f"operands changed: `{ast.unparse(group_o)}` -> `{ast.unparse(group_n)}`"
    )
    sm100 = group_o.values[archs.index(100)]
    check = _sm120_check(added[0], tp, receiver)
    assert check is not None
    assert ast.dump(check) == ast.dump(sm100).replace("sm100", "sm120"), (
        f"SM120 operand `{ast.unparse(added[0])}` is not in the form of `{ast.unparse(sm100)}`"
    )
    if fact.form == "utils":
        requires_sm120_import(after)
    spans = import_changes(before, after)
    spans.before.append(statement_span(parents_o, group_o))
    spans.after.append(statement_span(parents_n, group_n))
    return spans


def _sm120_check(node: ast.expr, tp: int | None, receiver: str) -> ast.expr | None:
    """The SM120 check `node` is (`tp` None), or the one in `(<sm120> and <receiver>.tp_size ==
    tp)`; None for anything else."""
    if tp is None:
        return node if arch_of(node) == 120 else None
    if not (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And)
            and len(node.values) == 2):
        return None
    check, size = node.values
    want = ast.Compare(
        left=ast.Attribute(value=ast.Name(id=receiver, ctx=ast.Load()), attr="tp_size",
                           ctx=ast.Load()),
        ops=[ast.Eq()], comparators=[ast.Constant(value=tp)],
    )
    if arch_of(check) != 120 or ast.dump(size) != ast.dump(want):
        return None
    return check


def _first_param(tree: ast.Module, fact: Fact) -> str:
    """The first parameter of the fact's function: what it reads the server arguments through."""
    func = one_function(tree, fact.function)
    assert func.args.args, f"`def {fact.function}` has no parameter"
    return func.args.args[0].arg


def widened_bare(before: ast.Module, after: ast.Module, fact: Fact, owner: str,
                 tp: int | None = None) -> Spans:
    """A bare `if is_sm100_supported():` inside the `if` naming `owner` becomes
    `if is_sm100_supported() or is_sm120_supported():` (with `tp`, `... or
    (is_sm120_supported() and self.tp_size == tp)`); every other `if` stays as it was."""

    def ifs(tree: ast.Module) -> list[tuple[ast.If, list[ast.AST]]]:
        func = one_function(tree, fact.function)
        return [(n, p) for _, n, p in walk_scoped(func) if isinstance(n, ast.If)]

    old, new = ifs(before), ifs(after)
    assert len(old) == len(new), f"{len(old)} ifs before, {len(new)} after"
    changed = [(o, n) for o, n in zip(old, new, strict=True)
               if ast.dump(o[0].test) != ast.dump(n[0].test)]
    assert len(changed) == 1, f"{len(changed)} if-tests changed, expected 1"
    (if_o, _), (if_n, parents_n) = changed[0]
    assert arch_of(if_o.test) == 100, f"the widened test was `{ast.unparse(if_o.test)}`"
    test = if_n.test
    assert isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or), ast.unparse(test)
    receiver = _first_param(after, fact) if tp is not None else ""
    assert len(test.values) == 2 and ast.dump(test.values[0]) == ast.dump(if_o.test), (
        f"now `{ast.unparse(test)}`")
    check = _sm120_check(test.values[1], tp, receiver)
    assert check is not None and ast.dump(check) == ast.dump(if_o.test).replace(
        "sm100", "sm120"), f"now `{ast.unparse(test)}`"
    owners = [ast.unparse(p.test) for p in parents_n if isinstance(p, ast.If)]
    assert any(owner in o for o in owners), f"inside {owners}"
    requires_sm120_import(after)
    spans = import_changes(before, after)
    spans.before.append(span(if_o.test))
    spans.after.append(span(if_n.test))
    return spans


def _lead(test: ast.expr) -> ast.expr:
    """The arch check a MoE branch tests: its test, or the first operand of its `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return test.values[0]
    return test


def _branch_on(body: list[ast.stmt], arch: int) -> list[ast.If]:
    """The branches (if or elif) of the if statements directly in `body` testing an
    SM-`arch` check: exactly, or as the first operand of an `and` (MiniMax-M2's `if <sm100> and
    ... == "modelopt_fp4":`). A nested check is another site's (Qwen3-Next's attention
    backend inside the Qwen3 MoE branch, 0.5.10 on)."""
    branches = []
    for first in body:
        stmt: ast.stmt | None = first
        while isinstance(stmt, ast.If):
            branches.append(stmt)
            stmt = stmt.orelse[0] if len(stmt.orelse) == 1 else None
    return [b for b in branches if arch_of(_lead(b.test)) == arch]


def _moe_scope(tree: ast.Module, fact: Fact, model: str) -> list[ast.stmt]:
    """The statements holding a model's MoE choice: the fact's function's body, or in
    server_args.py the model's branch of the big `model_arch in [...]` chain."""
    func = one_function(tree, fact.function)
    if not (fact.file and fact.file.endswith("server_args.py")):
        return func.body
    hits = [n for n in ast.walk(func) if isinstance(n, ast.If)
            and isinstance(n.test, ast.Compare)
            and model in ast.unparse(n.test)
            and ast.unparse(n.test).startswith("model_arch in")]
    assert len(hits) == 1, f"{len(hits)} `model_arch in [\"{model}\"]` branches"
    return hits[0].body


def moe_choice(before: ast.Module, after: ast.Module, fact: Fact, model: str) -> Spans:
    """A model's MoE runner choice (GLM-4 MoE, the Qwen3 MoE family, MiniMax-M2): beside the
    unchanged SM100 branch, right after it, an SM120 branch that sets the MoE runner backend to
    flashinfer_cutlass for modelopt_fp4 alone when the user left it on auto, with its own log
    line, writing no quantization field."""
    old_scope, new_scope = _moe_scope(before, fact, model), _moe_scope(after, fact, model)
    old100, new100 = _branch_on(old_scope, 100), _branch_on(new_scope, 100)
    assert len(old100) == 1 and len(new100) == 1, f"SM100 branches {len(old100)}/{len(new100)}"
    assert not _branch_on(old_scope, 120), "the release already has an SM120 branch"
    assert [ast.dump(s) for s in [new100[0].test, *new100[0].body]] == [
        ast.dump(s) for s in [old100[0].test, *old100[0].body]
    ], "the SM100 branch changed"
    new120 = _branch_on(new_scope, 120)
    assert len(new120) == 1, f"{len(new120)} SM120 branches"
    branch = new120[0]
    assert new100[0].orelse[:1] == [branch], "the SM120 branch is not right after the SM100 one"
    want_form = ast.Call if fact.form == "utils" else ast.Attribute
    assert isinstance(_lead(branch.test), want_form), f"SM120 test `{ast.unparse(branch.test)}`"
    sets = [n for n in ast.walk(branch) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and n.value.value == "flashinfer_cutlass"
            and any("moe_runner_backend" in ast.unparse(t) for t in n.targets)]
    assert len(sets) == 1, "no `moe_runner_backend = \"flashinfer_cutlass\"` in the SM120 branch"
    constants = {n.value for n in ast.walk(branch) if isinstance(n, ast.Constant)}
    assert {"modelopt_fp4", "auto"} <= constants, (
        "the SM120 branch does not keep the modelopt_fp4 / moe_runner_backend == 'auto' guard"
    )
    others = {"fp8", "modelopt_mixed", "flashinfer_trtllm", "flashinfer_trtllm_routed", "marlin"}
    assert not others & constants, f"another choice kept in the SM120 branch: {constants}"
    written = {ast.unparse(t) for n in ast.walk(branch) if isinstance(n, ast.Assign)
               for t in n.targets}
    assert not written & {"self.quantization", "overrides['quantization']"}, written
    logs = [n for n in ast.walk(branch) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "info"
            and "flashinfer_cutlass" in ast.unparse(n)]
    assert logs, "no log line naming flashinfer_cutlass in the SM120 branch"
    if fact.form == "utils":
        requires_sm120_import(after)
    spans = import_changes(before, after)
    # The SM100 `if` (now maybe with an elif) and an SM120 `if` right after it.
    spans.before.append(span(old100[0]))
    lo, hi = span(new100[0])
    lo2, hi2 = span(branch)
    spans.after.append((min(lo, lo2), max(hi, hi2)))
    return spans


KeywordLists = dict[str, list[tuple[object, ast.Call, list[ast.AST]]]]


def keyword_lists(tree: ast.Module, keyword: str) -> KeywordLists:
    """Per scope, every call's `keyword=<literal>`: (its value, the call, the call's ancestors)."""
    out: KeywordLists = {}
    for scope, node, parents in walk_scoped(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == keyword:
                    out.setdefault(scope, []).append((ast.literal_eval(kw.value), node, parents))
    return out


def extended_keyword_list(
    before: ast.Module, after: ast.Module, fact: Fact, keyword: str, add: object
) -> Spans:
    """The fact's function's one `keyword=[...]` list gains `add` at its end and nothing else
    in it changes; every other scope's `keyword` lists stay as they were (what the kit's
    `extend_keyword_list` means to do, checked without it: FlashInfer's comm-arch site, and
    what `new-patch --keyword` writes)."""
    old, new = keyword_lists(before, keyword), keyword_lists(after, keyword)
    site = fact.function or ""
    old_list = one([v for v, _, _ in old.get(site, [])], f"`{keyword}=` in {site}")
    assert isinstance(old_list, list) and old_list and add not in old_list, f"before: {old_list}"
    now = [v for v, _, _ in new.get(site, [])]
    assert now == [[*old_list, add]], f"after: {now}"
    for scope in set(old) | set(new):
        if scope != site:
            assert [v for v, _, _ in old.get(scope, [])] == [v for v, _, _ in new.get(scope, [])], (
                f"{scope}'s {keyword} changed"
            )
    (_, call_o, parents_o), (_, call_n, parents_n) = old[site][0], new[site][0]
    return Spans([statement_span(parents_o, call_o)], [statement_span(parents_n, call_n)])

