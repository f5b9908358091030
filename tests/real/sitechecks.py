"""Checks, on the Python syntax tree, that a patch changed the node it means to and nothing else.

String search would pass a patch that put `_is_sm120_supported` into a comment, a docstring or
the wrong function; these checks parse the file before and after (`ast`) and compare nodes.
Each `check_<site>` raises AssertionError with what it found; each returns the line spans
(1-based, inclusive, before and after) that the patch was allowed to touch, for `only_in`.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from expected import Fact

Span = tuple[int, int]

_ARCH = re.compile(r"^_?is_sm(\d+)(?:_supported)?$")


@dataclass
class Spans:
    before: list[Span] = field(default_factory=list)
    after: list[Span] = field(default_factory=list)


# ----------------------------------------------------------------------------- tree helpers


def walk_scoped(tree: ast.AST) -> Iterator[tuple[str, ast.AST, list[ast.AST]]]:
    """Every node in a fixed pre-order with the qualified name of its enclosing function or
    class ("" at module level) and its ancestors, nearest last."""

    def visit(node: ast.AST, scope: list[str], parents: list[ast.AST]) -> Iterator:
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


def functions(tree: ast.AST, qualname: str) -> list[ast.AST]:
    out = []
    for scope, node, _ in walk_scoped(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if ".".join(filter(None, [scope, node.name])) == qualname:
                out.append(node)
    return out


def one_function(tree: ast.AST, qualname: str) -> ast.AST:
    found = functions(tree, qualname)
    assert len(found) == 1, f"expected one `def {qualname}`, found {len(found)}"
    return found[0]


def span(node: ast.AST) -> Span:
    return node.lineno, node.end_lineno or node.lineno  # type: ignore[attr-defined]


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


def imported(tree: ast.Module) -> dict[str, tuple[str, Span]]:
    """Name bound by a module-level `from X import name` -> (X, the statement's lines)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, span(node))
    return out


def module_bindings(tree: ast.Module) -> set[str]:
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
        spans.before += [s for n, (m, s) in b.items() if m == module and s[0] <= lines[1]
                         and s[1] >= lines[0] - 1]
    return spans


def only_in(before: str, after: str, allowed: Spans) -> None:
    """Every line the patch removed or changed lies in `allowed.before`; every line it added or
    changed lies in `allowed.after`."""
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


# ----------------------------------------------------------------------------- per site


def check_widened_or(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """Sites B, C, X: exactly one `(sm90 or sm100)` group, in the fact's function, gains one
    operand that tests SM120 in the same form as its SM100 operand; every other group and
    every operand it had stay as they were."""
    old, new = or_groups(before), or_groups(after)
    assert len(old) == len(new), f"{len(old)} arch or-groups before, {len(new)} after"
    changed = [(o, n) for o, n in zip(old, new, strict=True)
               if ast.dump(o[1]) != ast.dump(n[1])]
    assert len(changed) == 1, f"{len(changed)} arch or-groups changed, expected 1"
    (scope_o, group_o, parents_o), (scope_n, group_n, parents_n) = changed[0]
    assert scope_n == fact.function, f"the widened group is in {scope_n}, not {fact.function}"
    archs = [arch_of(v) for v in group_o.values]
    assert 90 in archs and 100 in archs, f"the widened group was `{ast.unparse(group_o)}`"
    assert len(group_n.values) == len(group_o.values) + 1, f"now `{ast.unparse(group_n)}`"
    added = [v for v in group_n.values if arch_of(v) == 120]
    assert len(added) == 1, f"now `{ast.unparse(group_n)}`"
    kept = [ast.dump(v) for v in group_n.values if v is not added[0]]
    assert kept == [ast.dump(v) for v in group_o.values], (
        f"operands changed: `{ast.unparse(group_o)}` -> `{ast.unparse(group_n)}`"
    )
    sm100 = group_o.values[archs.index(100)]
    assert ast.dump(added[0]) == ast.dump(sm100).replace("sm100", "sm120"), (
        f"SM120 operand `{ast.unparse(added[0])}` is not in the form of `{ast.unparse(sm100)}`"
    )
    if fact.form == "utils":
        assert "is_sm120_supported" in module_bindings(after), "is_sm120_supported not imported"
    spans = import_changes(before, after)
    spans.before.append(statement_span(parents_o, group_o))
    spans.after.append(statement_span(parents_n, group_n))
    return spans


def check_widened_bare(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """Site C on 0.5.4: the GptOss block's bare `if is_sm100_supported():` becomes
    `if is_sm100_supported() or is_sm120_supported():`; every other `if` stays as it was."""

    def ifs(tree: ast.Module) -> list[tuple[ast.If, list[ast.AST]]]:
        func = one_function(tree, fact.function or "")
        return [(n, p) for _, n, p in walk_scoped(func) if isinstance(n, ast.If)]

    old, new = ifs(before), ifs(after)
    assert len(old) == len(new), f"{len(old)} ifs before, {len(new)} after"
    changed = [(o, n) for o, n in zip(old, new, strict=True)
               if ast.dump(o[0].test) != ast.dump(n[0].test)]
    assert len(changed) == 1, f"{len(changed)} if-tests changed, expected 1"
    (if_o, parents_o), (if_n, parents_n) = changed[0]
    assert arch_of(if_o.test) == 100, f"the widened test was `{ast.unparse(if_o.test)}`"
    test = if_n.test
    assert isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or), ast.unparse(test)
    assert [ast.dump(v) for v in test.values] == [
        ast.dump(if_o.test), ast.dump(if_o.test).replace("sm100", "sm120")
    ], f"now `{ast.unparse(test)}`"
    owners = [ast.unparse(p.test) for p in parents_n if isinstance(p, ast.If)]
    assert any("GptOssForCausalLM" in o for o in owners), f"inside {owners}"
    assert "is_sm120_supported" in module_bindings(after), "is_sm120_supported not imported"
    spans = import_changes(before, after)
    spans.before.append(span(if_o.test))
    spans.after.append(span(if_n.test))
    return spans


def check_sm120_flag(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """Site A: `_is_sm120_supported = <the SM100 flag's expression, SM120>` right after the SM100
    flag, and `is_sm120_supported` imported where that form needs it."""

    def flag(tree: ast.Module, name: str) -> list[int]:
        return [i for i, n in enumerate(tree.body) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]

    assert not flag(before, "_is_sm120_supported"), "the release already has the flag"
    sm100 = flag(after, "_is_sm100_supported")
    sm120 = flag(after, "_is_sm120_supported")
    assert len(sm100) == 1 and len(sm120) == 1, f"SM100 flags {sm100}, SM120 flags {sm120}"
    assert sm120[0] == sm100[0] + 1, "the SM120 flag does not follow the SM100 flag"
    value100 = after.body[sm100[0]].value  # type: ignore[attr-defined]
    value120 = after.body[sm120[0]].value  # type: ignore[attr-defined]
    assert ast.dump(value120) == ast.dump(value100).replace("sm100", "sm120"), (
        f"`{ast.unparse(value120)}` is not the SM120 form of `{ast.unparse(value100)}`"
    )
    spans = import_changes(before, after)
    gained = set(imported(after)) - set(imported(before))
    if fact.form == "import":
        assert "is_sm120_supported" in module_bindings(after), "is_sm120_supported not imported"
        module = imported(after)["is_sm120_supported"][0]
        assert module.startswith("sglang.srt.utils"), f"imported from {module}"
    else:
        assert not gained, f"the get_platform() form needs no import; added {sorted(gained)}"
    spans.after.append(span(after.body[sm120[0]]))
    return spans


def check_comm_arch(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """Site F (and any list-extending patch): the fact's function's one supported_major_versions
    list gains 12 at its end, nothing else in it changes; every other function's lists stay
    as they were."""

    def lists(tree: ast.Module) -> dict[str, list[tuple[list, ast.Call, list[ast.AST]]]]:
        out: dict[str, list] = {}
        for scope, node, parents in walk_scoped(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "supported_major_versions":
                        out.setdefault(scope, []).append(
                            (ast.literal_eval(kw.value), node, parents))
        return out

    old, new = lists(before), lists(after)
    site = fact.function
    [old_list] = [v for v, _, _ in old.get(site, [])] or [None]
    assert old_list and 12 not in old_list, f"before: {old.get(site)}"
    assert [v for v, _, _ in new.get(site, [])] == [[*old_list, 12]], f"after: {new.get(site)}"
    for scope in set(old) | set(new):
        if scope != site:
            assert [v for v, _, _ in old.get(scope, [])] == [v for v, _, _ in new.get(scope, [])], (
                f"{scope}'s supported_major_versions changed"
            )
    (_, call_o, parents_o), (_, call_n, parents_n) = old[site][0], new[site][0]
    return Spans([statement_span(parents_o, call_o)], [statement_span(parents_n, call_n)])


def _branch_on(tree: ast.AST, arch: int) -> list[ast.If]:
    """`if` statements (elif included) whose test is exactly an SM-`arch` check."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.If) and arch_of(n.test) == arch]


def _scope_of_moe_site(tree: ast.Module, fact: Fact) -> ast.AST:
    func = one_function(tree, fact.function or "")
    if fact.file and fact.file.endswith("server_args.py"):
        # The Glm4MoeForCausalLM branch of the big model_arch if/elif chain.
        hits = [n for n in ast.walk(func) if isinstance(n, ast.If)
                and isinstance(n.test, ast.Compare)
                and "Glm4MoeForCausalLM" in ast.unparse(n.test)
                and ast.unparse(n.test).startswith("model_arch in")]
        assert len(hits) == 1, f"{len(hits)} `model_arch in [\"Glm4MoeForCausalLM\"]` branches"
        return ast.Module(body=hits[0].body, type_ignores=[])
    return func


def check_moe_backend(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """Site D: beside the unchanged SM100 branch, an SM120 branch that sets the MoE runner
    backend to flashinfer_cutlass for modelopt_fp4 when the user left it on auto, with its own
    log line."""
    old_scope, new_scope = _scope_of_moe_site(before, fact), _scope_of_moe_site(after, fact)
    old100, new100 = _branch_on(old_scope, 100), _branch_on(new_scope, 100)
    assert len(old100) == 1 and len(new100) == 1, f"SM100 branches {len(old100)}/{len(new100)}"
    assert not _branch_on(old_scope, 120), "the release already has an SM120 branch"
    assert [ast.dump(s) for s in new100[0].body] == [ast.dump(s) for s in old100[0].body], (
        "the SM100 branch changed"
    )
    new120 = _branch_on(new_scope, 120)
    assert len(new120) == 1, f"{len(new120)} SM120 branches"
    branch = new120[0]
    want_form = ast.Call if fact.form == "utils" else ast.Attribute
    assert isinstance(branch.test, want_form), f"SM120 test `{ast.unparse(branch.test)}`"
    sets = [n for n in ast.walk(branch) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and n.value.value == "flashinfer_cutlass"
            and any("moe_runner_backend" in ast.unparse(t) for t in n.targets)]
    assert len(sets) == 1, "no `moe_runner_backend = \"flashinfer_cutlass\"` in the SM120 branch"
    constants = {n.value for n in ast.walk(branch) if isinstance(n, ast.Constant)}
    assert {"modelopt_fp4", "auto"} <= constants, (
        "the SM120 branch does not keep the modelopt_fp4 / moe_runner_backend == 'auto' guard"
    )
    logs = [n for n in ast.walk(branch) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "info"
            and "flashinfer_cutlass" in ast.unparse(n)]
    assert logs, "no log line naming flashinfer_cutlass in the SM120 branch"
    if fact.form == "utils":
        assert "is_sm120_supported" in module_bindings(after), "is_sm120_supported not imported"
    spans = import_changes(before, after)
    # The SM100 `if` (now maybe with an elif) and an SM120 `if` right after it.
    spans.before.append(span(old100[0]))
    lo, hi = span(new100[0])
    lo2, hi2 = span(branch)
    spans.after.append((min(lo, lo2), max(hi, hi2)))
    return spans


def check_autoenable(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    if fact.form == "bare":
        return check_widened_bare(before, after, fact)
    return check_widened_or(before, after, fact)


PCIE_ENV = "SM120PATCH_PCIE_ALLREDUCE"


def check_pcie_allreduce(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """pcie-allreduce: right before the `if world_size > 2 and not full_nvlink:` gate of the
    fact's function, `if world_size > 2 and not full_nvlink and os.environ.get(ENV) != "0":
    full_nvlink = True`; with that one statement taken out, the file is the release's."""

    def gate_body(tree: ast.Module) -> tuple[list[ast.stmt], int]:
        func = one_function(tree, fact.function or "")
        holders = [n for n in ast.walk(func) if isinstance(getattr(n, "body", None), list)
                   and any(_is_pcie_gate(s) for s in n.body)]
        assert len(holders) == 1, f"{len(holders)} blocks holding the gate"
        body = holders[0].body
        return body, next(i for i, s in enumerate(body) if _is_pcie_gate(s))

    body, i = gate_body(after)
    assert i > 0, "nothing before the gate"
    new = body[i - 1]
    want = ast.parse(
        f'if world_size > 2 and not full_nvlink and os.environ.get("{PCIE_ENV}") != "0":\n'
        "    full_nvlink = True\n"
    ).body[0]
    assert ast.dump(new) == ast.dump(want), f"before the gate: `{ast.unparse(new)}`"
    assert "os" in module_bindings(after), "os is not imported"
    del body[i - 1]
    assert ast.dump(after) == ast.dump(before), "more than the override changed"
    body.insert(i - 1, new)
    # the statement and the two comment lines above it
    return Spans([], [(new.lineno - 2, new.end_lineno or new.lineno)])


def _is_pcie_gate(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) == (
        "world_size > 2 and (not full_nvlink)"
    )


def check_preflight(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """fusion-preflight: in the fact's function, the `if err != ...CUDA_SUCCESS:` right after
    `err, mc_granularity = cuda_driver.cuMulticastGetGranularity(...)` had one `raise` and now
    has `mc_granularity = alloc_granularity`; with that body put back, the file is the
    release's. The query itself stays."""

    def check_after_query(tree: ast.Module) -> ast.If:
        func = one_function(tree, fact.function or "")
        found = []
        for node in ast.walk(func):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            for i, stmt in enumerate(body[:-1]):
                if (
                    isinstance(stmt, ast.Assign)
                    and isinstance(stmt.value, ast.Call)
                    and ast.unparse(stmt.value.func) == "cuda_driver.cuMulticastGetGranularity"
                    and ast.unparse(stmt.targets[0]) == "(err, mc_granularity)"
                ):
                    found.append(body[i + 1])
        assert len(found) == 1, f"{len(found)} multicast queries"
        check = found[0]
        assert isinstance(check, ast.If)
        assert ast.unparse(check.test) == "err != cuda_driver.CUresult.CUDA_SUCCESS"
        return check

    old, new = check_after_query(before), check_after_query(after)
    assert len(old.body) == 1 and isinstance(old.body[0], ast.Raise), ast.unparse(old)
    assert [ast.unparse(s) for s in new.body] == ["mc_granularity = alloc_granularity"]
    kept = new.body
    new.body = old.body
    assert ast.dump(after) == ast.dump(before), "more than the error branch changed"
    new.body = kept
    # the body and the two comment lines above it
    return Spans([span(old.body[0])], [(new.body[0].lineno - 2, new.body[0].lineno)])


CHECKS: dict[str, Callable[[ast.Module, ast.Module, Fact], Spans]] = {
    "sglang.sm120-flag": check_sm120_flag,
    "sglang.fusion-gate": check_widened_or,
    "sglang.fusion-autoenable": check_autoenable,
    "sglang.fusion-backend": check_widened_or,
    "sglang.moe-backend": check_moe_backend,
    "flashinfer.comm-arch": check_comm_arch,
    "sglang.pcie-allreduce": check_pcie_allreduce,
    "sglang.fusion-preflight": check_preflight,
}


def defines(text: str, name: str) -> bool:
    """Whether a module's source binds `name` at module level (a def or an assignment)."""
    return name in module_bindings(ast.parse(text))
