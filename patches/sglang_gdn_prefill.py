"""sglang.gdn-prefill: FlashInfer's GDN prefill as SM120's default for hybrid linear-attention
models (Qwen3-Next, Qwen3.5), in the domain the public sources validate.

`flashinfer_gdn_prefill_default` (sglang/srt/layers/attention/linear/gdn_backend.py, 0.5.19 to
0.5.23) returns "flashinfer" only when `sm_major in (9, 10)`: SM90 with an fp32 state pool and
chunks up to 32768, SM100 with CUDA 13, a bf16 state pool and chunks up to 8192; SM120 stays on
Triton although SGLang's FlashInfer GDN kernel already has an SM120 prefill path (it converts
the state to fp32, `_prefill_needs_fp32_state = sm_major >= 12`). FlashInfer 0.6.14 and later
ship `chunk_gated_delta_rule_sm120` (https://github.com/flashinfer-ai/flashinfer/pull/3659:
"3.45x" over FLA/Triton at 1x65536 on an RTX PRO 6000). The patch does what open
https://github.com/sgl-project/sglang/pull/36357 proposes: SM120 is admitted (`(9, 10)` ->
`(9, 10, 12)`) and gets its own branch with SM100's envelope and its own state dtype ("SM120
(new) | >= 13 | 8192 | fp32"), plus one condition of ours: FlashInfer's SM120 kernel must have
loaded (`flashinfer.gdn_kernels.chunk_gated_delta_rule_sm120` is None where its CuTe-DSL import
failed, and absent before 0.6.14), else Triton as upstream. Every other condition of the
function (an explicit --linear-attn-prefill-backend, the decode backend, deterministic
inference, dynamic chunking, head dims 128, the loader's availability) stays upstream's, and
SM90/SM100 decide exactly as released.
"""

from __future__ import annotations

import ast
import copy

import libcst as cst
from libcst.helpers import ensure_type

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    NotApplicable,
    Patch,
    Refuse,
    Result,
    Status,
    Wiring,
    already_applied,
    applied,
    upstream,
)
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site

SITE = "flashinfer_gdn_prefill_default"
FILE = "sglang/srt/layers/attention/linear/gdn_backend.py"
ADMIT_OLD = "sm_major not in (9, 10)"
ADMIT_NEW = "sm_major not in (9, 10, 12)"
SM100_TEST = "sm_major == 10"
SM100_ONLY = "torch.cuda.get_device_capability()[0] != 10"  # 0.5.17 and 0.5.18
SM120_TEST = "sm_major == 12"
KERNEL = "chunk_gated_delta_rule_sm120"
# The SM120 branch, after the SM100 one: CUDA 13, FlashInfer's SM120 kernel loaded, chunks up to
# 8192, an fp32 state pool (the row of https://github.com/sgl-project/sglang/pull/36357; the
# kernel check is ours).
BRANCH = f'''\
if x:
    # sm120patch gdn-prefill: FlashInfer's SM120 GDN prefill kernel (FlashInfer 0.6.14+)
    # needs CUDA 13 and an fp32 state; without the kernel, Triton as upstream.
    if cuda_version is None or int(cuda_version.split(".", 1)[0]) < 13:
        return None
    try:
        from flashinfer.gdn_kernels import {KERNEL}
    except (ImportError, RuntimeError):
        return None
    if {KERNEL} is None:
        return None
    max_chunk = 8192
    expected_state_dtype = torch.float32
'''
EXPECTED = (
    f"`{ADMIT_OLD}` once among the function's early-return tests, and `if {SM100_TEST}:` "
    "setting max_chunk and expected_state_dtype, with an `else:` (SM90)"
)
# What SGLang logs when the default picks FlashInfer (rank 0): "Defaulting SM120 GDN prefill
# backend to FlashInfer." (the same f-string for SM90 and SM100).
WIRING = Wiring(ran=(r"Defaulting SM120 GDN prefill backend to FlashInfer",))


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, SITE, f"no `def {SITE}` in this file (it exists from 0.5.19)")
    admits = [c for c in h.matching_nodes(func, cst.Comparison)
              if h.code(c) in (ADMIT_OLD, ADMIT_NEW)]
    if not admits and any(h.code(c) == SM100_ONLY
                          for c in h.matching_nodes(func, cst.Comparison)):
        # 0.5.17 and 0.5.18: one SM100 domain, no per-arch rows for SM120 to join.
        raise NotApplicable(SITE, f"`{SM100_ONLY}`: the SM100-only default of 0.5.17 and "
                            "0.5.18 (the per-arch rows come in 0.5.19)")
    if len(admits) != 1:
        found = f"{len(admits)} `{ADMIT_OLD}` tests"
        raise Refuse(SITE, EXPECTED, found)
    admit = admits[0]
    ifs = [s for s in ensure_type(func.body, cst.IndentedBlock).body
           if isinstance(s, cst.If) and h.code(s.test) == SM100_TEST]
    if len(ifs) != 1:
        raise Refuse(SITE, EXPECTED, f"{len(ifs)} `if {SM100_TEST}:` statements in the body")
    sm100 = ifs[0]
    nxt = sm100.orelse
    if h.code(admit) == ADMIT_NEW:
        if isinstance(nxt, cst.If) and h.code(nxt.test) == SM120_TEST:
            if _is_ours(nxt):
                return already_applied(SITE, f"`{ADMIT_NEW}` and `elif {SM120_TEST}:` (ours)")
            return upstream(SITE, f"the release admits SM120 itself: `{ADMIT_NEW}` and "
                            f"`elif {SM120_TEST}:`")
        raise Refuse(SITE, EXPECTED, f"`{ADMIT_NEW}` without an `elif {SM120_TEST}:` branch")
    if not isinstance(nxt, cst.Else):
        found = "no else" if nxt is None else f"`elif {h.code(nxt.test)}:`"
        raise Refuse(SITE, EXPECTED, f"`if {SM100_TEST}:` followed by {found}")
    names = {t.value for t in h.matching_nodes(sm100.body, cst.Name) if isinstance(t, cst.Name)}
    if not {"cuda_version", "max_chunk", "expected_state_dtype", "torch"} <= names:
        raise Refuse(SITE, EXPECTED, f"`if {SM100_TEST}:` without the CUDA, chunk and state "
                     "dtype of this shape")

    template = h.parse_statement(BRANCH.replace("\n", module.default_newline), module)
    body = ensure_type(template, cst.If).body
    branch = op.new_elif(sm100, cst.parse_expression(SM120_TEST), body)
    new_module = h.replace(module, sm100, sm100.with_changes(orelse=branch), scope=sm100)
    new_func = op.one_def(new_module, SITE)
    [new_admit] = [c for c in h.matching_nodes(new_func, cst.Comparison)
                   if isinstance(c, cst.Comparison) and h.code(c) == ADMIT_OLD]
    widened = cst.parse_expression(ADMIT_NEW)
    new_module = h.replace(new_module, new_admit, widened.with_changes(
        lpar=new_admit.lpar, rpar=new_admit.rpar), scope=new_func)
    return applied(SITE, new_module, f"`{ADMIT_OLD}` -> `{ADMIT_NEW}`; `elif {SM120_TEST}:` "
                   "(CUDA 13, FlashInfer's SM120 kernel, chunk <= 8192, fp32 state) after "
                   f"`if {SM100_TEST}:`")


def _is_ours(branch: cst.If) -> bool:
    """The SM120 branch's body is exactly the one the patch writes (comments aside)."""
    found = ast.parse(cst.Module([]).code_for_node(branch)).body[0]
    want = ast.parse(BRANCH).body[0]
    assert isinstance(found, ast.If) and isinstance(want, ast.If)
    return [ast.dump(s) for s in found.body] == [ast.dump(s) for s in want.body]


FACTS = (
    Fact(
        releases="<0.5.17",
        status=Status.NOT_APPLICABLE,
        shape="no flashinfer_gdn_prefill_default: GDN prefill is Triton unless "
        "--linear-attn-prefill-backend says otherwise",
        source="real files",
        note="the gdn-prefill profile is pinned from 0.5.19",
    ),
    Fact(
        releases=">=0.5.17,<0.5.19",
        status=Status.NOT_APPLICABLE,
        shape="flashinfer_gdn_prefill_default for SM100 alone: `or not is_cuda() or "
        "torch.cuda.get_device_capability()[0] != 10` among the early returns",
        file=FILE,
        function=SITE,
        source="real files",
        note="the gdn-prefill profile is pinned from 0.5.19",
    ),
    Fact(
        releases=">=0.5.19,<0.5.24",
        status=Status.APPLIED,
        shape="`sm_major not in (9, 10)` among the early-return tests; `if sm_major == 10:` "
        "(CUDA >= 13, max_chunk 8192, bf16 state) `else:` (max_chunk 32768, fp32 state); "
        "0.5.19 to 0.5.22 also return None with a page-major KV layout",
        file=FILE,
        function=SITE,
        source="real files",
    ),
)


def explain_read(site: Site) -> Reading:
    """What `flashinfer_gdn_prefill_default` decides for a GDN model (head dims 128) with no
    --linear-attn-prefill-backend, the Triton decode backend, static chunking: per domain (state
    dtype, chunk size, CUDA, FlashInfer's SM120 kernel) "flashinfer" or None (Triton). The
    function is compiled alone from its module's file (the module imports the whole model
    runner), beside torch and the conditions held. On a real GPU this box's CUDA and FlashInfer
    count; under a simulated GPU (no kernels load on a CPU) SGLang's loader is held available and
    the CUDA version and SM120 kernel vary. Runs in the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import ast
    import importlib.util
    import sys
    import types
    from types import SimpleNamespace
    from typing import Optional

    import torch

    try:
        spec = importlib.util.find_spec(site.modules[0])
    except ImportError as exc:
        return {"error": site.error(exc)}
    if spec is None or spec.origin is None:
        return {"error": f"no module {site.modules[0]}"}
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in site.functions]
    if len(defs) != 1:
        return {"error": f"{len(defs)} definitions of {site.functions[0]} in {spec.origin}"}
    code = compile(ast.Module(body=[defs[0]], type_ignores=[]), spec.origin, "exec")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    real = site.simulate is None
    domains = [("fp32", 8192), ("fp32", 8193), ("bf16", 8192), ("fp32", 32768)]
    cudas = [torch.version.cuda] if real else ["13.0", "12.9"]
    kernels = ["installed"] if real else ["loaded", "none", "absent"]
    logged: list[str] = []
    decisions: dict[str, object] = {}
    names = ("flashinfer", "flashinfer.gdn_kernels",
             "sglang.srt.layers.attention.linear.kernels.gdn_flashinfer")
    saved_cuda = torch.version.cuda
    saved = {k: sys.modules.get(k) for k in names}
    try:
        for dtype, chunk in domains:
            for cuda in cudas:
                for kernel in kernels:
                    if not real:
                        fi = types.ModuleType(names[0])
                        gdn = types.ModuleType(names[1])
                        if kernel != "absent":
                            gdn.__dict__["chunk_gated_delta_rule_sm120"] = (
                                None if kernel == "none" else object())
                        fi.__dict__["gdn_kernels"] = gdn
                        loader = types.ModuleType(names[2])
                        loader.__dict__["is_flashinfer_gdn_prefill_available"] = lambda: True
                        sys.modules.update(dict(zip(names, (fi, gdn, loader), strict=True)))
                    torch.version.cuda = cuda
                    scope: dict[str, object] = {
                        "__name__": site.modules[0],
                        "torch": torch,
                        "Optional": Optional,
                        "ModelRunner": object,
                        "is_cuda": lambda: True,
                        "get_exec": lambda: SimpleNamespace(
                            mamba=SimpleNamespace(linear_attn_prefill_backend=None,
                                                  linear_attn_backend="triton"),
                            deterministic=SimpleNamespace(enable_deterministic_inference=False)),
                        "get_memory": lambda: SimpleNamespace(enable_page_major_kv_layout=False),
                        "get_schedule": lambda c=chunk: SimpleNamespace(
                            chunked_prefill_size=c, enable_dynamic_chunking=False),
                        "hybrid_gdn_config": lambda config: SimpleNamespace(
                            linear_key_head_dim=128, linear_value_head_dim=128),
                        "rank0_log": logged.append,
                    }
                    pool = SimpleNamespace(temporal=SimpleNamespace(dtype=dtypes[dtype]))
                    runner = SimpleNamespace(
                        model_config=SimpleNamespace(),
                        req_to_token_pool=SimpleNamespace(
                            mamba_pool=SimpleNamespace(mamba_cache=pool)))
                    key = f"{dtype}/chunk {chunk}/cuda {cuda}/kernel {kernel}"
                    try:
                        exec(code, scope)  # the release's own function, alone
                        decisions[key] = scope[defs[0].name](runner)  # type: ignore[operator]
                    except Exception as exc:
                        decisions[key] = f"error: {site.error(exc)}"
    finally:
        torch.version.cuda = saved_cuda
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return {"function": defs[0].name, "decisions": decisions, "log": sorted(set(logged))}


def explain_row(answer: Answer) -> str:
    if "error" in answer:
        return f"error: {answer['error']}"
    picked = sorted(k for k, v in answer["decisions"].items() if v == "flashinfer")
    if not picked:
        return "Triton (FlashInfer in no domain checked)"
    return "FlashInfer for " + "; ".join(picked)


EXPLAIN = Explain(name="gdn_prefill", label="GDN prefill default", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """The admission test reads `(9, 10, 12)`; right after `if sm_major == 10:` comes `elif
    sm_major == 12:` with exactly the patch's body (CUDA 13, the SM120 kernel loaded, chunk 8192,
    fp32 state); with both taken back, the file is the release's."""

    def parts(tree: ast.Module) -> tuple[ast.Compare, ast.If]:
        func = sc.one_function(tree, fact.function)
        admit = sc.one([c for c in ast.walk(func) if isinstance(c, ast.Compare)
                        and ast.unparse(c) in (ADMIT_OLD, ADMIT_NEW)], "admission test")
        sm100 = sc.direct_if(func.body, SM100_TEST)
        return admit, sm100

    admit_b, sm100_b = parts(before)
    assert ast.unparse(admit_b) == ADMIT_OLD, ast.unparse(admit_b)
    assert len(sm100_b.orelse) > 0 and not isinstance(sm100_b.orelse[0], ast.If), "no else"
    restored = copy.deepcopy(after)
    admit, sm100 = parts(restored)
    assert ast.unparse(admit) == ADMIT_NEW, ast.unparse(admit)
    assert len(sm100.orelse) == 1 and isinstance(sm100.orelse[0], ast.If), "no elif after it"
    ours = sm100.orelse[0]
    assert ast.unparse(ours.test) == SM120_TEST, ast.unparse(ours.test)
    want = ast.parse(BRANCH).body[0]
    assert isinstance(want, ast.If)
    assert [ast.dump(s) for s in ours.body] == [ast.dump(s) for s in want.body], (
        ast.unparse(ours))
    spans = sc.Spans([sc.span(admit_b), sc.span(sm100_b)],
                     [sc.span(admit), sc.span(sm100)])
    # Take the change back: the file must be the release's.
    sm100.orelse = ours.orelse
    assert isinstance(admit.comparators[0], ast.Tuple)
    admit.comparators[0].elts = admit.comparators[0].elts[:2]
    sc.same_but(before, restored, "the admission test and the SM120 branch")
    return spans


PATCH = Patch(
    id="sglang.gdn-prefill",
    check=check,
    target="sglang",
    title="FlashInfer's GDN prefill as SM120's default (CUDA 13, chunk <= 8192, fp32 state)",
    why=(
        "SGLang 0.5.19 to 0.5.23 default GDN prefill (Qwen3-Next, Qwen3.5 linear-attention "
        "layers) to FlashInfer on SM90 and SM100 only; SM120 stays on Triton although "
        "SGLang's FlashInfer GDN kernel has an SM120 prefill path and FlashInfer 0.6.14 and "
        "later ship chunk_gated_delta_rule_sm120. The patch admits SM120 with its own branch, "
        "as open https://github.com/sgl-project/sglang/pull/36357 proposes: CUDA 13 or later, "
        "chunked prefill up to 8192 tokens, an fp32 state pool (--mamba-ssm-dtype's default), "
        "and FlashInfer's SM120 kernel loaded; otherwise, and for an explicit "
        "--linear-attn-prefill-backend, upstream decides. SM90 and SM100 are untouched."
    ),
    marker=f"def {SITE}",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/pull/36357",
    wiring=WIRING,
    explain=EXPLAIN,
    transform=transform,
)
