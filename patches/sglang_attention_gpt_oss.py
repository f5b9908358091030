"""sglang.attention-gpt-oss: GPT-OSS takes the default attention backend on SM120 (site H).

GPT-OSS's model override (arg_groups/model_overrides/gpt_oss.py, 0.5.19 on) sets the attention
backend itself when none is given: trtllm_mha on SM100, fa3 on SM90, and on SM120 it falls
through to triton. The patch adds `elif get_platform().is_sm120:` right after the SM100 branch,
asking the release's own `get_default_attn_backend` (as the Qwen3.5 override does): unpatched,
that answers triton for GPT-OSS (an attention-sink model) on SM120, so nothing changes; with
sglang.attention-default it answers trtllm_mha where SM120 can run it (for sinks on SM12x,
https://github.com/flashinfer-ai/flashinfer/issues/4070 was closed saying they "should be
available starting 0.6.16", and https://github.com/vllm-project/vllm/pull/52148 later found
FlashInfer's generic FA2 prefill on SM12x ignoring them).
"""

from __future__ import annotations

import ast
import copy

import libcst as cst
from libcst.helpers import ensure_type

from sm120patch.patchkit import imports
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    Import,
    Patch,
    Refuse,
    Result,
    Status,
    already_applied,
    applied,
    upstream,
)

SITE = "_gpt_oss_overrides"
SM100 = "get_platform().is_sm100"
SM120 = "get_platform().is_sm120"
BASE_MODULE = "sglang.srt.arg_groups.model_override_base"
# name -> the name it is imported right after (the import keeps its alphabetical order)
IMPORTS = (
    ("get_default_attn_backend", "_register_for"),
    ("model_config_of", "is_attention_backend_not_set"),
    ("use_mla_backend", "resolving_view"),
)
TARGET = 'overrides["attention_backend"]'
VALUE = (
    "get_default_attn_backend(\n"
    "    server_args,\n"
    "    use_mla_backend=use_mla_backend(server_args),\n"
    "    model_config=model_config_of(server_args),\n"
    ")"
)
EXPECTED = (
    "`if is_attention_backend_not_set(cfg):` holding `if get_platform().is_sm100: "
    'overrides["attention_backend"] = "trtllm_mha"` and no SM120 branch'
)


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, SITE, f"no `def {SITE}` in this file (it exists from 0.5.19)")
    gates = [
        n
        for n in h.statements(func)
        if isinstance(n, cst.If) and h.code(n.test) == "is_attention_backend_not_set(cfg)"
    ]
    if len(gates) != 1:
        raise Refuse(SITE, EXPECTED, f"{len(gates)} `if is_attention_backend_not_set(cfg):`")
    branches = op.branches_in(gates[0].body)
    sm100 = [b for b in branches if h.key(b.test) == SM100]
    sm120 = [b for b in branches if h.key(b.test) == SM120]
    if sm120:
        ours = sm120[0]
        if len(sm120) == 1 and sm100 and sm100[0].orelse is ours and _is_ours(ours):
            return already_applied(SITE, f"`elif {SM120}:` asking get_default_attn_backend")
        if len(sm120) == 1 and _sets_trtllm(ours):
            return upstream(SITE, "GPT-OSS's override already picks trtllm_mha on SM120")
        raise Refuse(SITE, EXPECTED, f"`elif {h.code(ours.test)}: {h.code(ours.body)}`")
    if len(sm100) != 1 or not _sets_trtllm(sm100[0]):
        raise Refuse(SITE, EXPECTED, f"{len(sm100)} `if {SM100}:` branches")
    if not imports.binds_at_module_level(module, "resolving_view"):
        raise Refuse(SITE, f"`from {BASE_MODULE} import (...)`", "no such import")
    nl = module.default_newline
    lines = f"{TARGET} = {VALUE}".split("\n")
    template = f"if x:{nl}" + "".join(f"    {line}{nl}" for line in lines)
    body = ensure_type(h.parse_statement(template, module), cst.If).body
    branch = op.new_elif(sm100[0], cst.parse_expression(SM120), body)
    res = op.add_elif(module, sm100[0], branch, site=SITE, shape="")
    if res.status is not Status.APPLIED:
        return res
    # The names the new branch calls: the runner places each next to its sibling import.
    wanted = (Import(name, next_to=after, module=BASE_MODULE) for name, after in IMPORTS)
    return applied(
        SITE,
        res.module,
        f"`elif {SM120}:` after `if {SM100}:` setting the attention backend to "
        "get_default_attn_backend(...)",
    ).needing(*wanted)


def _sets_trtllm(branch: cst.If) -> bool:
    return any(
        isinstance(a, cst.Assign)
        and len(a.targets) == 1
        and h.code(a.targets[0].target) == TARGET
        and isinstance(a.value, cst.SimpleString)
        and a.value.evaluated_value == "trtllm_mha"
        for a in h.matching_nodes(branch.body, cst.Assign)
    )


def _is_ours(branch: cst.If) -> bool:
    assigns = h.matching_nodes(branch.body, cst.Assign)
    return len(assigns) == 1 and "".join(h.code(assigns[0], 400).split()) == "".join(
        f"{TARGET} = {VALUE}".split()
    )


GPT_OSS = "sglang/srt/arg_groups/model_overrides/gpt_oss.py"
FACTS = (
    Fact(
        releases="<0.5.19",
        status=Status.NOT_APPLICABLE,
        shape="no arg_groups/model_overrides/gpt_oss.py (the GPT-OSS override is in "
        "server_args.py or arg_groups/overrides.py)",
        source="real files",
        note="the attention profile is pinned from 0.5.19",
    ),
    Fact(
        releases=">=0.5.19,<0.5.24",
        status=Status.APPLIED,
        shape="`if is_attention_backend_not_set(cfg): if get_platform().is_sm100: "
        'overrides["attention_backend"] = "trtllm_mha"` ... SM120 falls to triton',
        file=GPT_OSS,
        function=SITE,
        form="platform",
        source="real files",
    ),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right after `if get_platform().is_sm100:`, `elif get_platform().is_sm120:` setting the
    attention backend to get_default_attn_backend(...), with the three names imported from
    model_override_base; with those taken out, the file is the release's."""

    sm100 = sc.one_if(sc.one_function(after, fact.function), "get_platform().is_sm100")
    ours = sc.one(sm100.orelse, "statement after the SM100 branch")
    assert isinstance(ours, ast.If) and ast.unparse(ours.test) == "get_platform().is_sm120"
    assert [ast.unparse(s) for s in ours.body] == [
        "overrides['attention_backend'] = get_default_attn_backend(server_args, "
        "use_mla_backend=use_mla_backend(server_args), "
        "model_config=model_config_of(server_args))"
    ]
    gained = set(sc.imported(after)) - set(sc.imported(before))
    assert gained == {"get_default_attn_backend", "model_config_of", "use_mla_backend"}, gained
    assert {sc.imported(after)[n][0] for n in gained} == {
        "sglang.srt.arg_groups.model_override_base"}
    restored = copy.deepcopy(after)
    r100 = sc.one_if(sc.one_function(restored, fact.function), "get_platform().is_sm100")
    r100.orelse = ours.orelse
    for name in gained:
        restored = sc.drop_import(restored, name)
    sc.same_but(before, restored, "the SM120 branch and its imports")
    spans = sc.Spans([sc.span(sm100)], [sc.span(sm100)])
    for name in gained:
        spans.after.append(sc.imported(after)[name][1])
        spans.before.append(sc.imported(before)["resolving_view"][1])
    return spans


PATCH = Patch(
    id="sglang.attention-gpt-oss",
    check=check,
    target="sglang",
    title="GPT-OSS on SM120 takes the default attention backend instead of triton",
    why=(
        "GPT-OSS's override sets trtllm_mha on SM100 and falls to triton on SM120. The patch "
        "makes SM120 ask get_default_attn_backend, as the Qwen3.5 override does: without "
        "sglang.attention-default that is triton for GPT-OSS (a model with attention sinks), "
        "with it trtllm_mha where SM120 can run it. For sinks on SM12x, FlashInfer's "
        "maintainers closed https://github.com/flashinfer-ai/flashinfer/issues/4070 saying the "
        'fix "should be available starting 0.6.16"; later '
        "https://github.com/vllm-project/vllm/pull/52148 found FlashInfer's generic FA2 prefill "
        "path on SM12x accepting a sinks argument without applying it. Whether trtllm_mha's "
        "prefill applies GPT-OSS's sinks on SM120 is unmeasured: a trial should judge the output."
    ),
    marker=f"def {SITE}",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/issues/9140",
    transform=transform,
)
