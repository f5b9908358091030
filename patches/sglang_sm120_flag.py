"""sglang.sm120-flag: define `_is_sm120_supported` next to the SM100 flag (site A).

The fusion gate (site B, patch sglang.fusion-gate) tests module flags of the module it lives
in; no release defines an SM120 one, so this patch adds it in the form the SM100 flag uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Result, Status, already_applied, applied, refused

if TYPE_CHECKING:
    import libcst as cst

SITE = "_is_sm120_supported"
ANCHOR = "_is_sm100_supported"
UTILS = "sglang.srt.utils"
# The CUDA half of the SM100 flag, copied as is into the SM120 flag.
CUDA_FORMS = ("_is_cuda", "is_cuda()")
# The SM100 half (its SM120 twin: cst_helpers.sglang_arch_twin) -> the name that twin needs
# from sglang.srt.utils (None: `get_platform()` is already imported, the SM100 flag calls it).
ARCH_FORMS: dict[str, str | None] = {
    "is_sm100_supported()": "is_sm120_supported",
    "get_platform().is_sm100": None,
}
KNOWN = (
    f"`{ANCHOR} = _is_cuda and is_sm100_supported()` (or `is_cuda() and ...`, "
    "or `_is_cuda and get_platform().is_sm100`)"
)


def _and_keys(stmt: cst.SimpleStatementLine) -> tuple[str | None, str | None] | None:
    """(left, right) of a module flag `name = left and right`, each as `cst_helpers.key`."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    value = stmt.body[0].value  # type: ignore[attr-defined]
    if not (isinstance(value, cst.BooleanOperation) and isinstance(value.operator, cst.And)):
        return None
    return h.key(value.left), h.key(value.right)


def transform(module: cst.Module) -> Result:
    from sm120patch.patchkit import arch
    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    anchors = h.module_assignments(module, ANCHOR)
    if len(anchors) == 1:
        keys = _and_keys(anchors[0])
        if keys is None or keys[0] not in CUDA_FORMS or keys[1] not in ARCH_FORMS:
            return refused(SITE, KNOWN, f"`{h.code(anchors[0])}`")
        cuda, sm100 = keys
        sm120, needs = arch.sglang_arch_twin(sm100), ARCH_FORMS[sm100]  # type: ignore[index]
    else:
        cuda, sm120, needs = "", "", None  # add_module_flag refuses
    form = f"{cuda} and {sm120}"
    shape = f"{SITE} = {form}" + (f", {needs} imported from {UTILS}" if needs else "")
    existing = h.module_assignments(module, SITE)
    flag = op.add_module_flag(
        module,
        name=SITE,
        sibling=ANCHOR,
        value=form,
        same=len(existing) == 1 and _and_keys(existing[0]) == (cuda, sm120),
        expected=f"one module flag {KNOWN}",
    )
    if flag.status is Status.REFUSED:
        return flag
    imported = needs is None or h.binds_at_module_level(module, needs)
    if flag.status is Status.ALREADY_APPLIED:
        if not imported:
            # A half-done edit (by hand?): the flag would raise NameError at import time.
            return refused(
                SITE, f"`{needs}` imported from {UTILS} for `{SITE} = {form}`", "no such import"
            )
        return already_applied(SITE, shape)
    if imported:
        return applied(SITE, flag.module, shape)
    assert needs is not None
    add = op.add_import(
        flag.module,
        needs,
        next_to="is_sm100_supported",
        from_module=UTILS,
        site=SITE,
        expected=f"one `from {UTILS} import (...)` naming is_sm100_supported, to add {needs}",
        found="none, or several",
    )
    return op.then(flag, add, shape=shape)


COMMUNICATOR = "sglang/srt/layers/communicator.py"
ADD_NORM = "sglang/srt/layers/layer_boundary/residual/add_norm.py"
FACTS = (
    Fact(">=0.5.2,<0.5.4", Status.REFUSED, "`_is_sm100_supported = is_cuda() and "
         "is_sm100_supported()`; sglang.srt.utils has no is_sm120_supported to import",
         COMMUNICATOR, None, "import", "released files",
         note="the import it adds does not exist before 0.5.4: the planner refuses every "
         "patch of the file"),
    Fact(">=0.5.4,<0.5.6", Status.APPLIED, "`_is_sm100_supported = is_cuda() and "
         "is_sm100_supported()`, imported from sglang.srt.utils", COMMUNICATOR, None, "import",
         "released files"),
    Fact(">=0.5.6,<0.5.19", Status.APPLIED, "`_is_sm100_supported = _is_cuda and "
         "is_sm100_supported()`, same import", COMMUNICATOR, None, "import", "released files"),
    Fact(">=0.5.19,<0.5.21", Status.APPLIED, "`_is_sm100_supported = _is_cuda and "
         "get_platform().is_sm100`, no import needed", COMMUNICATOR, None, "platform",
         "released files"),
    Fact(">=0.5.21,<0.5.24", Status.APPLIED, "same, in layer_boundary/residual/add_norm.py",
         ADD_NORM, None, "platform", "released files"),
)


PATCH = Patch(
    id="sglang.sm120-flag",
    target="sglang",
    title="Define an SM120 module flag next to the SM100 one",
    why=(
        "The allreduce-fusion gate tests module flags `_is_sm90_supported` and "
        "`_is_sm100_supported`; no release has an SM120 flag. This adds "
        "`_is_sm120_supported` right after the SM100 flag, in the same form (importing "
        "is_sm120_supported from sglang.srt.utils where the flags call the utils checks), "
        "so that sglang.fusion-gate can test it."
    ),
    files=(
        "sglang/srt/layers/layer_boundary/residual/add_norm.py",
        "sglang/srt/layers/communicator.py",
    ),
    # The file holding the module flags, which is the file holding the gate (0.5.2 to 0.5.20
    # communicator.py, from 0.5.21 add_norm.py). Same files and marker as sglang.fusion-gate
    # so that both run chained on one parse.
    marker=f"{ANCHOR} = ",
    facts=FACTS,
    transform=transform,
)
