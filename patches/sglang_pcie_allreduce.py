"""sglang.pcie-allreduce: keep SGLang's custom allreduce on more than two PCIe-only GPUs.

SGLang turns its custom allreduce off on more than two GPUs without full NVLink and falls back
to NCCL, whose latency is higher on PCIe boxes. This patch puts one statement before that gate:
on such a box with SM120PATCH_PCIE_ALLREDUCE unset (or anything but "0"), the GPUs count as
fully connected, so the gate passes and the kernels take their fully connected path (the P2P
check that follows still disables it where P2P does not work). SM120PATCH_PCIE_ALLREDUCE=0 in
the server's environment restores upstream behaviour at run time, without a revert.
"""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import imports
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import NotApplicable, Patch, Refuse, Result, Status

ENV = "SM120PATCH_PCIE_ALLREDUCE"
GATE = "world_size > 2 and not full_nvlink"
READ_ENV = f'os.environ.get("{ENV}") != "0"'
OVERRIDE = f"{GATE} and {READ_ENV}"
COMMENT = (
    "# sm120patch pcie-allreduce: PCIe-only GPUs keep the custom allreduce (as if fully",
    f"# connected); {ENV}=0 restores upstream (NCCL). Trial only.",
)
UTILS = "sglang/srt/distributed/device_communicators/custom_all_reduce_utils.py"
CUSTOM_AR = "sglang/srt/distributed/device_communicators/custom_all_reduce.py"
FUNCTIONS = ("can_use_custom_all_reduce_with_nvlink", "CustomAllreduce.__init__")
SHAPE = f"`if {GATE}:` logs a warning and returns (custom allreduce off, NCCL instead)"

FACTS = (
    Fact(releases=">=0.4.6,<0.5.10", status=Status.APPLIED,
         shape=f"CustomAllreduce.__init__: {SHAPE}", file=CUSTOM_AR,
         function="CustomAllreduce.__init__", source="real files"),
    Fact(releases=">=0.5.10,<0.5.21", status=Status.APPLIED,
         shape=f"can_use_custom_all_reduce_with_nvlink: {SHAPE}", file=UTILS,
         function="can_use_custom_all_reduce_with_nvlink", source="real files"),
    Fact(releases=">=0.5.21,<0.5.24", status=Status.APPLIED,
         shape="same; upstream ships FlashInfer's PCIe-IPC "
         "allreduce behind SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", file=UTILS,
         function="can_use_custom_all_reduce_with_nvlink", source="real files",
         user_note="this SGLang ships FlashInfer's PCIe-IPC allreduce for PCIe-only GPUs "
         "(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1), and parallel_state.py tries the custom "
         "allreduce kept on here before it: the profile refuses this release unless --force"),
)


def _is_gate(test: cst.BaseExpression) -> bool:
    """`world_size > 2 and not full_nvlink`, as released."""
    return h.and_codes(test) == h.and_form(GATE)


def _is_override(stmt: cst.CSTNode) -> bool:
    """Our statement: `if <gate> and os.environ.get(ENV) != "0": full_nvlink = True`."""

    return (
        isinstance(stmt, cst.If)
        and h.and_codes(stmt.test) == h.and_form(f"{GATE} and {READ_ENV}")
        and stmt.orelse is None
        and h.code(stmt.body) == "full_nvlink = True"
    )


def transform(module: cst.Module) -> Result:
    gates = [n for n in h.statements(module) if isinstance(n, cst.If) and _is_gate(n.test)]
    if not gates:
        raise NotApplicable(" / ".join(FUNCTIONS), f"no `if {GATE}:` in this file")
    if len(gates) > 1:
        found = f"{len(gates)} such statements"
        raise Refuse(" / ".join(FUNCTIONS), f"one `if {GATE}:`", found)
    gate = gates[0]
    if not imports.imports_module(module, "os"):
        raise Refuse(h.qualified_name(module, gate),
                     "`import os` at module level (the override reads os.environ)", "none")
    nl, ind = module.default_newline, module.default_indent
    override = h.parse_statement(
        "".join(f"{line}{nl}" for line in COMMENT)
        + f"if ({nl}{ind}world_size > 2{nl}{ind}and not full_nvlink{nl}"
        + f'{ind}and os.environ.get("{ENV}") != "0"{nl}):{nl}{ind}full_nvlink = True{nl}',
        module,
    )
    assert isinstance(override, cst.If)
    return op.switch_before_gate(
        module, gate, override, is_switch=_is_override, env=ENV,
        shape=f"`if {OVERRIDE}: full_nvlink = True` before `if {GATE}:`",
    )


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right before the `if world_size > 2 and not full_nvlink:` gate of the fact's function,
    `if world_size > 2 and not full_nvlink and os.environ.get(ENV) != "0": full_nvlink = True`
    (ENV the documented SM120PATCH_PCIE_ALLREDUCE); with that one statement taken out, the file
    is the release's."""
    _, spans = sc.switch_before_gate(
        before, after, fact, "world_size > 2 and (not full_nvlink)",
        'if world_size > 2 and not full_nvlink and os.environ.get("SM120PATCH_PCIE_ALLREDUCE")'
        ' != "0":\n    full_nvlink = True\n',
    )
    assert "os" in sc.module_bindings(after), "os is not imported"
    return spans


PATCH = Patch(
    id="sglang.pcie-allreduce",
    check=check,
    target="sglang",
    title="Keep the custom allreduce on more than two PCIe-only GPUs (env switch back)",
    why=(
        "On more than two GPUs without full NVLink SGLang disables its custom allreduce "
        "('Custom allreduce is disabled because it's not supported on more than two PCIe-only "
        "GPUs') and falls back to NCCL, whose latency is higher on PCIe boxes. The patch adds "
        "one statement before that gate: unless SM120PATCH_PCIE_ALLREDUCE=0 is set in the "
        "server's environment, such GPUs count as fully connected, so the custom allreduce "
        "stays on and its kernels take the fully connected path; the P2P check that follows "
        "still turns it off where GPUs cannot reach each other. SM120PATCH_PCIE_ALLREDUCE=0 "
        "restores upstream behaviour at run time, without reverting."
    ),
    marker=f"if {GATE}:",
    transform=transform,
    facts=FACTS,
)
