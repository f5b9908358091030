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
import copy

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    Patch,
    Refuse,
    Result,
    Sought,
    Status,
    already_applied,
    applied,
    upstream,
)
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site

from .sglang_fusion_gate import FUSION_WIRING

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


def explain_read(site: Site) -> Reading:
    """FlashInfer's TRT-LLM workspace preflight (0.5.11 on): whether SGLang would go on to
    create the allreduce-fusion workspace. `site.multicast` None: the real driver, and only
    the buffer sizes (no allocation, no process group); True/False: a simulated driver with
    or without multicast, and the whole collective preflight on a one-rank gloo group. Runs in
    the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib
    import io
    import logging
    import os
    from types import SimpleNamespace

    import torch

    class SimulatedDriver:
        """A CUDA driver binding (cuda-python's `cuda.bindings.driver` names) for a simulated
        GPU: allocation granularity 2 MiB, cuMemCreate succeeds, and
        cuMulticastGetGranularity answers (a GPU with multicast: NVLink) or fails with
        CUDA_ERROR_NOT_SUPPORTED (PCIe-only GPUs)."""

        NOT_SUPPORTED = 801  # CUDA_ERROR_NOT_SUPPORTED

        class CUresult:
            CUDA_SUCCESS = 0

        class CUmemAllocationGranularity_flags:  # the binding's names
            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

        class CUmulticastGranularity_flags:
            CU_MULTICAST_GRANULARITY_RECOMMENDED = 1

        class CUmulticastObjectProp:
            pass

        def __init__(self, multicast: bool) -> None:
            self.multicast = multicast

        def cuMemGetAllocationGranularity(self, prop: object, flag: object) -> tuple[int, int]:
            return 0, 1 << 21

        def cuMulticastGetGranularity(self, prop: object, flag: object) -> tuple[int, int]:
            return (0, 1 << 21) if self.multicast else (self.NOT_SUPPORTED, 0)

        def cuMemCreate(self, size: int, prop: object, flags: int) -> tuple[int, int]:
            return 0, size

        def cuMemRelease(self, handle: object) -> None:
            return None

    try:
        fusion = importlib.import_module(site.modules[0])
    except Exception as exc:
        return {"error": site.error(exc)}
    sizes = getattr(fusion, site.functions[0], None)
    check = getattr(fusion, "_preflight_check_workspace_memory", None)
    if sizes is None or check is None:
        return {"error": "not in this release"}
    shape = {"world_size": 2, "max_token_num": 128, "hidden_dim": 1024,
             "dtype": torch.bfloat16}
    if site.multicast is None:
        try:
            real = fusion.get_cuda_driver_bindings()
            found = sizes(real, fusion._make_flashinfer_workspace_allocation_prop(real),
                          *shape.values())
        except Exception as exc:
            return {"driver": "real", "proceeds": False, "error": site.error(exc)}
        return {"driver": "real", "proceeds": True, "sizes": list(found)}
    import tempfile
    import types

    dist = importlib.import_module("torch.distributed")
    driver = SimulatedDriver(site.multicast)
    prop = SimpleNamespace(requestedHandleTypes=1)
    if not dist.is_initialized():
        import atexit
        import shutil

        where = tempfile.mkdtemp(prefix="sm120patch-probe-")
        atexit.register(shutil.rmtree, where, True)
        store = os.path.join(where, "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    scope = dict(fusion.__dict__)
    scope["get_cuda_driver_bindings"] = lambda: driver
    scope["_make_flashinfer_workspace_allocation_prop"] = lambda d: prop
    copy = types.FunctionType(check.__code__, scope, check.__name__, check.__defaults__)
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    logger = logging.getLogger("sglang")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        proceeds = bool(copy(**shape, cpu_group=dist.group.WORLD))
    except Exception as exc:
        return {"driver": "simulated", "multicast": site.multicast, "error": site.error(exc)}
    finally:
        logger.removeHandler(handler)
    try:
        simulated: object = list(sizes(driver, prop, *shape.values()))
    except Exception as exc:
        simulated = site.error(exc)
    return {"driver": "simulated", "multicast": site.multicast, "proceeds": proceeds,
            "sizes": simulated, "log": logs.getvalue().splitlines()}


def explain_row(answer: Answer) -> str:
    if answer.get("error") == "not in this release":
        return "not in this release"
    driver = "" if answer.get("driver") == "real" else (
        " (simulated driver, multicast)" if answer.get("multicast") else
        " (simulated driver, no multicast)"
    )
    if answer.get("proceeds"):
        return "creates the workspace" + driver
    why = answer.get("error") or next(iter(answer.get("log") or []), "")
    return "skips allreduce fusion" + driver + (f": {why}" if why else "")


EXPLAIN = Explain(name="preflight", label="fusion workspace preflight", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In the fact's function, the `if err != ...CUDA_SUCCESS:` right after
    `err, mc_granularity = cuda_driver.cuMulticastGetGranularity(...)` had one `raise` and now
    has `mc_granularity = alloc_granularity`; with that body put back, the file is the
    release's. The query itself stays."""

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
    explain=EXPLAIN,
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
    sought=Sought(SITE, (SITE,)),  # `one_def` looks it up first
    facts=FACTS,
    transform=transform,
    upstream="https://github.com/sgl-project/sglang/pull/32330 (closed unmerged)",
    wiring=FUSION_WIRING,
)
