"""flashinfer.comm-arch: build FlashInfer's TRT-LLM comm module for SM120 too (site F)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120patch.transform import Patch, Result

if TYPE_CHECKING:
    import libcst as cst

SITE = "gen_trtllm_comm_module"
KEYWORD = "supported_major_versions"


def transform(module: cst.Module) -> Result:
    from sm120patch import operations as op

    return op.extend_keyword_list(module, function=SITE, keyword=KEYWORD, expect=[9, 10], add=12)


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
