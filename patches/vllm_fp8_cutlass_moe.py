"""vllm.fp8-cutlass-moe: vLLM's FP8 CUTLASS MoE gate, found and refused with why. It never writes.

`cutlass_group_gemm_supported` in `vllm/_custom_ops.py` returns False below SM90 and from SM110
up before it asks the compiled op. That keeps SM120 off vLLM's grouped FP8 CUTLASS MoE kernel
(`cutlass_moe_mm`, the VLLM_CUTLASS FP8 MoE backend), and vLLM's FP8 MoE oracle then takes the
next backend SM120 passes (Triton for tensor/token-scaled FP8,
https://github.com/vllm-project/vllm/issues/43507). Opening the gate does not make SM120 run
that kernel: vLLM builds it for SM90 and SM100 only, so a server then fails where the kernel is
called ("No compiled cutlass_scaled_mm for CUDA device capability: 120",
https://github.com/vllm-project/vllm/issues/32109). The SM120 kernel is an open pull request
(https://github.com/vllm-project/vllm/pull/43814) on a CUTLASS collective
(https://github.com/NVIDIA/cutlass/pull/3280) that its author says vLLM's CUTLASS pin lacks.
Hence a patch that refuses: `sm120patch apply vllm-fp8-moe` answers why in one line instead of
leaving the operator to edit the gate by hand.

Where a release lets SM120 through to the compiled op (its upper bound above 120, as that pull
request proposes), the release is taken to carry the kernel: upstream. Any other shape is refused as
a shape this patch does not know.
"""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Refuse, Result, Sought, Status, upstream

FILE = "vllm/_custom_ops.py"
FUNCTION = "cutlass_group_gemm_supported"
GATE = "if cuda_device_capability < 90 or cuda_device_capability >= 110: return False"
ISSUE = "https://github.com/vllm-project/vllm/issues/32109"
KERNEL_PR = "https://github.com/vllm-project/vllm/pull/43814"
# What the operator reads: why the gate stays (the refusal's `expected` and `found`).
EXPECTED = "an SM120 build of vLLM's grouped FP8 CUTLASS MoE kernel (cutlass_moe_mm) behind it"
FOUND = (
    f"`{GATE}` before a kernel built for SM90 and SM100 only: opened, FP8 MoE fails on SM120 "
    f"('No compiled cutlass_scaled_mm for CUDA device capability: 120', {ISSUE}); the SM120 "
    f"kernel is {KERNEL_PR} (open). vLLM's FP8 MoE oracle takes another backend on SM120: "
    "nothing to patch"
)

FACTS = (
    Fact(releases=">=0.30.0,<0.35", status=Status.REFUSED, file=FILE, function=FUNCTION,
         shape=f"`{GATE}` before `torch.ops._C.cutlass_group_gemm_supported(...)`: SM120 is "
         "kept off a kernel vLLM builds for SM90 and SM100 only",
         source="real files",
         note="the compiled op and its CUDA sources are not in the release cache (its .py "
         f"files only): that no SM120 kernel ships is read from {ISSUE} (the error when the "
         f"gate is passed) and {KERNEL_PR} (open: it adds grouped_mm_c3x_sm120.cu and moves "
         "the bound to 130)"),
)


def _bounds(test: cst.BaseExpression) -> tuple[int, int] | None:
    """(low, high) of `c < low or c >= high` on one name, else None."""

    ops = h.or_operands(test)
    if ops is None or len(ops) != 2:
        return None
    found: dict[type, int] = {}
    names = set()
    for part in ops:
        if not (isinstance(part, cst.Comparison) and len(part.comparisons) == 1):
            return None
        right = part.comparisons[0].comparator
        if not isinstance(right, cst.Integer):
            return None
        names.add(h.key(part.left))
        found[type(part.comparisons[0].operator)] = int(right.value)
    if len(names) != 1 or set(found) != {cst.LessThan, cst.GreaterThanEqual}:
        return None
    return found[cst.LessThan], found[cst.GreaterThanEqual]


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, FUNCTION, f"no `def {FUNCTION}` in this file")
    body = func.body.body if isinstance(func.body, cst.IndentedBlock) else ()
    first = body[0] if body else None
    bounds = _bounds(first.test) if isinstance(first, cst.If) else None
    if not isinstance(first, cst.If) or bounds is None or first.orelse is not None or (
        h.code(first.body) != "return False"
    ):
        found = f"`{h.code(first)}`" if first is not None else "an empty body"
        raise Refuse(
            FUNCTION, "first `if <capability> < 90 or <capability> >= N: return False`", found
        )
    low, high = bounds
    if low <= 120 < high:  # SM120 goes on to the compiled op, which decides per build
        return upstream(
            FUNCTION,
            f"SM120 passes the gate (< {low} or >= {high}) and the "
            "compiled op decides: this release carries an SM120 path",
            shape=f"`{h.code(first.test)}`",
        )
    raise Refuse(FUNCTION, EXPECTED, FOUND)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """The fact's function opens with `if c < 90 or c >= N: return False`. Refused releases
    (N <= 120) keep SM120 out and the text unchanged; an upstream one (N > 120) lets SM120 on.
    Nothing is written either way."""
    func = sc.one_function(before, fact.function)
    first = func.body[0]
    assert isinstance(first, ast.If) and isinstance(first.test, ast.BoolOp), ast.unparse(first)
    assert isinstance(first.test.op, ast.Or) and ast.unparse(first.body[0]) == "return False"
    text = ast.unparse(first.test)
    parts = text.split(" or ")
    assert len(parts) == 2 and parts[0].endswith(" < 90") and " >= " in parts[1], text
    high = int(parts[1].rsplit(" >= ", 1)[1])
    keeps_out = high <= 120
    assert keeps_out == (fact.status is Status.REFUSED), f"{text} on a {fact.status} fact"
    assert ast.dump(before) == ast.dump(after), "the text changed"
    return sc.Spans()


PATCH = Patch(
    id="vllm.fp8-cutlass-moe",
    check=check,
    target="vllm",
    title="vLLM's FP8 CUTLASS MoE gate on SM120: refused (no SM120 build of the kernel)",
    why=(
        "cutlass_group_gemm_supported in vllm/_custom_ops.py returns False from SM110 up, so "
        "SM120 never reaches vLLM's grouped FP8 CUTLASS MoE kernel (cutlass_moe_mm). vLLM "
        "builds that kernel for SM90 and SM100 only: passed, the FP8 MoE fails with 'No "
        f"compiled cutlass_scaled_mm for CUDA device capability: 120' ({ISSUE}). The SM120 "
        f"kernel is {KERNEL_PR} (open), on a CUTLASS collective "
        "(https://github.com/NVIDIA/cutlass/pull/3280) newer than these releases' CUTLASS. "
        "This patch finds the gate and refuses, with that reason; it never writes."
    ),
    marker=f"def {FUNCTION}",
    transform=transform,
    facts=FACTS,
    upstream=KERNEL_PR,
    sought=Sought(FUNCTION, (FUNCTION,)),
)
