"""sglang.sm120-flag: define `_is_sm120_supported` next to the SM100 flag (site A).

The fusion gate (site B, patch sglang.fusion-gate) tests module flags of the module it lives
in; no release defines an SM120 one, so this patch adds it in the form the SM100 flag uses.
"""

from __future__ import annotations

import ast
from dataclasses import replace

import libcst as cst

from sm120patch.patchkit import arch
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Refuse, Result, Status

SITE = "_is_sm120_supported"
ANCHOR = "_is_sm100_supported"
UTILS = "sglang.srt.utils"
# The CUDA half of the SM100 flag, copied as is into the SM120 flag.
CUDA_FORMS = ("_is_cuda", "is_cuda()")
# The SM100 half, whose SM120 twin (`arch.sglang_arch_twin`) the new flag uses: the call form
# needs is_sm120_supported imported from sglang.srt.utils, `get_platform()` nothing new.
ARCH_FORMS = {"is_sm100_supported()": "call", "get_platform().is_sm100": "platform"}
KNOWN = (
    f"`{ANCHOR} = _is_cuda and is_sm100_supported()` (or `is_cuda() and ...`, "
    "or `_is_cuda and get_platform().is_sm100`)"
)


def _and_keys(stmt: cst.SimpleStatementLine) -> tuple[str | None, str | None] | None:
    """(left, right) of a module flag `name = left and right`, each as `cst_helpers.key`."""

    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign):
        return None
    value = assign.value
    if not (isinstance(value, cst.BooleanOperation) and isinstance(value.operator, cst.And)):
        return None
    return h.key(value.left), h.key(value.right)


def transform(module: cst.Module) -> Result:
    anchors = h.module_assignments(module, ANCHOR)
    cuda, sm120, needs = "", "", None  # no single SM100 flag: add_module_flag refuses
    if len(anchors) == 1:
        keys = _and_keys(anchors[0])
        left, sm100 = keys if keys is not None else (None, None)
        twin = arch.sglang_arch_twin(sm100)
        if left not in CUDA_FORMS or sm100 not in ARCH_FORMS or twin is None:
            raise Refuse(SITE, KNOWN, f"`{h.code(anchors[0])}`")
        cuda, sm120 = left, twin
        # From sglang.srt.utils itself: it has is_sm120_supported from 0.5.4 on, while the
        # releases before 0.5.2 import is_sm100_supported from another module.
        call = arch.sglang_arch_import("sm120", ARCH_FORMS[sm100])
        needs = call and replace(call, module=UTILS)
    form = f"{cuda} and {sm120}"
    existing = h.module_assignments(module, SITE)
    return op.add_module_flag(
        module,
        name=SITE,
        sibling=ANCHOR,
        value=form,
        same=len(existing) == 1 and _and_keys(existing[0]) == (cuda, sm120),
        expected=f"one module flag {KNOWN}",
    ).needing(needs)


COMMUNICATOR = "sglang/srt/layers/communicator.py"
ADD_NORM = "sglang/srt/layers/layer_boundary/residual/add_norm.py"
FACTS = (
    Fact(releases=">=0.5.2,<0.5.4", status=Status.REFUSED,
         shape="`_is_sm100_supported = is_cuda() and "
         "is_sm100_supported()`; sglang.srt.utils has no is_sm120_supported to import",
         file=COMMUNICATOR, function=None, form="import", source="released files",
         note="the import it adds does not exist before 0.5.4: the planner refuses every "
         "patch of the file"),
    Fact(releases=">=0.5.4,<0.5.6", status=Status.APPLIED,
         shape="`_is_sm100_supported = is_cuda() and "
         "is_sm100_supported()`, imported from sglang.srt.utils", file=COMMUNICATOR, function=None,
         form="import", source="released files"),
    Fact(releases=">=0.5.6,<0.5.19", status=Status.APPLIED,
         shape="`_is_sm100_supported = _is_cuda and "
         "is_sm100_supported()`, same import", file=COMMUNICATOR, function=None, form="import",
         source="released files"),
    Fact(releases=">=0.5.19,<0.5.21", status=Status.APPLIED,
         shape="`_is_sm100_supported = _is_cuda and "
         "get_platform().is_sm100`, no import needed", file=COMMUNICATOR, function=None,
         form="platform", source="released files"),
    Fact(releases=">=0.5.21,<0.5.24", status=Status.APPLIED,
         shape="same, in layer_boundary/residual/add_norm.py", file=ADD_NORM, function=None,
         form="platform", source="released files"),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """`_is_sm120_supported = <the SM100 flag's expression, SM120>` right after the SM100 flag,
    and `is_sm120_supported` imported from sglang.srt.utils where the import form needs it."""
    def flag(tree: ast.Module, name: str) -> list[ast.Assign]:
        return [n for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]

    assert not flag(before, "_is_sm120_supported"), "the release already has the flag"
    sm100, sm120 = flag(after, "_is_sm100_supported"), flag(after, "_is_sm120_supported")
    assert len(sm100) == 1 and len(sm120) == 1, f"SM100 flags {sm100}, SM120 flags {sm120}"
    at = after.body.index(sm100[0])
    assert after.body[at + 1:at + 2] == sm120, "the SM120 flag does not follow the SM100 flag"
    value100, value120 = sm100[0].value, sm120[0].value
    assert ast.dump(value120) == ast.dump(value100).replace("sm100", "sm120"), (
        f"`{ast.unparse(value120)}` is not the SM120 form of `{ast.unparse(value100)}`"
    )
    spans = sc.import_changes(before, after)
    gained = set(sc.imported(after)) - set(sc.imported(before))
    if fact.form == "import":
        sc.requires_sm120_import(after)
        module = sc.imported(after)["is_sm120_supported"][0]
        assert module.startswith("sglang.srt.utils"), f"imported from {module}"
    else:
        assert not gained, f"the get_platform() form needs no import; added {sorted(gained)}"
    spans.after.append(sc.span(sm120[0]))
    return spans


PATCH = Patch(
    id="sglang.sm120-flag",
    check=check,
    target="sglang",
    title="Define an SM120 module flag next to the SM100 one",
    why=(
        "The allreduce-fusion gate tests module flags `_is_sm90_supported` and "
        "`_is_sm100_supported`; no release has an SM120 flag. This adds "
        "`_is_sm120_supported` right after the SM100 flag, in the same form (importing "
        "is_sm120_supported from sglang.srt.utils where the flags call the utils checks), "
        "so that sglang.fusion-gate can test it."
    ),
    # The file holding the module flags, which is the file holding the gate (0.5.2 to 0.5.20
    # communicator.py, from 0.5.21 add_norm.py). Same files and marker as sglang.fusion-gate
    # so that both run chained on one parse.
    marker=f"{ANCHOR} = ",
    facts=FACTS,
    transform=transform,
)
