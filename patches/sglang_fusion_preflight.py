"""sglang.fusion-preflight: size the TRT-LLM workspace preflight without multicast (site X').

From 0.5.11 SGLang probes, before it creates FlashInfer's allreduce-fusion workspace, whether
every rank can allocate it (`_preflight_check_workspace_memory`). The sizes come from
`_flashinfer_trtllm_workspace_allocation_sizes`, which asks the driver for the multicast
granularity of each buffer and raises when the driver cannot answer; the preflight then logs
"FlashInfer workspace preflight probe failed (...). Skipping allreduce fusion." and every rank
runs without fusion, whatever the gates say. PCIe-only GPUs (RTX PRO 6000 boxes) have no
multicast. FlashInfer allocates this workspace with `enable_multicast=False`, so the
allocation granularity alone sizes it there. The patch keeps the query, and where it fails
the buffer is sized at the allocation granularity instead of raising: where the driver answers,
the sizes are upstream's, unchanged.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from sm120patch.patchkit import sitecheck as sc
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

from .sglang_fusion_gate import FUSION_WIRING

if TYPE_CHECKING:
    import libcst as cst

SITE = "_flashinfer_trtllm_workspace_allocation_sizes"
QUERY = "cuMulticastGetGranularity"
ALLOC_QUERY = "cuMemGetAllocationGranularity"
FALLBACK = "mc_granularity = alloc_granularity"
COMMENT = (
    "# sm120patch fusion: no multicast here (PCIe-only GPUs); FlashInfer allocates this",
    "# workspace without multicast, so the allocation granularity alone sizes it.",
)
EXPECTED = (
    f"`err, mc_granularity = cuda_driver.{QUERY}(...)` followed by "
    "`if err != cuda_driver.CUresult.CUDA_SUCCESS: raise RuntimeError(...)`, after "
    f"`err, alloc_granularity = cuda_driver.{ALLOC_QUERY}(...)`"
)


def _assigns_call(stmt: cst.CSTNode, names: tuple[str, str], call: str) -> bool:
    """`a, b = cuda_driver.<call>(...)` on one line."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return False
    assign = stmt.body[0]
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1):
        return False
    target = assign.targets[0].target
    value = assign.value
    return (
        isinstance(target, cst.Tuple)
        and [h.key(e.value) for e in target.elements] == list(names)
        and isinstance(value, cst.Call)
        and h.key(value.func) == f"cuda_driver.{call}"
    )


def _is_error_check(stmt: cst.CSTNode) -> bool:
    """`if err != cuda_driver.CUresult.CUDA_SUCCESS:` with no else."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    return (
        isinstance(stmt, cst.If)
        and stmt.orelse is None
        and isinstance(stmt.test, cst.Comparison)
        and h.key(stmt.test.left) == "err"
        and len(stmt.test.comparisons) == 1
        and isinstance(stmt.test.comparisons[0].operator, cst.NotEqual)
        and h.key(stmt.test.comparisons[0].comparator) == "cuda_driver.CUresult.CUDA_SUCCESS"
    )


def _body_is(check: cst.If, kind: str) -> bool:
    """The check's block is one `raise ...` (kind "raise") or our fallback ("fallback")."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    body = check.body
    if not isinstance(body, cst.IndentedBlock) or len(body.body) != 1:
        return False
    line = body.body[0]
    if not (isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1):
        return False
    if kind == "raise":
        return isinstance(line.body[0], cst.Raise)
    return h.code(line.body[0]) == FALLBACK


def transform(module: cst.Module) -> Result:
    import libcst as cst

    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    func = op.one_def(module, SITE, f"no `def {SITE}` in this file (it exists from 0.5.11 on)")
    text = module.code_for_node(func)
    if QUERY not in text:
        if ALLOC_QUERY in text:
            return upstream(SITE, f"the release sizes the workspace without `{QUERY}`")
        raise Refuse(SITE, EXPECTED, f"neither {QUERY} nor {ALLOC_QUERY}")
    blocks = [
        n
        for n in h.statements(func)
        if isinstance(n, cst.IndentedBlock)
        and any(_assigns_call(s, ("err", "mc_granularity"), QUERY) for s in n.body)
    ]
    if len(blocks) != 1:
        raise Refuse(SITE, EXPECTED, f"{len(blocks)} blocks querying {QUERY}")
    body = list(blocks[0].body)
    i = next(i for i, s in enumerate(body) if _assigns_call(s, ("err", "mc_granularity"), QUERY))
    has_alloc = any(_assigns_call(s, ("err", "alloc_granularity"), ALLOC_QUERY) for s in body[:i])
    check = body[i + 1] if i + 1 < len(body) else None
    if not has_alloc or check is None or not _is_error_check(check):
        found = f"`{h.code(check)}` after the query" if check is not None else "nothing after it"
        raise Refuse(SITE, EXPECTED, found if has_alloc else f"no {ALLOC_QUERY} before it")
    assert isinstance(check, cst.If)
    if _body_is(check, "fallback"):
        return already_applied(SITE, f"{QUERY} failure -> {FALLBACK}")
    if not _body_is(check, "raise"):
        raise Refuse(SITE, EXPECTED, f"`{h.code(check)}`")
    nl = module.default_newline
    new = h.parse_statement(
        f"if err:{nl}" + "".join(f"    {c}{nl}" for c in COMMENT) + f"    {FALLBACK}{nl}", module
    )
    assert isinstance(new, cst.If)
    new_module = h.replace(module, check.body, new.body, scope=check)
    return applied(SITE, new_module, f"{QUERY} failure: raise RuntimeError -> {FALLBACK}")


COMM_FUSION = "sglang/srt/layers/flashinfer_comm_fusion.py"
SHAPE = (
    f"each buffer's size rounded up to `{QUERY}`'s answer; "
    '`raise RuntimeError("cuMulticastGetGranularity failed for FlashInfer workspace '
    'preflight: ...")` when the driver cannot answer'
)
FACTS = (
    Fact(
        releases="<0.5.11",
        status=Status.NOT_APPLICABLE,
        shape="no workspace preflight",
        source="real files",
        note=f"{SITE} exists from 0.5.11 on",
    ),
    Fact(releases=">=0.5.11,<0.5.24", status=Status.APPLIED, shape=SHAPE, file=COMM_FUSION,
         function=SITE, source="real files"),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In the fact's function, the `if err != ...CUDA_SUCCESS:` right after
    `err, mc_granularity = cuda_driver.cuMulticastGetGranularity(...)` had one `raise` and now
    has `mc_granularity = alloc_granularity`; with that body put back, the file is the
    release's. The query itself stays."""
    import copy

    def error_branch(tree: ast.Module) -> ast.If:
        found: list[ast.stmt] = []
        for node in ast.walk(sc.one_function(tree, fact.function)):
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
        branch = sc.one(found, "multicast query")
        assert isinstance(branch, ast.If), ast.unparse(branch)
        assert ast.unparse(branch.test) == "err != cuda_driver.CUresult.CUDA_SUCCESS"
        return branch

    old, new = error_branch(before), error_branch(after)
    assert len(old.body) == 1 and isinstance(old.body[0], ast.Raise), ast.unparse(old)
    assert [ast.unparse(s) for s in new.body] == ["mc_granularity = alloc_granularity"]
    restored = copy.deepcopy(after)
    error_branch(restored).body = old.body
    sc.same_but(before, restored, "the error branch")
    # the body and the two comment lines above it
    return sc.Spans([sc.span(old.body[0])], [(new.body[0].lineno - 2, new.body[0].lineno)])


PATCH = Patch(
    id="sglang.fusion-preflight",
    check=check,
    target="sglang",
    title="Let the fusion workspace preflight size buffers without multicast",
    why=(
        "From 0.5.11 SGLang checks, before it creates FlashInfer's allreduce-fusion workspace, "
        "that every rank can allocate it; _flashinfer_trtllm_workspace_allocation_sizes asks "
        f"the driver for each buffer's multicast granularity ({QUERY}) and raises when the "
        "driver cannot answer, and the server then logs 'FlashInfer workspace preflight probe "
        "failed (...). Skipping allreduce fusion.' and runs without fusion on every rank. "
        "PCIe-only GPUs have no multicast. FlashInfer allocates this workspace with "
        "enable_multicast=False, so the patch sizes a buffer at the allocation granularity "
        "where the query fails; where the driver answers, the sizes are upstream's. "
        "https://github.com/sgl-project/sglang/pull/32330 (closed unmerged) removed the query for "
        "the same reason. "
        "With FlashInfer before 0.6.10, FlashInfer's own workspace allocation asks the same "
        "query, so there fusion is still turned off at start-up ('Failed to initialize "
        "FlashInfer workspace')."
    ),
    marker=f"def {SITE}",
    facts=FACTS,
    transform=transform,
    upstream="https://github.com/sgl-project/sglang/pull/32330 (closed unmerged)",
    wiring=FUSION_WIRING,
)
