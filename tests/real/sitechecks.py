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


def _lead(test: ast.AST) -> ast.AST:
    """The arch check a MoE branch tests: its test, or the first operand of its `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return test.values[0]
    return test


def _branch_on(scope: ast.AST, arch: int) -> list[ast.If]:
    """The branches (if or elif) of the if statements directly in `scope`'s body testing an
    SM-`arch` check: exactly, or as the first operand of an `and` (MiniMax-M2's `if <sm100> and
    ... == "modelopt_fp4":`). A nested check is another site's (Qwen3-Next's attention
    backend inside the Qwen3 MoE branch, 0.5.10 on)."""
    branches = []
    for stmt in getattr(scope, "body", []):
        while isinstance(stmt, ast.If):
            branches.append(stmt)
            stmt = stmt.orelse[0] if len(stmt.orelse) == 1 else None
    return [b for b in branches if arch_of(_lead(b.test)) == arch]


def _scope_of_moe_site(tree: ast.Module, fact: Fact) -> ast.AST:
    func = one_function(tree, fact.function or "")
    if fact.file and fact.file.endswith("server_args.py"):
        # The model's branch of the big model_arch if/elif chain.
        model = _moe_model(fact)
        hits = [n for n in ast.walk(func) if isinstance(n, ast.If)
                and isinstance(n.test, ast.Compare)
                and model in ast.unparse(n.test)
                and ast.unparse(n.test).startswith("model_arch in")]
        assert len(hits) == 1, f"{len(hits)} `model_arch in [\"{model}\"]` branches"
        return ast.Module(body=hits[0].body, type_ignores=[])
    return func


def _moe_model(fact: Fact) -> str:
    """The architecture a MoE patch is about: its marker (`Glm4MoeForCausalLM`, ...)."""
    from sm120patch.plan import catalog

    return catalog.load().patches[fact.patch].marker


def check_moe_backend(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """Site D (GLM-4 MoE, the Qwen3 MoE family, MiniMax-M2): beside the unchanged SM100
    branch, right after it, an SM120 branch that sets the MoE runner backend to
    flashinfer_cutlass for modelopt_fp4 alone when the user left it on auto, with its own log
    line, writing no quantization field."""
    old_scope, new_scope = _scope_of_moe_site(before, fact), _scope_of_moe_site(after, fact)
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
    assert not others & constants, f"another choice kept in the SM120 branch: {sorted(constants)}"
    written = {ast.unparse(t) for n in ast.walk(branch) if isinstance(n, ast.Assign)
               for t in n.targets}
    assert not written & {"self.quantization", "overrides['quantization']"}, written
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
    "sglang.moe-backend-qwen3": check_moe_backend,
    "sglang.moe-backend-minimax": check_moe_backend,
    "flashinfer.comm-arch": check_comm_arch,
    "sglang.pcie-allreduce": check_pcie_allreduce,
    "sglang.fusion-preflight": check_preflight,
}


def defines(text: str, name: str) -> bool:
    """Whether a module's source binds `name` at module level (a def or an assignment)."""
    return name in module_bindings(ast.parse(text))


# ----------------------------------------------------------------------------- fp4-gemm, attention


def _without(tree: ast.Module, drop: list[ast.AST]) -> ast.Module:
    """A copy of `tree` without the statements `drop` (nodes of `tree`, at any depth)."""
    import copy

    memo: dict = {}
    copied = copy.deepcopy(tree, memo)
    gone = {id(memo[id(n)]) for n in drop}
    for node in ast.walk(copied):
        for name in ("body", "orelse"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                block[:] = [s for s in block if id(s) not in gone]
    return copied


def _same_but(before: ast.Module, restored: ast.Module, what: str) -> None:
    assert ast.dump(restored) == ast.dump(before), f"more than {what} changed"


def _module_def(tree: ast.Module, name: str) -> list[int]:
    return [i for i, n in enumerate(tree.body) if isinstance(n, ast.FunctionDef) and n.name == name]


def _helper_after(after: ast.Module, site: str, helper: str, source: str) -> ast.FunctionDef:
    """The module-level `def helper` right after `def site`, exactly the patch's source."""
    [i] = _module_def(after, site) or [None]
    assert i is not None, f"no module-level def {site}"
    assert _module_def(after, helper) == [i + 1], f"def {helper} is not right after def {site}"
    node = after.body[i + 1]
    assert ast.dump(node) == ast.dump(ast.parse(source).body[0]), f"def {helper} is not ours"
    return node  # type: ignore[return-value]


def _patch_module(patch_id: str):
    """The module of a patch of the library (its HELPER and HELPER_SOURCE)."""
    import sys

    from sm120patch.plan import catalog

    return sys.modules[catalog.load().patches[patch_id].transform.__module__]


def _with_blank_lines(node: ast.AST, lines: int) -> Span:
    """The node's lines and the blank lines the patch put with it (a diff may count the ones
    above or the ones below the node as the added ones)."""
    lo, hi = span(node)
    return lo - lines, hi + lines


def _drop_import(tree: ast.Module, name: str) -> ast.Module:
    """`tree` with `name` taken out of the module-level `from ... import` that brings it."""
    import copy

    tree = copy.deepcopy(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            node.names = [a for a in node.names if a.name != name]
    return tree


def check_fp4_enum(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.fp4-gemm-enum: FLASHINFER_B12X = "flashinfer_b12x" right after FLASHINFER_TRTLLM,
    is_flashinfer_b12x() right after is_flashinfer_trtllm(), both in Fp4GemmRunnerBackend; the
    class, run, maps the new member to mm_fp4's "b12x"; with the two taken out, the file is the
    release's."""
    from enum import Enum

    [cls] = [n for n in after.body if isinstance(n, ast.ClassDef) and n.name == fact.function]
    names = [
        (t.id if isinstance(s, ast.Assign) and isinstance((t := s.targets[0]), ast.Name)
         else getattr(s, "name", None))
        for s in cls.body
    ]
    i, j = names.index("FLASHINFER_TRTLLM"), names.index("is_flashinfer_trtllm")
    assert names[i + 1] == "FLASHINFER_B12X", f"after FLASHINFER_TRTLLM: {names[i + 1]}"
    assert names[j + 1] == "is_flashinfer_b12x", f"after is_flashinfer_trtllm: {names[j + 1]}"
    member, method = cls.body[i + 1], cls.body[j + 1]
    assert ast.literal_eval(member.value) == "flashinfer_b12x"  # type: ignore[attr-defined]
    scope: dict = {"Enum": Enum}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), "fp4_utils.py", "exec"), scope)
    b12x = scope[fact.function]("flashinfer_b12x")
    assert b12x.get_flashinfer_backend() == "b12x" and b12x.is_flashinfer_b12x()
    assert not scope[fact.function]("flashinfer_cutlass").is_flashinfer_b12x()
    restored = _without(after, [member, method])
    _same_but(before, restored, "the member and the predicate")
    return Spans([], [span(member), _with_blank_lines(method, 1)])


def check_fp4_auto(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.fp4-gemm-auto: in the auto `if` of the fact's function, a new first branch
    `if <SM120 in the release's form> and _flashinfer_offers_b12x():` choosing flashinfer_b12x
    with a log line, the release's chain after it as elif; the helper right after the function,
    exactly ours; is_sm120_supported imported where the call form needs it; with all that taken
    out, the file is the release's."""
    mod = _patch_module("sglang.fp4-gemm-auto")
    func = one_function(after, fact.function or "")
    [auto] = [s for s in func.body if isinstance(s, ast.If) and ast.unparse(s.test)
              == "backend == 'auto'"]
    [chain] = auto.body
    assert isinstance(chain, ast.If)
    test = chain.test
    assert isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And), ast.unparse(test)
    arch, helper = test.values
    assert arch_of(arch) == 120, f"first test `{ast.unparse(test)}`"
    assert isinstance(arch, ast.Call if fact.form == "call" else ast.Attribute), ast.unparse(arch)
    assert ast.unparse(helper) == f"{mod.HELPER}()", ast.unparse(helper)
    chosen = [n.value.value for n in ast.walk(chain.body[0]) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant)]
    assert chosen == ["flashinfer_b12x"], chosen
    assert any(isinstance(n, ast.Call) and ast.unparse(n.func) == "logger.info"
               for n in ast.walk(chain.body[1])), "no log line"
    assert len(chain.orelse) == 1 and isinstance(chain.orelse[0], ast.If), "no elif after ours"
    node = _helper_after(after, fact.function or "", mod.HELPER, mod.HELPER_SOURCE.format(
        name=mod.HELPER))
    restored = _without(after, [node])
    r_func = one_function(restored, fact.function or "")
    [r_auto] = [s for s in r_func.body if isinstance(s, ast.If) and ast.unparse(s.test)
                == "backend == 'auto'"]
    r_auto.body = list(r_auto.body[0].orelse)  # type: ignore[attr-defined]
    spans = import_changes(before, after)
    if fact.form == "call":
        assert "is_sm120_supported" in module_bindings(after), "is_sm120_supported not imported"
        if "is_sm120_supported" not in imported(before):
            restored = _drop_import(restored, "is_sm120_supported")
    _same_but(before, restored, "the SM120 branch, the helper and the import")
    spans.before.append(span(auto))
    spans.after += [span(auto), _with_blank_lines(node, 2)]
    return spans


def check_fp4_choices(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.fp4-gemm-choices: FP4_GEMM_RUNNER_BACKEND_CHOICES gains "flashinfer_b12x" at its
    end; nothing else changes."""
    name = "FP4_GEMM_RUNNER_BACKEND_CHOICES"

    def choices(tree: ast.Module) -> tuple[ast.Assign, list]:
        [node] = [n for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
        return node, ast.literal_eval(node.value)

    (old_node, old), (new_node, new) = choices(before), choices(after)
    assert new == [*old, "flashinfer_b12x"], new
    import copy

    restored = copy.deepcopy(after)
    node, _ = choices(restored)
    node.value.elts.pop()  # type: ignore[attr-defined]
    _same_but(before, restored, "the list")
    return Spans([span(old_node)], [span(new_node)])


def check_fp4_autotune(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.fp4-gemm-autotune: in the fact's function, the `or` of `fp4_gemm_needs_autotune`
    gains `get_fp4_gemm_runner_backend().is_flashinfer_b12x()` last; nothing else changes."""
    def group(tree: ast.Module) -> ast.BoolOp:
        func = one_function(tree, fact.function or "")
        [assign] = [n for n in ast.walk(func) if isinstance(n, ast.Assign)
                    and ast.unparse(n.targets[0]) == "fp4_gemm_needs_autotune"]
        [found] = [v for v in assign.value.values  # type: ignore[attr-defined]
                   if isinstance(v, ast.BoolOp) and isinstance(v.op, ast.Or)]
        return found

    old, new = group(before), group(after)
    assert [ast.dump(v) for v in new.values[:-1]] == [ast.dump(v) for v in old.values]
    assert ast.unparse(new.values[-1]) == "get_fp4_gemm_runner_backend().is_flashinfer_b12x()"
    import copy

    restored = copy.deepcopy(after)
    group(restored).values.pop()
    _same_but(before, restored, "the autotune condition")
    return Spans([span(old)], [span(new)])


def check_attention_default(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.attention-default: right after the MHA chain's SM100 branch, `elif
    get_platform().is_sm120 and _sm120_trtllm_mha_fits(cfg, model_config): return
    "trtllm_mha"`; the helper right after the function, exactly ours; with both taken out,
    the file is the release's."""
    mod = _patch_module("sglang.attention-default")
    func = one_function(after, fact.function or "")
    [mha] = [s for s in func.body if isinstance(s, ast.If)
             and ast.unparse(s.test) == "not use_mla_backend"]
    branches = [n for n in ast.walk(mha) if isinstance(n, ast.If)]
    sm100 = [b for b in branches if isinstance(b.test, ast.BoolOp)
             and arch_of(b.test.values[0]) == 100]
    assert len(sm100) == 1, f"{len(sm100)} SM100 branches"
    assert len(sm100[0].orelse) == 1 and isinstance(sm100[0].orelse[0], ast.If)
    ours = sm100[0].orelse[0]
    assert ast.unparse(ours.test) == (
        f"get_platform().is_sm120 and {mod.HELPER}(cfg, model_config)"
    ), ast.unparse(ours.test)
    assert [ast.unparse(s) for s in ours.body] == ["return 'trtllm_mha'"]
    node = _helper_after(after, fact.function or "", mod.HELPER,
                         mod.HELPER_SOURCE.format(name=mod.HELPER))
    restored = _without(after, [node])
    r_func = one_function(restored, fact.function or "")
    [r_mha] = [s for s in r_func.body if isinstance(s, ast.If)
               and ast.unparse(s.test) == "not use_mla_backend"]
    [r100] = [n for n in ast.walk(r_mha) if isinstance(n, ast.If)
              and isinstance(n.test, ast.BoolOp) and arch_of(n.test.values[0]) == 100]
    r100.orelse = r100.orelse[0].orelse  # type: ignore[attr-defined]
    _same_but(before, restored, "the SM120 branch and the helper")
    return Spans([span(sm100[0])], [span(sm100[0]), _with_blank_lines(node, 2)])


def check_attention_gpt_oss(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.attention-gpt-oss: right after `if get_platform().is_sm100:`, `elif
    get_platform().is_sm120:` setting the attention backend to get_default_attn_backend(...),
    with the three names imported from model_override_base; with those taken out, the file is
    the release's."""
    func = one_function(after, fact.function or "")
    [sm100] = [n for n in ast.walk(func) if isinstance(n, ast.If)
               and ast.unparse(n.test) == "get_platform().is_sm100"]
    [ours] = sm100.orelse
    assert isinstance(ours, ast.If) and ast.unparse(ours.test) == "get_platform().is_sm120"
    assert [ast.unparse(s) for s in ours.body] == [
        "overrides['attention_backend'] = get_default_attn_backend(server_args, "
        "use_mla_backend=use_mla_backend(server_args), "
        "model_config=model_config_of(server_args))"
    ]
    gained = set(imported(after)) - set(imported(before))
    assert gained == {"get_default_attn_backend", "model_config_of", "use_mla_backend"}, gained
    assert {imported(after)[n][0] for n in gained} == {"sglang.srt.arg_groups.model_override_base"}
    import copy

    restored = copy.deepcopy(after)
    [r100] = [n for n in ast.walk(one_function(restored, fact.function or ""))
              if isinstance(n, ast.If) and ast.unparse(n.test) == "get_platform().is_sm100"]
    r100.orelse = r100.orelse[0].orelse  # type: ignore[attr-defined]
    for name in gained:
        restored = _drop_import(restored, name)
    _same_but(before, restored, "the SM120 branch and its imports")
    spans = Spans([span(sm100)], [span(sm100)])
    for name in gained:
        spans.after.append(imported(after)[name][1])
        spans.before.append(imported(before)["resolving_view"][1])
    return spans


CHECKS.update({
    "sglang.fp4-gemm-enum": check_fp4_enum,
    "sglang.fp4-gemm-auto": check_fp4_auto,
    "sglang.fp4-gemm-choices": check_fp4_choices,
    "sglang.fp4-gemm-autotune": check_fp4_autotune,
    "sglang.attention-default": check_attention_default,
    "sglang.attention-gpt-oss": check_attention_gpt_oss,
})


# ----------------------------------------------------------------------------- moe-runner-auto


def check_moe_runner_auto(before: ast.Module, after: ast.Module, fact: Fact) -> Spans:
    """sglang.moe-runner-auto: in the `auto` if of the fact's method, right after the Marlin
    branch, the patch's SM120 elif choosing FLASHINFER_CUTLASS and setting the method's mark,
    the release's TRT-LLM `else` after it; the class's `enable_flashinfer_cutlass_moe` returns
    the global read `or` the mark; with both taken out, the file is the release's."""
    import copy

    mod = _patch_module("sglang.moe-runner-auto")
    prop_name = f"{mod.CLASS}.{mod.PROPERTY}"

    def auto_of(tree: ast.Module) -> ast.If:
        func = one_function(tree, fact.function or "")
        [auto] = [s for s in func.body  # type: ignore[attr-defined]
                  if isinstance(s, ast.If) and ast.unparse(s.test) == mod.AUTO_TEST]
        return auto

    def returned(tree: ast.Module) -> ast.Return:
        last = one_function(tree, prop_name).body[-1]  # type: ignore[attr-defined]
        assert isinstance(last, ast.Return), ast.unparse(last)
        return last

    [marlin] = auto_of(after).body
    assert isinstance(marlin, ast.If) and ast.unparse(marlin.test) == mod.MARLIN_TEST
    assert [ast.unparse(s) for s in marlin.body] == [f"{mod.VARIABLE} = {mod.MARLIN}"]
    [ours] = marlin.orelse
    assert isinstance(ours, ast.If), "no elif after the Marlin branch"
    assert ast.unparse(ours.test) == ast.unparse(ast.parse(mod.SM120_TEST).body[0].value)
    assert [ast.unparse(s) for s in ours.body] == [
        f"{mod.VARIABLE} = {mod.CUTLASS}", f"self.{mod.FLAG} = True"]
    assert [ast.unparse(s) for s in ours.orelse] == [f"{mod.VARIABLE} = {mod.TRTLLM}"]
    new_ret = returned(after)
    value = new_ret.value
    assert isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or), ast.unparse(new_ret)
    assert [ast.unparse(v) for v in value.values] == [
        mod.GLOBAL_READ, f"getattr(self, '{mod.FLAG}', False)"], ast.unparse(value)
    restored = copy.deepcopy(after)
    [r_marlin] = auto_of(restored).body
    r_marlin.orelse = r_marlin.orelse[0].orelse  # type: ignore[attr-defined]
    r_ret = returned(restored)
    r_ret.value = r_ret.value.values[0]  # type: ignore[union-attr]
    _same_but(before, restored, "the SM120 branch and the property")
    return Spans([span(auto_of(before)), span(returned(before))],
                 [span(auto_of(after)), span(new_ret)])


CHECKS["sglang.moe-runner-auto"] = check_moe_runner_auto
