"""vllm.pcie-allreduce: keep vLLM's custom allreduce on more than two PCIe-only GPUs.

vLLM turns its custom allreduce off on more than two GPUs of one node that NVML does not report
fully connected by NVLink, and its TP all-reduces go to PyNCCL. This patch puts one statement
before that gate, the twin of sglang.pcie-allreduce: on such a box with
SM120PATCH_PCIE_ALLREDUCE unset (or anything but "0"), the GPUs count as fully connected, so
the gate passes. That one local is all the rest reads: `self.fully_connected` (the per-call
`should_custom_ar` returns False for more than two GPUs that are not fully connected) and the
`fully_connected` vLLM hands to its kernels (`ops.init_custom_ar`), whose dispatch launches
nothing for more than two GPUs without it. The P2P check that follows still disables the
custom allreduce where P2P does not work. SM120PATCH_PCIE_ALLREDUCE=0 in the server's
environment restores upstream behaviour at run time, without a revert.

vLLM's custom_all_reduce.py imports no `os`: the statement reads the variable through
`__import__("os")`, so the patch stays one statement and the module's imports are untouched.
"""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import imports
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
    Wiring,
)

ENV = "SM120PATCH_PCIE_ALLREDUCE"
GATE = "same_node and world_size > 2 and not fully_connected"
READ_ENV = f'__import__("os").environ.get("{ENV}") != "0"'
OVERRIDE = f"{GATE} and {READ_ENV}"
COMMENT = (
    "# sm120patch pcie-allreduce: PCIe-only GPUs keep the custom allreduce (as if fully",
    f"# connected); {ENV}=0 restores upstream (PyNCCL). Trial only.",
)
CUSTOM_AR = "vllm/distributed/device_communicators/custom_all_reduce.py"
FUNCTION = "CustomAllreduce.__init__"
SHAPE = (
    f"`if {GATE}:` logs a warning and returns (custom allreduce off, PyNCCL instead); "
    "should_custom_ar reads self.fully_connected"
)

FACTS = (
    Fact(releases=">=0.30.0,<0.35", status=Status.APPLIED, shape=f"{FUNCTION}: {SHAPE}",
         file=CUSTOM_AR, function=FUNCTION, source="released files",
         note="read off 0.30.0 to 0.34.0: the gate, the P2P check after it and "
         "`self.fully_connected = fully_connected` are the same text in each"),
)


def _is_gate(test: cst.BaseExpression) -> bool:
    """`same_node and world_size > 2 and not fully_connected`, as released."""
    return h.and_codes(test) == h.and_form(GATE)


def _is_override(stmt: cst.CSTNode) -> bool:
    """Our statement: `if <gate> and <ENV is not "0">: fully_connected = True`."""

    return (
        isinstance(stmt, cst.If)
        and h.and_codes(stmt.test) == h.and_form(f"{GATE} and {READ_ENV}")
        and stmt.orelse is None
        and h.code(stmt.body) == "fully_connected = True"
    )


def transform(module: cst.Module) -> Result:
    gates = [n for n in h.statements(module) if isinstance(n, cst.If) and _is_gate(n.test)]
    if not gates:
        raise NotApplicable(FUNCTION, f"no `if {GATE}:` in this file")
    if len(gates) > 1:
        raise Refuse(FUNCTION, f"one `if {GATE}:`", f"{len(gates)} such statements")
    gate = gates[0]
    site = h.qualified_name(module, gate)
    if site != FUNCTION:
        raise Refuse(site, f"`if {GATE}:` in {FUNCTION}", f"it in {site}")
    rebound = h.module_assignments(module, "__import__")
    if imports.binds_at_module_level(module, "__import__") or rebound:
        # The statement calls the builtin; a module rebinding the name would get its own.
        raise Refuse(site, "`__import__` left to the builtin", "a module-level binding of it")
    nl, ind = module.default_newline, module.default_indent
    operands = [*GATE.split(" and "), READ_ENV]
    switch = h.parse_statement(
        "".join(f"{line}{nl}" for line in COMMENT)
        + f"if ({nl}{ind}" + f"{nl}{ind}and ".join(operands) + f"{nl}):{nl}"
        + f"{ind}fully_connected = True{nl}",
        module,
    )
    assert isinstance(switch, cst.If)
    return op.switch_before_gate(
        module, gate, switch, is_switch=_is_override, env=ENV,
        shape=f"`if {OVERRIDE}: fully_connected = True` before `if {GATE}:`",
    )


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """Right before the `if same_node and world_size > 2 and not fully_connected:` gate of
    CustomAllreduce.__init__, `if <that test> and __import__("os").environ.get(ENV) != "0":
    fully_connected = True` (ENV the documented SM120PATCH_PCIE_ALLREDUCE); the gate, its
    `return` and the P2P check after it as released; with that one statement taken out, the
    file is the release's."""
    gate, spans = sc.switch_before_gate(
        before, after, fact, "same_node and world_size > 2 and (not fully_connected)",
        "if same_node and world_size > 2 and not fully_connected and "
        '__import__("os").environ.get("SM120PATCH_PCIE_ALLREDUCE") != "0":\n'
        "    fully_connected = True\n",
    )
    assert isinstance(gate.body[-1], ast.Return), "gate changed"
    assert "__import__" not in sc.module_bindings(after), "__import__ is rebound"
    return spans


PATCH = Patch(
    id="vllm.pcie-allreduce",
    check=check,
    target="vllm",
    title="Keep vLLM's custom allreduce on more than two PCIe-only GPUs (env switch back)",
    why=(
        "On more than two GPUs of one node without full NVLink vLLM disables its custom "
        "allreduce ('Custom allreduce is disabled because it's not supported on more than two "
        "PCIe-only GPUs') and its TP all-reduces go to PyNCCL. The patch adds one statement "
        "before that gate: unless SM120PATCH_PCIE_ALLREDUCE=0 is set in the server's "
        "environment, such GPUs count as fully connected, so the custom allreduce stays on, "
        "should_custom_ar takes messages below its size limit (8 MiB, the constructor's "
        "default: SM120 has no CUSTOM_ALL_REDUCE_MAX_SIZES row and that table is read only "
        "with SymmMem on) and the kernels take their fully connected path; the P2P check that "
        "follows still turns it off where GPUs cannot reach each other. "
        "SM120PATCH_PCIE_ALLREDUCE=0 restores upstream behaviour at run time, without reverting."
    ),
    marker=f"if {GATE}:",
    transform=transform,
    facts=FACTS,
    sought=Sought(FUNCTION, ("fully_connected",)),
    # vLLM's own lines (custom_all_reduce.py, cuda_communicator.py): the list of the TP group's
    # all-reduce backends names CUSTOM only where the communicator was kept on; the two
    # warnings are what turns it off on such a box (the gate, then the P2P check).
    wiring=Wiring(
        ran=(r"Using \[[^\]]*'CUSTOM'[^\]]*\] all-reduce backends \(in dispatch order\) "
             r"for group 'tp:",),
        skipped=(
            r"Custom allreduce is disabled because it's not supported on more than two "
            r"PCIe-only GPUs",
            r"Custom allreduce is disabled because your platform lacks GPU P2P capability",
        ),
    ),
)
