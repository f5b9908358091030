"""sglang.fusion-autoenable: the server arguments auto-enable allreduce fusion on SM120 at TP2
only (site C).

The only SGLang figures on SM120 have fusion helping at TP2 and regressing beyond:
https://github.com/sgl-project/sglang/pull/32330 was closed with "TP4 testing showed a
substantial regression that was removed by disabling FlashInfer all-reduce fusion", so the SM120
operand the patch adds to the auto-enable's `(sm90 or sm100)` group is `(<sm120> and
<args>.tp_size == 2)`, as vllm.allreduce-fusion-size limits vLLM's to world size 2. An explicit
`--flashinfer-allreduce-fusion-backend` (or `--enable-flashinfer-allreduce-fusion`) is the
user's and is never touched: the auto-enable runs only where upstream's own test says the user
left it unset.
"""

from __future__ import annotations

import ast
from enum import Enum
from typing import NamedTuple

import libcst as cst

from sm120patch.patchkit import arch, imports
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    Patch,
    Refuse,
    Result,
    Status,
    already_applied,
    applied,
    upstream,
)
from sm120patch.patchkit.operations import read_arch_group

# The function holding the auto-enable, newest layout first: arg_groups/overrides.py from
# 0.5.15, ServerArgs before that (0.5.2 names the method without its leading underscore).
SITES = (
    "_flashinfer_allreduce_fusion_auto_enable",
    "_handle_model_specific_adjustments",
    "model_specific_adjustments",
)
FUSION_FIELDS = ("enable_flashinfer_allreduce_fusion", "flashinfer_allreduce_fusion_backend")
SM120_CALL = "is_sm120_supported"
# The one tensor-parallel size at which SM120 auto-enables fusion (see the module docstring).
TP = 2
EXPECTED = (
    "one `if` turning allreduce fusion on whose test has `(is_sm90_supported() or "
    "is_sm100_supported())` (or the `get_platform()` form), or in the per-model blocks of "
    "0.5.2 to 0.5.6 `is_sm100_supported()`"
)


class Verdict(Enum):
    """What a gate's arch operand is, and so what the patch does with the gate."""

    WIDEN_OR = "widen-or"  # `(sm90 or sm100)`: add `or sm120` to the group
    WIDEN_SINGLE = "widen-single"  # a lone sm100 check gating only fusion: `sm100 or sm120`
    HAS_SM120 = "has-sm120"  # already checks SM120 at TP2 only: the patch's own shape
    SM120_EVERY_TP = "sm120-every-tp"  # checks SM120 at every TP size: not the patch's shape
    UPSTREAM = "upstream"  # checks Blackwell (majors 10 and 12): SM120 already included
    SM100_BLOCK = "sm100-block"  # a lone sm100 check that also picks SM100-only kernels: kept
    UNKNOWN = "unknown"  # an arch test of a shape the patch does not know


class Gate(NamedTuple):
    """One `if` testing the GPU arch around a statement that turns fusion on."""

    node: cst.If
    verdict: Verdict
    operand: cst.BaseExpression | None  # the arch operand; for UNKNOWN the one at fault
    form: str = ""  # "call" or "platform" (see cst_helpers.sglang_arch)


def transform(module: cst.Module) -> Result:
    name, func = op.one_of_defs(module, SITES)

    enables = h.guarded_nodes(func, _turns_fusion_on)
    if not enables:
        raise Refuse(name, EXPECTED, "no statement turning allreduce fusion on")
    # Each such statement's gate is the innermost `if` around it testing the GPU arch;
    # several statements may share one gate.
    gates: list[Gate] = []
    for node, ifs in enables:
        test = next((i for i in reversed(ifs) if arch.mentions_sglang_arch(i.test)), None)
        if test is None:
            raise Refuse(name, EXPECTED, f"`{h.code(node)}` under no GPU-arch check")
        if not any(g.node is test for g in gates):
            gates.append(_judge(test))

    for g in gates:
        if g.verdict is Verdict.UNKNOWN:
            where = f"`{h.code(g.operand)}` in " if g.operand is not None else ""
            raise Refuse(name, EXPECTED, f"{where}`if {h.code(g.node.test)}`")
    # SM100 blocks that also pick SM100-only kernels (DeepseekV3, 0.5.2 to 0.5.6) stay.
    kept = [f"`if {h.code(g.node.test)}`" for g in gates if g.verdict is Verdict.SM100_BLOCK]
    note = f"; left as is (also picks SM100-only kernels): {', '.join(kept)}" if kept else ""
    relevant = [g for g in gates if g.verdict is not Verdict.SM100_BLOCK]
    if len(relevant) != 1:
        tests = "; ".join(f"`if {h.code(g.node.test)}`" for g in gates)
        what = "several" if relevant else "only SM100 blocks that also pick SM100-only kernels"
        raise Refuse(name, EXPECTED, f"{what}: {tests}")
    gate = relevant[0]
    operand = gate.operand
    assert operand is not None
    shape = h.code(operand)
    # The call form's SM120 check needs is_sm120_supported imported: every release with the
    # unified block imports it already; a tree that lacks it gets it next to
    # is_sm100_supported (the runner places what a result requests).
    needs = arch.sglang_arch_import("sm120", gate.form)

    if gate.verdict is Verdict.HAS_SM120:
        return already_applied(name, shape).needing(needs)
    if gate.verdict is Verdict.SM120_EVERY_TP:
        # The release auto-enables SM120 itself, at every TP size: upstream decides there.
        return upstream(
            name, f"the release auto-enables fusion on SM120 itself (every TP size): `{shape}`"
            f"{note}", shape)
    receiver = _receiver(func)
    if receiver is None:
        raise Refuse(name, "a function whose first parameter holds the server arguments",
                     f"`def {name}` with no parameter")
    sm120_tp2 = _sm120_at_tp2(gate.form, receiver)
    if gate.verdict is Verdict.UPSTREAM:
        return upstream(
            name,
            "the release enables fusion on every Blackwell GPU (majors 10 and 12, SM120 "
            f"included): `{shape}`{note}",
            shape,
        )

    if gate.verdict is Verdict.WIDEN_OR:
        if not isinstance(operand, cst.BooleanOperation):
            raise Refuse(name, EXPECTED, f"`{shape}`")
        # Only the gate (the `if` whose test holds the operand) is rebuilt, not the function.
        new_group = h.widen_or(operand, sm120_tp2)
        new_module = h.replace(module, operand, new_group, scope=gate.node)
        change = f"{shape} -> {h.code(new_group)}"
    else:  # WIDEN_SINGLE: the per-model GptOss block of 0.5.2 to 0.5.4
        if gate.form == "call" and not imports.binds_at_module_level(module, SM120_CALL):
            # Only 0.5.2 and 0.5.3 have this block without the import, and their
            # sglang.srt.utils has no is_sm120_supported to import.
            raise Refuse(
                name,
                f"`{SM120_CALL}` imported (sglang.srt.utils has it from 0.5.4 on)",
                "no such import: this release predates SM120 detection",
            )
        # `if is_sm100_supported():` needs no parentheses; inside an `and` chain it does.
        parens = operand is not gate.node.test
        new_operand = cst.BooleanOperation(
            left=operand,
            operator=cst.Or(),
            right=sm120_tp2,
            lpar=[cst.LeftParen()] if parens else [],
            rpar=[cst.RightParen()] if parens else [],
        )
        new_module = h.replace(module, operand, new_operand, scope=gate.node)
        change = f"{shape} -> {h.code(new_operand)}"
    return applied(name, new_module, change, f"patched ({change}){note}").needing(needs)


def _receiver(func: cst.FunctionDef) -> str | None:
    """The name the function reads the server arguments through: its first parameter (`self`
    in ServerArgs up to 0.5.14, `view` in arg_groups/overrides.py from 0.5.15)."""
    params = func.params.params
    return params[0].name.value if params else None


def _sm120_at_tp2(form: str, receiver: str) -> cst.BaseExpression:
    """`(<the SM120 check in form> and <receiver>.tp_size == 2)`."""

    check = cst.Module([]).code_for_node(arch.sglang_arch_check("sm120", form))
    return cst.parse_expression(f"({check} and {receiver}.tp_size == {TP})")


def _tp2_form(node: cst.BaseExpression) -> str | None:
    """The form of an `(<sm120 check> and <x>.tp_size == 2)` operand, else None."""

    if not (isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And)):
        return None
    ops = h.and_operands(node)
    if len(ops) != 2:
        return None
    found = arch.sglang_arch(ops[0])
    tp = ops[1]
    if found is None or found[0] != "sm120" or not isinstance(tp, cst.Comparison):
        return None
    if not (
        isinstance(tp.left, cst.Attribute) and tp.left.attr.value == "tp_size"
        and len(tp.comparisons) == 1 and isinstance(tp.comparisons[0].operator, cst.Equal)
        and isinstance(tp.comparisons[0].comparator, cst.Integer)
        and tp.comparisons[0].comparator.value == str(TP)
    ):
        return None
    return found[1]


def _turns_fusion_on(node: object) -> bool:
    """`<x>.enable_flashinfer_allreduce_fusion = True`, `<x>.flashinfer_allreduce_fusion_backend
    = <not None>`, or `return {"flashinfer_allreduce_fusion_backend": <not None>}`."""
    def on(value: cst.BaseExpression) -> bool:
        return not (isinstance(value, cst.Name) and value.value in ("None", "False"))

    if isinstance(node, cst.Assign) and len(node.targets) == 1:
        target = node.targets[0].target
        return (
            isinstance(target, cst.Attribute)
            and target.attr.value in FUSION_FIELDS
            and on(node.value)
        )
    if isinstance(node, cst.Return) and isinstance(node.value, cst.Dict):
        return any(
            isinstance(el, cst.DictElement)
            and isinstance(el.key, cst.SimpleString)
            and el.key.evaluated_value in FUSION_FIELDS
            and on(el.value)
            for el in node.value.elements
        )
    return False


def _judge(gate: cst.If) -> Gate:
    """Find the one arch operand among the gate's `and` operands and say what it is."""
    arch_ops: list[cst.BaseExpression] = []
    for operand in h.and_operands(gate.test):
        parts = h.or_operands(operand) or [operand]
        tp2 = [p for p in parts if _tp2_form(p) is not None]
        rest = [arch.sglang_arch(p) for p in parts if _tp2_form(p) is None]
        if len(tp2) == 1 and rest and all(c is not None for c in rest):
            # The patch's own operand beside the release's arch checks: already applied.
            forms = {c[1] for c in rest if c is not None} | {_tp2_form(tp2[0]) or ""}
            verdict = Verdict.HAS_SM120 if len(forms) == 1 else Verdict.UNKNOWN
            return Gate(gate, verdict, operand, forms.pop() if len(forms) == 1 else "")
        checks = [arch.sglang_arch(p) for p in parts]
        if all(c is not None for c in checks):
            arch_ops.append(operand)
        elif len(parts) > 1 and not any(
            arch.mentions_sglang_arch(p) for p, c in zip(parts, checks, strict=True) if c is None
        ):
            # A group mixing arch and other tests, `(self.nnodes == 1 or is_sm100_supported())`
            # (0.5.14 on): multi-node fusion resolves to MNNVL, which only SM100 systems have,
            # and the backend refuses multi-node on SM120. Left as it is.
            continue
        elif arch.mentions_sglang_arch(operand):
            return Gate(gate, Verdict.UNKNOWN, operand)
    if len(arch_ops) != 1:
        return Gate(gate, Verdict.UNKNOWN, None)
    operand = arch_ops[0]
    read = read_arch_group(operand)
    archs, form = read.archs, read.form
    if form in ("", "flag"):
        return Gate(gate, Verdict.UNKNOWN, operand)
    if "sm120" in archs:
        return Gate(gate, Verdict.SM120_EVERY_TP, operand, form)
    if "blackwell" in archs:
        return Gate(gate, Verdict.UPSTREAM, operand, form)
    if sorted(archs) == ["sm100", "sm90"]:  # either order
        return Gate(gate, Verdict.WIDEN_OR, operand, form)
    if archs == ("sm100",):
        # 0.5.2 to 0.5.6 turn fusion on per model. The GptOss block gates nothing but the
        # fusion (0.5.5 made it `is_blackwell_supported()`): widen it. The DeepseekV3 block
        # also picks trtllm_mla and the trtllm MoE runner, SM100-only kernels: leave it.
        only_fusion = all(h.guarded_nodes(stmt, _turns_fusion_on) for stmt in gate.body.body)
        verdict = Verdict.WIDEN_SINGLE if only_fusion else Verdict.SM100_BLOCK
        return Gate(gate, verdict, operand, form)
    return Gate(gate, Verdict.UNKNOWN, operand)


SERVER_ARGS = "sglang/srt/server_args.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
FACTS = (
    Fact(releases="==0.5.4", status=Status.APPLIED,
         shape="GptOss block `if is_sm100_supported():` -> `or "
         "(is_sm120_supported() and self.tp_size == 2)`; the DeepseekV3 block (also "
         "SM100-only kernels) is left",
         file=SERVER_ARGS, function="ServerArgs._handle_model_specific_adjustments", form="bare",
         source="real files", note="On 0.5.4 the GptOss block gates on a bare `if "
         "is_sm100_supported():`, the test 0.5.5 widened upstream to "
         "is_blackwell_supported(); widening it the same way is the 0.5.5 behaviour. The "
         "DeepseekV3 block (`is_cuda() and is_sm100_supported()`) also picks SM100-only "
         "trtllm_mla attention and stays as it is."),
    Fact(releases="==0.5.4.post3", status=Status.UPSTREAM,
         shape="GptOss block `if is_blackwell_supported():`", file=SERVER_ARGS,
         source="real files (found by the full real tier over post releases)",
         note="the hotfix already carries 0.5.5's is_blackwell_supported() (majors 10 and 12)"),
    Fact(releases=">=0.5.5,<0.5.7", status=Status.UPSTREAM,
         shape="GptOss block `if is_blackwell_supported():`", file=SERVER_ARGS,
         source="released files",
         note="is_blackwell_supported() (majors 10 and 12) already covers SM120"),
    Fact(releases="==0.5.7", status=Status.UPSTREAM,
         shape="unified block, `(is_sm90_supported() or "
         "is_blackwell_supported())`", file=SERVER_ARGS, source="released files",
         note="is_blackwell_supported() (majors 10 and 12) already covers SM120"),
    Fact(releases=">=0.5.8,<0.5.14", status=Status.APPLIED,
         shape="_handle_model_specific_adjustments, unified block "
         "`(is_sm90_supported() or is_sm100_supported())` then "
         "`self.enable_flashinfer_allreduce_fusion = True`", file=SERVER_ARGS,
         function="ServerArgs._handle_model_specific_adjustments", form="utils",
         source="released files"),
    Fact(releases="==0.5.14", status=Status.APPLIED,
         shape='same test, then `self.flashinfer_allreduce_fusion_backend '
         '= "auto"`', file=SERVER_ARGS, function="ServerArgs._handle_model_specific_adjustments",
         form="utils", source="released files"),
    Fact(releases=">=0.5.15,<0.5.19", status=Status.APPLIED,
         shape="arg_groups/overrides.py, same test, returns "
         '{"flashinfer_allreduce_fusion_backend": "auto"}', file=OVERRIDES,
         function="_flashinfer_allreduce_fusion_auto_enable", form="utils",
         source="released files"),
    Fact(releases=">=0.5.19,<0.5.24", status=Status.APPLIED,
         shape="same function, `(get_platform().is_sm90 or "
         "get_platform().is_sm100)`", file=OVERRIDES,
         function="_flashinfer_allreduce_fusion_auto_enable", form="platform",
         source="released files"),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """0.5.4: the GptOss block's bare `if is_sm100_supported():` gains `or
    (is_sm120_supported() and self.tp_size == 2)`; later: the unified block's `(sm90 or sm100)`
    group gains `(<the SM120 test in its form> and <args>.tp_size == 2)`, `<args>` the
    function's first parameter. Upstream (0.5.4.post3 to 0.5.7): an `if` of the release
    already tests `is_blackwell_supported()` (majors 10 and 12)."""
    if fact.status is Status.UPSTREAM:
        tests = [ast.unparse(n.test) for n in ast.walk(before) if isinstance(n, ast.If)]
        assert any("is_blackwell_supported()" in t for t in tests), "no is_blackwell_supported()"
        sc.same_but(before, after, "nothing")
        return sc.Spans()
    if fact.form == "bare":
        return sc.widened_bare(before, after, fact, owner="GptOssForCausalLM", tp=TP)
    return sc.widened_or(before, after, fact, tp=TP)


PATCH = Patch(
    id="sglang.fusion-autoenable",
    check=check,
    target="sglang",
    title="Auto-enable FlashInfer allreduce fusion on SM120 at TP2 only",
    why=(
        "The server arguments turn FlashInfer allreduce fusion on by default for the models "
        "that support it, but only when `is_sm90_supported() or is_sm100_supported()` "
        "(from 0.5.19 `get_platform().is_sm90 or get_platform().is_sm100`): on SM120 fusion "
        "stays off unless asked for. The patch adds `(<the SM120 check> and "
        "<args>.tp_size == 2)` in the same form: on SM120 fusion is auto-enabled at TP2 only, "
        "since TP4 was reported to regress "
        "(https://github.com/sgl-project/sglang/pull/32330: \"TP4 testing showed a substantial "
        "regression that was removed by disabling FlashInfer all-reduce fusion\"). SM90 and "
        "SM100 decide as upstream at every TP size, and an explicit "
        "--flashinfer-allreduce-fusion-backend (or --enable-flashinfer-allreduce-fusion) is "
        "the user's and stays as given. The multi-node clause `nnodes == 1 or <sm100>` (0.5.14 "
        "on) stays as it is: multi-node fusion resolves to MNNVL, which SM120 systems do not "
        "have."
    ),
    marker=f"def {SITES[0]}",
    facts=FACTS,
    transform=transform,
)
