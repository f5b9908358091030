"""flashinfer.comm-arch: build FlashInfer's TRT-LLM comm module for SM120 too (site F)."""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Result, Status
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site

SITE = "gen_trtllm_comm_module"
KEYWORD = "supported_major_versions"


def transform(module: cst.Module) -> Result:
    return op.extend_keyword_list(module, function=SITE, keyword=KEYWORD, expect=[9, 10], add=12)


TRTLLM_AR = "flashinfer/comm/trtllm_ar.py"
JIT_COMM = "flashinfer/jit/comm.py"
FACTS = (
    Fact(releases=">=0.2.8,<0.3.1", status=Status.REFUSED,
         shape="`gen_trtllm_comm_module()` passes no "
         "supported_major_versions (0.2.8 reads the device capability, 0.3.0 filters "
         "_get_cuda_arch_flags() for SM100): a shape the patch does not know", file=TRTLLM_AR,
         function=SITE),
    Fact(releases=">=0.3.1,<0.4.0", status=Status.APPLIED, shape="`gen_trtllm_comm_module(..., "
         "supported_major_versions=[9, 10])`", file=TRTLLM_AR, function=SITE,
         source="released files"),
    Fact(releases=">=0.4.0,<0.6.16", status=Status.APPLIED, shape="same call, moved to jit/comm.py",
         file=JIT_COMM, function=SITE, source="released files"),
    Fact(releases=">=0.6.16,<0.6.17", status=Status.APPLIED, shape="same call, still [9, 10]",
         file=JIT_COMM, function=SITE, source="real files",
         note="0.6.16 (and its posts) still pass [9, 10]; 0.6.17 on pass [9, 10, 12]"),
    Fact(releases=">=0.6.17", status=Status.UPSTREAM,
         shape="`supported_major_versions=[9, 10, 12]` upstream", file=JIT_COMM, function=SITE,
         source="released files"),
)


def explain_read(site: Site) -> Reading:
    """The nvcc arch flags FlashInfer's `gen_trtllm_comm_module` builds with, or its error.
    Runs in the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib

    problem = "no module to look in"
    for name in site.modules:
        try:
            comm = importlib.import_module(name)
            break
        except ImportError as exc:
            problem = site.error(exc)
    else:
        return {"error": problem}
    function = site.functions[0]
    gen = getattr(comm, function, None)
    if gen is None:
        return {"error": f"{comm.__name__} has no {function}"}
    try:
        spec = gen()
    except Exception as exc:
        return {"module": comm.__name__, "error": site.error(exc)}
    flags = [str(f) for f in (getattr(spec, "extra_cuda_cflags", None) or [])]
    return {
        "module": comm.__name__,
        "archs": [f.split("arch=")[1].split(",")[0] for f in flags if "arch=compute_" in f],
        "flags": flags,
    }


def explain_row(answer: Answer) -> str:
    if "error" in answer:
        return f"raises {answer['error']}"
    return ", ".join(answer["archs"]) or "(none)"


EXPLAIN = Explain(name="comm_arch", label="FlashInfer trtllm comm archs", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """The fact's function's one `supported_major_versions` list gains 12 at its end, nothing
    else in it changes; every other function's lists stay as they were. Upstream (0.6.17 on):
    the release's own list is [9, 10, 12]."""
    if fact.status is Status.UPSTREAM:
        release = [v for v, _, _ in sc.keyword_lists(before, "supported_major_versions").get(
            fact.function or "", [])]
        assert release == [[9, 10, 12]], f"before: {release}"
        sc.same_but(before, after, "nothing")
        return sc.Spans()
    return sc.extended_keyword_list(before, after, fact, "supported_major_versions", 12)


PATCH = Patch(
    id="flashinfer.comm-arch",
    check=check,
    target="flashinfer",
    title="Build FlashInfer's TRT-LLM comm module for SM120",
    explain=EXPLAIN,
    why=(
        "gen_trtllm_comm_module passes supported_major_versions=[9, 10] to get_nvcc_flags_list, "
        "which raises 'RuntimeError: No supported CUDA architectures found for major versions "
        "[9, 10].' when only SM120 is targeted: the allreduce-fusion kernels then crash at the "
        "first forward. Adding 12 builds them for SM120. Only this module's list is widened; "
        "the other comm modules keep theirs. "
        "https://github.com/flashinfer-ai/flashinfer/pull/3903, which made the same change "
        "upstream (first released in 0.6.17), warns that widening the list alone builds the "
        "lamport kernel of trtllm_allreduce.cuh with an empty body on SM12x: small-batch calls "
        "of that plain allreduce return garbage with no error (0.6.0 to 0.6.16 exclude SM12x "
        "there with `__CUDA_ARCH__ < 1200`; 0.6.17 drops that). SGLang's fused path calls "
        "allreduce_fusion, whose kernels (trtllm_allreduce_fusion.cuh) carry no such exclusion "
        "in those releases. The same PR fixes, for every architecture, lamport buffer pointers "
        "that its host wrapper laid out differently from the kernels except at world size 16. "
        "Prefer FlashInfer 0.6.17 or later, where this patch is not needed."
    ),
    marker=f"def {SITE}",
    facts=FACTS,
    transform=transform,
    upstream="https://github.com/flashinfer-ai/flashinfer/pull/3903 (first released in 0.6.17)",
)
