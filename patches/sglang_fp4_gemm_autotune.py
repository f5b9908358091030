"""sglang.fp4-gemm-autotune: flashinfer_b12x keeps the FP4 GEMM autotune pass (site G).

From 0.5.13 SGLang runs FlashInfer's autotuner at start-up for an NVFP4 model
(`fp4_gemm_needs_autotune`) when the FP4 GEMM backend is flashinfer_cutlass or
flashinfer_cutedsl: with `auto` choosing flashinfer_b12x on SM120 the pass would stop running
there. The patch adds `or get_fp4_gemm_runner_backend().is_flashinfer_b12x()` to that `or`, in
the spelling of its other operands, as https://github.com/sgl-project/sglang/pull/38170
does. Before 0.5.13 no FP4
GEMM backend is autotuned (not-applicable). Needs sglang.fp4-gemm-enum (the predicate).
"""

from __future__ import annotations

import ast
import copy

import libcst as cst

from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    NotApplicable,
    Patch,
    Refuse,
    Result,
    Status,
    already_applied,
    applied,
)

TARGET = "fp4_gemm_needs_autotune"
GETTER = "get_fp4_gemm_runner_backend()"
KNOWN = {f"{GETTER}.is_flashinfer_cutlass()", f"{GETTER}.is_flashinfer_cutedsl()"}
NEW = f"{GETTER}.is_flashinfer_b12x()"
FUNCTIONS = ("should_run_flashinfer_autotune", "_should_run_flashinfer_autotune")
EXPECTED = (
    f"`{TARGET} = model_uses_fp4 and ({GETTER}.is_flashinfer_cutlass() or "
    f"{GETTER}.is_flashinfer_cutedsl())`"
)


def transform(module: cst.Module) -> Result:
    funcs = [f for name in FUNCTIONS for f in h.functions(module, name)]
    if not funcs:
        raise NotApplicable(FUNCTIONS[0], "no FlashInfer autotune gate in this file")
    if len(funcs) > 1:
        raise Refuse(FUNCTIONS[0], "one autotune gate", f"{len(funcs)} definitions")
    func = funcs[0]
    site = func.name.value
    blocks = [b for b in h.statements(func) if isinstance(b, cst.IndentedBlock)]
    lines = [
        (s, a)
        for b in blocks
        for s in b.body
        if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1
        for a in s.body
        if isinstance(a, cst.Assign)
        and len(a.targets) == 1
        and h.key(a.targets[0].target) == TARGET
    ]
    if not lines:
        raise NotApplicable(site, f"no `{TARGET} = ...`: no FP4 GEMM is autotuned here")
    if len(lines) > 1:
        raise Refuse(site, EXPECTED, f"{len(lines)} assignments of {TARGET}")
    line, assign = lines[0]
    ops = h.and_operands(assign.value)
    groups = [
        o for o in ops if isinstance(o, cst.BooleanOperation) and h.or_operands(o) is not None
    ]
    if len(ops) != 2 or len(groups) != 1:
        raise Refuse(site, EXPECTED, f"`{h.code(line)}`")
    group = groups[0]
    keys = [h.key(o) for o in h.or_operands(group) or []]
    if NEW in keys:
        return already_applied(site, f"{TARGET} takes {NEW}")
    if set(keys) != KNOWN:
        raise Refuse(site, EXPECTED, f"`{h.code(line)}`")
    new_group = h.widen_or(group, cst.parse_expression(NEW))
    new_module = h.replace(module, group, new_group, scope=func)
    return applied(site, new_module, f"{TARGET}: `... or {NEW}`")


FLASHINFER_AUTOTUNE = "sglang/srt/model_executor/runner/flashinfer_autotune.py"
BASE_RUNNER = "sglang/srt/model_executor/runner/base_runner.py"
MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
SHAPE = (
    f"`{TARGET} = model_uses_fp4 and (...is_flashinfer_cutlass() or ...is_flashinfer_cutedsl())`"
)
FACTS = (
    Fact(
        releases="<0.5.13",
        status=Status.NOT_APPLICABLE,
        shape="no FP4 GEMM autotune term",
        source="real files",
        note="FlashInfer autotune is for MoE runner backends only before 0.5.13",
    ),
    Fact(
        releases=">=0.5.13,<0.5.14",
        status=Status.APPLIED,
        shape=SHAPE,
        file=MODEL_RUNNER,
        function="ModelRunner._should_run_flashinfer_autotune",
        source="real files",
    ),
    Fact(
        releases=">=0.5.14,<0.5.15",
        status=Status.APPLIED,
        shape=SHAPE,
        file=BASE_RUNNER,
        function="BaseRunner._should_run_flashinfer_autotune",
        source="real files",
    ),
    Fact(
        releases=">=0.5.15,<0.5.24",
        status=Status.APPLIED,
        shape=SHAPE,
        file=FLASHINFER_AUTOTUNE,
        function="should_run_flashinfer_autotune",
        source="real files",
    ),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In the fact's function, the `or` of `fp4_gemm_needs_autotune` gains
    `get_fp4_gemm_runner_backend().is_flashinfer_b12x()` last; nothing else changes."""

    def group(tree: ast.Module) -> ast.BoolOp:
        func = sc.one_function(tree, fact.function)
        assign = sc.one([n for n in ast.walk(func) if isinstance(n, ast.Assign)
                         and ast.unparse(n.targets[0]) == "fp4_gemm_needs_autotune"],
                        "`fp4_gemm_needs_autotune =`")
        assert isinstance(assign.value, ast.BoolOp), ast.unparse(assign)
        return sc.one([v for v in assign.value.values
                       if isinstance(v, ast.BoolOp) and isinstance(v.op, ast.Or)], "`or` group")

    old, new = group(before), group(after)
    assert [ast.dump(v) for v in new.values[:-1]] == [ast.dump(v) for v in old.values]
    assert ast.unparse(new.values[-1]) == "get_fp4_gemm_runner_backend().is_flashinfer_b12x()"
    restored = copy.deepcopy(after)
    group(restored).values.pop()
    sc.same_but(before, restored, "the autotune condition")
    return sc.Spans([sc.span(old)], [sc.span(new)])


PATCH = Patch(
    id="sglang.fp4-gemm-autotune",
    check=check,
    target="sglang",
    title="Autotune the FP4 GEMM for flashinfer_b12x as for flashinfer_cutlass",
    why=(
        "SGLang runs FlashInfer's autotuner for an NVFP4 model only when the FP4 GEMM backend "
        "is flashinfer_cutlass or flashinfer_cutedsl; with flashinfer_b12x the start-up "
        "tuning pass would stop and every GEMM run b12x's default tile. The patch adds "
        "is_flashinfer_b12x() to that condition, as "
        "https://github.com/sgl-project/sglang/pull/38170 does."
    ),
    marker=f"{TARGET} =",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/pull/38170",
    transform=transform,
)
