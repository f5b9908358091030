"""flashinfer.comm-arch: build FlashInfer's TRT-LLM comm module for SM120 too (site F)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120patch.transform import Patch, Result, already_applied, applied, not_applicable, refused

if TYPE_CHECKING:
    import libcst as cst

SITE = "gen_trtllm_comm_module"
KEYWORD = "supported_major_versions"


def transform(module: cst.Module) -> Result:
    import libcst as cst

    from sm120patch import cst_helpers as h

    funcs = h.functions(module, SITE)
    if not funcs:
        return not_applicable(SITE, f"no `def {SITE}` in this file")
    if len(funcs) > 1:
        return refused(SITE, f"one `def {SITE}`", f"{len(funcs)} definitions")
    import libcst.matchers as m

    args = list(m.findall(funcs[0], m.Arg(keyword=m.Name(KEYWORD))))
    if len(args) != 1:
        return refused(SITE, f"one `{KEYWORD}=[9, 10]` argument", f"{len(args)} such arguments")
    value = args[0].value
    if not isinstance(value, cst.List) or not all(
        isinstance(el.value, cst.Integer) for el in value.elements
    ):
        return refused(SITE, f"`{KEYWORD}=[9, 10]`", f"`{h.code(args[0])}`")
    majors = [el.value.evaluated_value for el in value.elements]  # type: ignore[attr-defined]
    if 12 in majors:
        return already_applied(SITE, f"{KEYWORD}={majors}")
    if majors != [9, 10]:
        return refused(SITE, f"`{KEYWORD}=[9, 10]`", f"`{h.code(args[0])}`")
    last = value.elements[-1]
    # `[9, 10]` -> `[9, 10, 12]`: the old last element takes the separator the others use.
    sep = value.elements[0].comma if len(value.elements) > 1 else cst.Comma()
    elements = [
        *value.elements[:-1],
        last.with_changes(comma=sep),
        cst.Element(cst.Integer("12"), comma=last.comma),
    ]
    new_module = h.replace(module, value, value.with_changes(elements=elements), scope=funcs[0])
    return applied(SITE, new_module, f"{KEYWORD}=[9, 10] -> [9, 10, 12]")  # type: ignore[arg-type]


PATCH = Patch(
    id="flashinfer.comm-arch",
    target="flashinfer",
    title="Build FlashInfer's TRT-LLM comm module for SM120",
    why=(
        "gen_trtllm_comm_module passes supported_major_versions=[9, 10] to get_nvcc_flags_list, "
        "which raises 'RuntimeError: No supported CUDA architectures found for major versions "
        "[9, 10].' when only SM120 is targeted: the allreduce-fusion kernels then crash at the "
        "first forward. Adding 12 builds them for SM120. Only this module's list is widened; "
        "the other comm modules keep theirs."
    ),
    files=("flashinfer/jit/comm.py", "flashinfer/comm/trtllm_ar.py"),
    marker=f"def {SITE}",
    shapes=(
        "0.3.1: flashinfer/comm/trtllm_ar.py, gen_trtllm_comm_module("
        "..., supported_major_versions=[9, 10])",
        "0.4.0 to 0.6.15: flashinfer/jit/comm.py, same call",
        "0.6.17 and later: [9, 10, 12] upstream",
    ),
    transform=transform,
    upstream_in=">=0.6.17",
)
