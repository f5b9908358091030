"""sglang.fp4-gemm-choices: `--fp4-gemm-backend flashinfer_b12x` is a valid choice (site G).

The CLI's choices for --fp4-gemm-backend are a module-level list, FP4_GEMM_RUNNER_BACKEND_CHOICES:
in server_args.py up to 0.5.19, in arg_groups/choices.py from 0.5.20 (server_args.py and
arg_groups/fields/exec_.py import it there). The patch appends "flashinfer_b12x" to it, as
https://github.com/sgl-project/sglang/pull/38170 does; the list's other users
(add_fp4_gemm_runner_backend_choices)
share the same list object.
"""

from __future__ import annotations

import ast
import copy

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import NotApplicable, Patch, Result, Status

NAME = "FP4_GEMM_RUNNER_BACKEND_CHOICES"
ADD = "flashinfer_b12x"
# What every release with the list holds (0.5.8 on): auto and the FlashInfer backends of 0.5.8.
EXPECT = ("auto", "flashinfer_cudnn", "flashinfer_cutlass", "flashinfer_trtllm")


def transform(module: cst.Module) -> Result:
    if not h.module_assignments(module, NAME):
        raise NotApplicable(
            NAME, f"no module-level `{NAME} = [...]` in this file (it exists from 0.5.8)"
        )
    return op.append_to_list(module, name=NAME, add=ADD, expect=EXPECT)


SERVER_ARGS = "sglang/srt/server_args.py"
CHOICES = "sglang/srt/arg_groups/choices.py"
FACTS = (
    Fact(
        releases="<0.5.8",
        status=Status.NOT_APPLICABLE,
        shape=f"no {NAME}",
        source="real files",
        note="--fp4-gemm-backend exists from 0.5.8",
    ),
    Fact(
        releases=">=0.5.8,<0.5.20",
        status=Status.APPLIED,
        shape=f'module-level `{NAME} = ["auto", ...]` in server_args.py',
        file=SERVER_ARGS,
        source="real files",
    ),
    Fact(
        releases=">=0.5.20,<0.5.24",
        status=Status.APPLIED,
        shape=f'module-level `{NAME} = ["auto", ...]` in arg_groups/choices.py',
        file=CHOICES,
        source="real files",
    ),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """FP4_GEMM_RUNNER_BACKEND_CHOICES gains "flashinfer_b12x" at its end; nothing else
    changes."""

    def choices(tree: ast.Module) -> tuple[ast.Assign, ast.List]:
        node = sc.one([n for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "FP4_GEMM_RUNNER_BACKEND_CHOICES"
            for t in n.targets)], "FP4_GEMM_RUNNER_BACKEND_CHOICES")
        assert isinstance(node.value, ast.List), ast.unparse(node)
        return node, node.value

    (old_node, old), (new_node, new) = choices(before), choices(after)
    old_value, new_value = ast.literal_eval(old), ast.literal_eval(new)
    assert new_value == [*old_value, "flashinfer_b12x"], new_value
    restored = copy.deepcopy(after)
    choices(restored)[1].elts.pop()
    sc.same_but(before, restored, "the list")
    return sc.Spans([sc.span(old_node)], [sc.span(new_node)])


PATCH = Patch(
    id="sglang.fp4-gemm-choices",
    check=check,
    target="sglang",
    title="Accept --fp4-gemm-backend flashinfer_b12x",
    why=(
        "The --fp4-gemm-backend argument only accepts the names in "
        "FP4_GEMM_RUNNER_BACKEND_CHOICES; the patch appends flashinfer_b12x, so the b12x "
        "backend can be asked for by name (it needs sglang.fp4-gemm-enum, which adds the "
        "member the name resolves to)."
    ),
    marker=f"{NAME} = [",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/pull/38170",
    transform=transform,
)
