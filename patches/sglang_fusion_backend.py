"""sglang.fusion-backend: let the fusion backend resolution accept SM120 (site X)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120patch.transform import (
    Patch,
    Result,
    already_applied,
    applied,
    not_applicable,
    refused,
    upstream,
)

if TYPE_CHECKING:
    import libcst as cst

SITE = "_resolve_backend"
SM120_CALL = "is_sm120_supported"
EXPECTED = (
    "`if not (is_sm90_supported() or is_sm100_supported()): raise ...` (or the "
    "`get_platform().is_sm90 or get_platform().is_sm100` form) at the top of the function"
)


def transform(module: cst.Module) -> Result:
    import libcst as cst

    from sm120patch import cst_helpers as h

    funcs = h.functions(module, SITE)
    if not funcs:
        return not_applicable(SITE, f"no `def {SITE}` in this file (it exists from 0.5.14 on)")
    if len(funcs) > 1:
        return refused(SITE, f"one `def {SITE}`", f"{len(funcs)} definitions")

    # The arch check guards the whole function, so it sits in its body, not nested: the
    # checks nested under one backend (`if backend == "cutedsl": if not <sm100>: raise`,
    # 0.5.23) are that backend's own business.
    checks = [
        stmt
        for stmt in funcs[0].body.body
        if isinstance(stmt, cst.If) and h.mentions_sglang_arch(stmt.test)
    ]
    if len(checks) != 1:
        found = "; ".join(f"`if {h.code(c.test)}`" for c in checks) or "no GPU-arch check"
        return refused(SITE, EXPECTED, found if len(checks) < 2 else f"several: {found}")
    check = checks[0]
    test = check.test
    group = test.expression if isinstance(test, cst.UnaryOperation) else None
    operands = h.or_operands(group) if group is not None else None
    found_archs = [h.sglang_arch(op) for op in operands] if operands else []
    if (
        not isinstance(test, cst.UnaryOperation)
        or not isinstance(test.operator, cst.Not)
        or not found_archs
        or any(a is None for a in found_archs)
        or not _raises(check)
    ):
        return refused(SITE, EXPECTED, f"`if {h.code(test)}`")
    assert isinstance(group, cst.BooleanOperation)
    archs = [a[0] for a in found_archs if a is not None]
    forms = {a[1] for a in found_archs if a is not None}
    if len(forms) != 1 or "flag" in forms:
        return refused(SITE, EXPECTED, f"`if {h.code(test)}`")
    form = forms.pop()
    shape = h.code(group)
    imported = bool(h.import_sources(module, SM120_CALL))
    if "sm120" in archs:
        if form == "call" and not imported:
            return refused(SITE, f"`{SM120_CALL}` imported where it is used", "no such import")
        return already_applied(SITE, shape)
    if "blackwell" in archs:
        return upstream(
            SITE, f"the release accepts every Blackwell GPU (SM120 included): `{shape}`"
        )
    if sorted(archs) != ["sm100", "sm90"]:  # either order
        return refused(SITE, EXPECTED, f"`if {h.code(test)}`")

    # The error message ("requires SM90 or SM10X NVIDIA GPUs") stays: it is shown only on
    # GPUs the widened check still rejects, and leaving it keeps the diff to the check.
    new_group = h.widen_or(group, h.sglang_arch_check("sm120", form))
    new_module = h.replace(module, group, new_group, scope=funcs[0])
    assert isinstance(new_module, cst.Module)
    if form == "call":
        # 0.5.14 to 0.5.18 import is_sm90/is_sm100_supported from sglang.srt.utils but not
        # is_sm120_supported: it goes next to is_sm100_supported, from the same module.
        with_import = h.import_next_to(new_module, SM120_CALL, "is_sm100_supported")
        if with_import is None:
            return refused(
                SITE,
                f"one `from ... import is_sm100_supported` to add `{SM120_CALL}` to",
                "none or several",
            )
        new_module = with_import
    return applied(SITE, new_module, f"{shape} -> {h.code(new_group)}")


def _raises(check: cst.If) -> list[cst.Raise]:
    import libcst.matchers as m

    return list(m.findall(check.body, m.Raise()))  # type: ignore[arg-type]


PATCH = Patch(
    id="sglang.fusion-backend",
    target="sglang",
    title="Accept SM120 when resolving the FlashInfer allreduce fusion backend",
    why=(
        "_resolve_backend raises 'FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA "
        "GPUs.' unless `is_sm90_supported() or is_sm100_supported()` (from 0.5.19 the "
        "get_platform() form), so with fusion enabled the server fails at start-up on SM120. "
        "The patch adds the SM120 check in the same form (and its import where needed); on "
        "SM120 `auto` then resolves to the single-node trtllm backend, and multi-node keeps "
        "being refused as on other non-MNNVL systems."
    ),
    files=("sglang/srt/layers/flashinfer_comm_fusion.py",),
    marker=f"def {SITE}",
    shapes=(
        "before 0.5.14: no _resolve_backend: not-applicable",
        "0.5.14 to 0.5.18: `if not (is_sm90_supported() or is_sm100_supported()): raise "
        "ValueError(...)`, is_sm120_supported not imported",
        "0.5.19 to 0.5.23: `if not (get_platform().is_sm90 or get_platform().is_sm100): raise "
        "ValueError(...)`",
    ),
    transform=transform,
)
