"""sglang.pcie-ipc: FlashInfer's PCIe-IPC allreduce on by default on PCIe-only SM120 GPUs.

SGLang 0.5.21 to 0.5.23 ship FlashInfer's PCIe-IPC allreduce, made for hosts whose GPUs talk
over PCIe only, behind SGLANG_ENABLE_PCIE_IPC_ALLREDUCE, off by default (`EnvBool(False)`).
`eligible_group` in pcie_ipc_ar.py decides whether the TP group builds it, and checks only the
variable, the group name, the world size and deterministic inference: nothing about the fabric.
This patch puts one statement before that test: where the variable is unset, the group is TP
and larger than one, the GPU is SM120 (SGLang's own `is_sm120`, exactly 12.0) and NVML does not
report the visible GPUs fully connected by NVLink (SGLang's own `is_full_nvlink`, the test its
custom allreduce makes), it sets the variable to true for this process, so upstream's own
test then passes. An explicit SGLANG_ENABLE_PCIE_IPC_ALLREDUCE (0 or 1) is left as it is.
"""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import NotApplicable, Patch, Refuse, Result, Status
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site

VAR = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
FILE = "sglang/srt/distributed/device_communicators/pcie_ipc_ar.py"
SITE = "eligible_group"
HELPER = "_sm120patch_pcie_only"
# Upstream's test, as released (its `if not (...)`, ending in `return False`).
GATE = (
    f"not (envs.{VAR}.get() and world_size > 1 and group_name in _ELIGIBLE_GROUP_NAMES)"
)
SWITCH_TEST = (
    f"not envs.{VAR}.is_set() and world_size > 1 "
    f"and group_name in _ELIGIBLE_GROUP_NAMES and {HELPER}()"
)
SWITCH_BODY = f"envs.{VAR}.set(True)"
COMMENT = (
    "# sm120patch pcie-ipc: unset, the PCIe-IPC allreduce is on for SM120 GPUs without full",
    f"# NVLink; an explicit {VAR} (0 or 1) is kept. Trial only.",
)
HELPER_SOURCE = '''def {name}() -> bool:
    """sm120patch pcie-ipc: SM120 (SGLang's is_sm120) and the visible GPUs not fully connected
    by NVLink (SGLang's is_full_nvlink, as its custom allreduce asks NVML)."""
    import os

    from sglang.srt.distributed.device_communicators.custom_all_reduce_utils import (
        is_full_nvlink,
    )
    from sglang.srt.utils import is_sm120

    if not is_sm120():
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if visible:
            ids = [int(i) for i in visible.split(",")]
        else:
            ids = list(range(torch.cuda.device_count()))
    except ValueError:  # UUIDs: the fabric is unknown here, so upstream decides
        return False
    return len(ids) > 1 and not is_full_nvlink(ids, len(ids))
'''

FACTS = (
    Fact(releases="<0.5.21", status=Status.NOT_APPLICABLE,
         shape="no PCIe-IPC allreduce in SGLang", source="released files"),
    Fact(releases=">=0.5.21,<0.5.24", status=Status.APPLIED,
         shape=f"{SITE}: `if {GATE}: return False`; the variable is EnvBool(False)",
         file=FILE, function=SITE, source="released files",
         note="read off 0.5.21, 0.5.22 and 0.5.23: pcie_ipc_ar.py is the same file in each"),
)


def _unparsed(text: str) -> str:
    """`text` as Python reads it (parentheses, spaces and line breaks folded)."""
    return ast.unparse(ast.parse(text, mode="eval").body)


def _is_gate(test: cst.BaseExpression) -> bool:
    """Upstream's `not (envs.VAR.get() and world_size > 1 and group_name in ...)`, as released
    (over several lines: compared as Python reads it)."""
    text = cst.Module(body=[]).code_for_node(test)
    try:
        return _unparsed(text.strip()) == _unparsed(GATE)
    except SyntaxError:
        return False


def _is_switch(stmt: cst.CSTNode) -> bool:
    """Our statement: `if <unset and SM120 without full NVLink>: envs.VAR.set(True)`."""

    return (
        isinstance(stmt, cst.If)
        and h.and_codes(stmt.test) == h.and_form(SWITCH_TEST)
        and stmt.orelse is None
        and h.code(stmt.body) == SWITCH_BODY
    )


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, SITE)
    gates = [n for n in h.statements(func) if isinstance(n, cst.If) and _is_gate(n.test)]
    if not gates:
        raise NotApplicable(SITE, f"no `if {GATE}:` in {SITE}")
    if len(gates) > 1:
        raise Refuse(SITE, f"one `if {GATE}:`", f"{len(gates)} such statements")
    nl, ind = module.default_newline, module.default_indent
    switch = h.parse_statement(
        "".join(f"{line}{nl}" for line in COMMENT)
        + f"if ({nl}{ind}not envs.{VAR}.is_set(){nl}{ind}and world_size > 1{nl}"
        + f"{ind}and group_name in _ELIGIBLE_GROUP_NAMES{nl}{ind}and {HELPER}(){nl}):{nl}"
        + f"{ind}{SWITCH_BODY}{nl}",
        module,
    )
    assert isinstance(switch, cst.If)
    shape = f"`if {SWITCH_TEST}: {SWITCH_BODY}` before `if {GATE}:`"
    res = op.switch_before_gate(module, gates[0], switch, is_switch=_is_switch, env=HELPER,
                                shape=shape)
    if res.status is not Status.APPLIED:
        return res
    helper = op.add_function_after(
        res.module, op.one_def(res.module, SITE), HELPER_SOURCE.format(name=HELPER), site=SITE,
    )
    return op.then(res, helper, shape=shape)


def explain_read(site: Site) -> Reading:
    """What the release's own `eligible_group` answers for a TP group of four GPUs (visible as
    0,1,2,3), per SGLANG_ENABLE_PCIE_IPC_ALLREDUCE (unset, "0", "1") and per fabric (NVML's NVLink
    answer held: "pcie" none, "nvlink" full), with deterministic inference off. The variable is
    restored after each call. Runs in the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib
    import importlib.util
    import os
    from typing import Any

    var = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
    utils: Any
    try:
        if importlib.util.find_spec(site.modules[0]) is None:
            return {"absent": True}  # before SGLang 0.5.21: no PCIe-IPC allreduce
        module = importlib.import_module(site.modules[0])
        utils = importlib.import_module(
            "sglang.srt.distributed.device_communicators.custom_all_reduce_utils")
    except Exception as exc:
        return {"error": site.error(exc)}
    decide = getattr(module, site.functions[0])
    saved = {k: os.environ.get(k) for k in (var, "CUDA_VISIBLE_DEVICES")}
    saved_nvlink = utils.is_full_nvlink
    decisions: dict[str, object] = {}
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
        for fabric in ("pcie", "nvlink"):
            utils.is_full_nvlink = lambda ids, n, full=fabric == "nvlink": full
            for value in (None, "0", "1"):
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
                key = f"{fabric}/{var}={'unset' if value is None else value}"
                try:
                    decisions[key] = decide(group_name="tp", world_size=4, deterministic=False)
                except Exception as exc:
                    decisions[key] = f"error: {site.error(exc)}"
    finally:
        utils.is_full_nvlink = saved_nvlink
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"function": site.functions[0], "decisions": decisions}


def explain_row(answer: Answer) -> str:
    if "error" in answer:
        return f"error: {answer['error']}"
    if answer.get("absent"):
        return "not in this SGLang (0.5.21 on)"
    on = sorted(k for k, v in answer["decisions"].items() if v is True)
    return "on for " + "; ".join(on) if on else "off unless set"


EXPLAIN = Explain(name="pcie_ipc", label="PCIe-IPC allreduce (TP4)", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right before `eligible_group`'s `if not (envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get() and
    ...): return False`, `if not envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.is_set() and world_size
    > 1 and group_name in _ELIGIBLE_GROUP_NAMES and _sm120patch_pcie_only():
    envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.set(True)`; right after `def eligible_group`, the
    helper asking SGLang's is_sm120 and is_full_nvlink; with both taken out the file is the
    release's."""
    helper = sc.helper_after(after, fact.function, HELPER, HELPER_SOURCE.format(name=HELPER))
    stripped = sc.without(after, [helper])
    _, spans = sc.switch_before_gate(
        before, stripped, fact,
        ast.unparse(ast.parse("not (envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get() and "
                              "world_size > 1 and group_name in _ELIGIBLE_GROUP_NAMES)",
                              mode="eval").body),
        "if not envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.is_set() and world_size > 1 and "
        "group_name in _ELIGIBLE_GROUP_NAMES and _sm120patch_pcie_only():\n"
        "    envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.set(True)\n",
    )
    assert {"envs", "torch", "_ELIGIBLE_GROUP_NAMES"} <= sc.module_bindings(after), (
        "envs, torch or _ELIGIBLE_GROUP_NAMES is not bound at module level"
    )
    return sc.Spans([], [*spans.after, sc.with_blank_lines(helper, 2)])


PATCH = Patch(
    id="sglang.pcie-ipc",
    check=check,
    target="sglang",
    title="FlashInfer's PCIe-IPC allreduce on by default on PCIe-only SM120 GPUs",
    why=(
        "SGLang 0.5.21 and later ship FlashInfer's PCIe-IPC allreduce for hosts whose GPUs "
        "talk over PCIe only, off unless SGLANG_ENABLE_PCIE_IPC_ALLREDUCE is set; its module "
        "reports it 38x faster than NCCL at 12 KiB on one 8x SM120 host. The patch adds one "
        "statement before upstream's test in eligible_group: with the variable unset, on SM120 "
        "GPUs that NVML does not report fully connected by NVLink (SGLang's own is_sm120 and "
        "is_full_nvlink), it sets the variable for the process, so the TP group builds the "
        "communicator. SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0 in the server's environment keeps it "
        "off at run time, without reverting; =1 keeps it on anywhere, as upstream."
    ),
    marker=f"{HELPER}()",
    explain=EXPLAIN,
    transform=transform,
    facts=FACTS,
)
