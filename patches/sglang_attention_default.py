"""sglang.attention-default: trtllm_mha as SM120's default attention backend for MHA (site H).

`get_default_attn_backend` (arg_groups/model_override_base.py, 0.5.19 on) picks trtllm_mha for
MHA models on SM100 only; SM120 falls to flashinfer (triton with attention sinks). From 0.5.19
upstream runs trtllm_mha on SM120 (FMHAv2 prefill, XQA decode) and its attention hook accepts
it there, refusing an fp8_e4m3 KV cache, skip-softmax prefill and prefill context parallelism.
The patch adds one branch right after the SM100 one, `elif get_platform().is_sm120 and
_sm120_trtllm_mha_fits(cfg, model_config): return "trtllm_mha"`, and the helper after the
function. The helper says yes only where neither the hook nor the backend would refuse or fail:
a bf16 KV cache (or `auto` over an unquantized or MXFP4 checkpoint, whose KV cache stays in the
model dtype: a quantized checkpoint may carry an FP8 KV cache the hook cannot see), no
speculative decoding (the XQA decode rejects ragged verify), no prefill context parallelism, no
skip-softmax threshold, equal K/V head widths, and no linear-attention layers (for those,
upstream's SM100 choice is made in model overrides that are SM100-only).
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.helpers import ensure_type

from sm120patch.patchkit import imports
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

SITE = "get_default_attn_backend"
HELPER = "_sm120_trtllm_mha_fits"
BACKEND = "trtllm_mha"
SM100 = "get_platform().is_sm100"
SM120 = "get_platform().is_sm120"
COMMENT = "# sm120patch attention: SM120 runs trtllm_mha as FMHAv2 prefill and XQA decode."
HELPER_SOURCE = '''\
def {name}(cfg: Any, model_config: Any) -> bool:
    """Whether trtllm_mha may be SM120's default for this MHA launch (added by sm120patch
    attention). On SM120 trtllm_mha is FMHAv2 prefill and XQA decode: the attention hook
    refuses it with an fp8_e4m3 KV cache, a skip-softmax threshold or prefill context
    parallelism, and the backend fails with a native NVFP4 KV cache, ragged speculative
    verify and unequal K/V head widths. So: a bf16 KV cache, or `auto` over an unquantized
    or MXFP4 checkpoint (a quantized checkpoint may carry an FP8 KV cache that only model
    loading sees); no speculative decoding; no linear-attention layers, whose SM100 choice
    upstream makes in model overrides of their own."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.environ import envs

    kv_cache = cfg.kv_cache_dtype
    plain_kv = kv_cache in ("bf16", "bfloat16") or (
        kv_cache == "auto" and model_config.quantization in (None, "mxfp4")
    )
    context_parallel = (
        getattr(cfg, "enable_prefill_context_parallel", False) or cfg.attn_cp_size > 1
    )
    skip_softmax = envs.SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR.get() or 0.0
    return (
        plain_kv
        and cfg.speculative_algorithm is None
        and not context_parallel
        and skip_softmax <= 0
        and not model_config.has_asymmetric_kv
        and mambaish_config(model_config) is None
    )
'''
EXPECTED = (
    "in the MHA branch (`if not use_mla_backend:`) one `elif get_platform().is_sm100 and "
    "...:` branch returning trtllm_mha, and `cfg = resolving_view(server_args)`"
)


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, SITE, f"no `def {SITE}` in this file (it exists from 0.5.19)")
    if not isinstance(func.body, cst.IndentedBlock):
        raise Refuse(SITE, EXPECTED, f"`{h.code(func)}`")
    if not any(_assigns(s, "cfg") for s in func.body.body):
        raise Refuse(SITE, EXPECTED, "no `cfg = ...` in the function")
    mha = [
        s
        for s in func.body.body
        if isinstance(s, cst.If) and h.code(s.test) == "not use_mla_backend"
    ]
    if len(mha) != 1:
        raise Refuse(SITE, EXPECTED, f"{len(mha)} `if not use_mla_backend:` statements")
    branches = op.branches_in(mha[0].body)
    sm100 = [b for b in branches if h.key(h.and_operands(b.test)[0]) == SM100]
    sm120 = [b for b in branches if _mentions(b.test, "is_sm120")]
    helper = _defines(module, HELPER)
    if sm120:
        if (
            len(sm120) == 1
            and _is_ours(sm120[0])
            and helper
            and sm100
            and sm100[0].orelse is sm120[0]
        ):
            return already_applied(SITE, f"`elif {SM120} and {HELPER}(...):` after the SM100 one")
        if len(sm120) == 1 and not _is_ours(sm120[0]) and _returns(sm120[0].body, BACKEND):
            return upstream(SITE, f"the release's own default picks {BACKEND} on SM120")
        raise Refuse(
            SITE,
            "no SM120 branch, or ours right after the SM100 one",
            f"`if {h.code(sm120[0].test)}:`",
        )
    if helper:
        raise Refuse(SITE, f"no `def {HELPER}` without its branch", "the helper alone")
    if not imports.binds_at_module_level(module, "Any"):
        raise Refuse(SITE, "`from typing import Any` (the helper's annotations)", "none")
    if len(sm100) != 1 or not _returns(sm100[0].body, BACKEND):
        found = "; ".join(f"`{h.code(b.test)}`" for b in sm100) or "no SM100 branch"
        raise Refuse(SITE, EXPECTED, found)
    anchor = sm100[0]

    nl = module.default_newline
    test = cst.parse_expression(f"{SM120} and {HELPER}(cfg, model_config)")
    template = f'if x:{nl}    {COMMENT}{nl}    return "{BACKEND}"{nl}'
    body = ensure_type(h.parse_statement(template, module), cst.If).body
    branch = op.new_elif(anchor, test, body)
    res = op.add_function_after(module, func, HELPER_SOURCE.format(name=HELPER), site=SITE)
    res = op.then(res, op.add_elif(res.module, anchor, branch, site=SITE, shape=""))
    if res.status is not Status.APPLIED:
        return res
    return applied(
        SITE,
        res.module,
        f'`elif {SM120} and {HELPER}(cfg, model_config): return "{BACKEND}"` after '
        f"`elif {SM100} and ...:`; `def {HELPER}` added after {SITE}",
    )


def _assigns(stmt: cst.CSTNode, name: str) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
        and len(stmt.body[0].targets) == 1
        and isinstance(stmt.body[0].targets[0].target, cst.Name)
        and stmt.body[0].targets[0].target.value == name
    )


def _mentions(node: cst.CSTNode, attr: str) -> bool:
    def named(n: cst.CSTNode) -> bool:
        if isinstance(n, cst.Attribute):
            return n.attr.value.startswith(attr)
        return isinstance(n, cst.Name) and n.value.startswith(attr)

    return bool(h.matching_nodes(node, (cst.Attribute, cst.Name), named))


def _returns(body: cst.BaseSuite, value: str) -> bool:
    return any(
        isinstance(r, cst.Return)
        and isinstance(r.value, cst.SimpleString)
        and r.value.evaluated_value == value
        for r in h.matching_nodes(body, cst.Return)
    )


def _is_ours(branch: cst.If) -> bool:
    ops = h.and_operands(branch.test)
    return (
        len(ops) == 2
        and h.key(ops[0]) == SM120
        and h.code(ops[1]) == f"{HELPER}(cfg, model_config)"
        and _returns(branch.body, BACKEND)
    )


def _defines(module: cst.Module, name: str) -> bool:
    return any(isinstance(s, cst.FunctionDef) and s.name.value == name for s in module.body)


BASE = "sglang/srt/arg_groups/model_override_base.py"
FACTS = (
    Fact(
        releases="<0.5.19",
        status=Status.NOT_APPLICABLE,
        shape="no arg_groups/model_override_base.py: the default is ServerArgs."
        "_get_default_attn_backend, and upstream refuses trtllm_mha prefill on SM120 there "
        "(the whole backend before 0.5.10)",
        source="real files",
        note="the attention profile is pinned from 0.5.19",
    ),
    Fact(
        releases=">=0.5.19,<0.5.24",
        status=Status.APPLIED,
        shape="MHA: `elif get_platform().is_sm100 and is_no_spec_infer_or_topk_one(...) and "
        "(...):` returns fa4 or trtllm_mha; SM120 falls to flashinfer (triton with sinks)",
        file=BASE,
        function=SITE,
        form="platform",
        source="real files",
    ),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right after the MHA chain's SM100 branch, `elif get_platform().is_sm120 and
    _sm120_trtllm_mha_fits(cfg, model_config): return "trtllm_mha"`; the helper right after the
    function, exactly ours; with both taken out, the file is the release's."""
    def sm100_branch(tree: ast.Module) -> ast.If:
        mha = sc.direct_if(sc.one_function(tree, fact.function).body, "not use_mla_backend")
        return sc.one([b for b in ast.walk(mha) if isinstance(b, ast.If)
                       and isinstance(b.test, ast.BoolOp)
                       and sc.arch_of(b.test.values[0]) == 100], "SM100 branch")

    sm100 = sm100_branch(after)
    assert len(sm100.orelse) == 1 and isinstance(sm100.orelse[0], ast.If), "no elif after it"
    ours = sm100.orelse[0]
    assert ast.unparse(ours.test) == (
        f"get_platform().is_sm120 and {HELPER}(cfg, model_config)"
    ), ast.unparse(ours.test)
    assert [ast.unparse(s) for s in ours.body] == ["return 'trtllm_mha'"]
    node = sc.helper_after(after, fact.function, HELPER, HELPER_SOURCE.format(name=HELPER))
    restored = sc.without(after, [node])
    r100 = sm100_branch(restored)
    r100.orelse = ours.orelse
    sc.same_but(before, restored, "the SM120 branch and the helper")
    return sc.Spans([sc.span(sm100)], [sc.span(sm100), sc.with_blank_lines(node, 2)])


PATCH = Patch(
    id="sglang.attention-default",
    check=check,
    target="sglang",
    title="trtllm_mha as SM120's default attention backend for MHA models",
    why=(
        "SGLang's default attention backend for MHA models is trtllm_mha on SM100 only; on "
        "SM120 it is flashinfer (triton with attention sinks), although from 0.5.19 upstream "
        "runs trtllm_mha on SM120 (FMHAv2 prefill, XQA decode) and accepts it there. The "
        "patch adds an SM120 branch after the SM100 one that returns trtllm_mha where "
        "upstream's attention hook and the backend would neither refuse nor fail: a bf16 KV "
        "cache, or `auto` over an unquantized or MXFP4 checkpoint; no speculative decoding; "
        "no prefill context parallelism or skip-softmax threshold; equal K/V head widths; no "
        "linear-attention layers. Everything else keeps upstream's default; an explicit "
        "--attention-backend is untouched."
    ),
    marker=f"def {SITE}",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/issues/9140",
    transform=transform,
)
