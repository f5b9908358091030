"""vllm.allreduce-fusion-gate: vLLM's default for its allreduce+RMSNorm fusion pass includes SM120.

`enable_allreduce_rms_fusion(cfg)` (vllm/config/vllm.py) is the default of
`pass_config.fuse_allreduce_rms` at -O2/-O3: TP > 1, CUDA, FlashInfer installed, and
`(current_platform.is_device_capability_family(100) or current_platform.is_device_capability(90))`.
This patch adds `or current_platform.is_device_capability(120)` to that group: compute capability
exactly 12.0, as the size rows of vllm.allreduce-fusion-size/-oneshot (key 120; SM121 is 121 and
gets neither). Everything after the selector is left as released: the pass still needs a size row
for the TP size (only TP2 has one on SM120) and a FlashInfer workspace (single node: vLLM tries
MNNVL, which needs NVSwitch multicast, then falls back to the TRT-LLM backend, which does not).
"""

from __future__ import annotations

import ast
import copy

import libcst as cst

from sm120patch.patchkit import arch
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    NotApplicable,
    Patch,
    Refuse,
    Result,
    Sought,
    Status,
    already_applied,
    applied,
    upstream,
)

from .vllm_allreduce_fusion_size import FUSION_WIRING, PR_3903

CONFIG = "vllm/config/vllm.py"
FUNCTION = "enable_allreduce_rms_fusion"
RELEASED = ("is_device_capability_family(100)", "is_device_capability(90)")  # any order
OURS = "is_device_capability(120)"
SHAPE = (
    "`return (tp > 1 and is_cuda() and has_flashinfer() and "
    "(current_platform.is_device_capability_family(100) or "
    "current_platform.is_device_capability(90)))`"
)

FACTS = (
    Fact(releases=">=0.30.0,<0.34.0", status=Status.APPLIED,
         shape=f"{SHAPE}; `current_platform` imported inside the function", file=CONFIG,
         function=FUNCTION, source="real files"),
    Fact(releases=">=0.34.0,<0.35", status=Status.APPLIED,
         shape=f"{SHAPE}; `current_platform` imported at module level", file=CONFIG,
         function=FUNCTION, source="real files"),
)


def _capability_calls(node: cst.BaseExpression) -> tuple[str, str] | None:
    """(receiver, `method(argument)`) of a vLLM capability check with one constant argument:
    `current_platform.is_device_capability(90)` -> ("current_platform",
    "is_device_capability(90)"); None for anything else."""

    if not (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and len(node.args) == 1
        and isinstance(node.args[0].value, cst.Integer)
    ):
        return None
    method = node.func.attr.value
    if method not in arch.VLLM_CAPABILITY_CHECKS:
        return None
    receiver = h.code(node.func.value)
    return receiver, f"{method}({node.args[0].value.value})"


def _groups(func: cst.FunctionDef) -> list[cst.BooleanOperation]:
    """The outermost `or` chains of the function whose operands are all capability checks."""

    out = []
    for node in h.nodes(func, cst.BooleanOperation):
        ops = h.or_operands(node)
        if ops and all(_capability_calls(op) is not None for op in ops):
            out.append(node)
    # a chain of three holds a chain of two as its left operand: keep the outermost
    inner = {id(n.left) for n in out}
    return [n for n in out if id(n) not in inner]


def _accepts_sm120(check: str) -> bool:
    """Whether one capability check, `is_device_capability(90)` as `_capability_calls` spells
    it, takes SM120."""
    method, _, number = check.partition("(")
    return arch.SM120 in (arch.capability_check(method, int(number.removesuffix(")"))) or ())


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, FUNCTION)
    groups = _groups(func)
    if not groups:
        raise NotApplicable(FUNCTION, "no `or` of capability checks in the selector")
    if len(groups) > 1:
        raise Refuse(
            FUNCTION,
            "one `or` of capability checks",
            " and ".join(f"`{h.code(g)}`" for g in groups),
        )
    group = groups[0]
    shape = h.code(group, 400)
    calls = [_capability_calls(o) for o in h.or_operands(group) or []]
    checks = [c[1] for c in calls if c is not None]
    receivers = {c[0] for c in calls if c is not None}
    if checks[-1] == OURS and sorted(checks[:-1]) == sorted(RELEASED):
        return already_applied(FUNCTION, shape)
    on_sm120 = [c for c in checks if _accepts_sm120(c)]
    if on_sm120:
        return upstream(FUNCTION, f"the selector already accepts SM120: `{on_sm120[0]}`")
    if sorted(checks) != sorted(RELEASED) or len(receivers) != 1:
        raise Refuse(
            FUNCTION,
            "`(current_platform.is_device_capability_family(100) or "
            "current_platform.is_device_capability(90))`",
            f"`{shape}`",
        )

    receiver = receivers.pop()
    extra = cst.parse_expression(f"{receiver}.{OURS}")
    new_group = h.widen_or(group, extra)
    return applied(FUNCTION, h.replace(module, group, new_group, scope=func),
                   f"{shape} -> {h.code(new_group, 400)}")


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In `enable_allreduce_rms_fusion`, the one `or` of `current_platform` capability checks is
    the release's two checks (family 100, exactly 90) followed by
    `current_platform.is_device_capability(120)`; with that operand taken out the file is the
    release's."""

    def groups(tree: ast.Module) -> list[ast.BoolOp]:
        func = sc.one_function(tree, fact.function)
        return [
            n
            for n in ast.walk(func)
            if isinstance(n, ast.BoolOp)
            and isinstance(n.op, ast.Or)
            and all(
                isinstance(v, ast.Call) and "device_capability" in ast.unparse(v.func)
                for v in n.values
            )
        ]

    old = sc.one(groups(before), "capability `or` in the release")
    new = sc.one(groups(after), "capability `or` after the patch")
    assert sorted(ast.unparse(v) for v in old.values) == sorted(
        f"current_platform.{c}" for c in RELEASED
    ), f"the release's group: {ast.unparse(old)}"
    assert [ast.unparse(v) for v in new.values] == [
        *(ast.unparse(v) for v in old.values), f"current_platform.{OURS}"
    ], f"after: {ast.unparse(new)}"
    restored = copy.deepcopy(after)
    del sc.one(groups(restored), "capability `or`").values[-1]
    sc.same_but(before, restored, "the SM120 operand")
    added = new.values[-1]
    return sc.Spans([], [(added.lineno, added.end_lineno or added.lineno)])


PATCH = Patch(
    id="vllm.allreduce-fusion-gate",
    check=check,
    target="vllm",
    title="vLLM's default turns the FlashInfer allreduce+RMSNorm fusion pass on for SM120",
    why=(
        "vLLM's enable_allreduce_rms_fusion, the default of pass_config.fuse_allreduce_rms, "
        "accepts only `is_device_capability_family(100) or is_device_capability(90)`, so on "
        "SM120 the fused allreduce+RMSNorm pass is never chosen. The patch adds "
        "`or current_platform.is_device_capability(120)` (12.0 only, matching the size rows of "
        "the same profile). FlashInfer builds its TRT-LLM comm kernels for SM12x from 0.6.17 "
        f"({PR_3903}); every pinned vLLM requires a newer FlashInfer. With TP > 2 the pass "
        "still switches itself off on SM120 (no size row), and the pass still needs a "
        "workspace: on PCIe-only GPUs vLLM's MNNVL attempt fails for want of multicast and it "
        "falls back to the TRT-LLM backend, which needs no multicast but does need P2P."
    ),
    marker=f"def {FUNCTION}",
    transform=transform,
    facts=FACTS,
    upstream=PR_3903,
    sought=Sought(FUNCTION, (FUNCTION,)),
    wiring=FUSION_WIRING,
)
