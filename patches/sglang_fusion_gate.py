"""sglang.fusion-gate: let the allreduce-fusion runtime gate pass on SM120 (site B)."""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Refuse, Result, Status, Wiring, applied
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site

# 0.5.8 to 0.5.21 call the gate function apply_flashinfer_allreduce_fusion, 0.5.22 on
# flashinfer_ar_fusion_applies; before 0.5.8 the gate is an `if` inside this method.
FUNCTIONS = ("flashinfer_ar_fusion_applies", "apply_flashinfer_allreduce_fusion")
CLASS = "CommunicateWithAllReduceAndLayerNormFn"
METHOD = "_gather_hidden_states_and_residual"
ARCH_FLAGS = frozenset({"_is_sm90_supported", "_is_sm100_supported"})
SM120 = "_is_sm120_supported"
EXPECTED = "`(_is_sm90_supported or _is_sm100_supported)` as the first operand of the gate"
# What the server logs once FlashInfer's fusion workspace exists (0.5.14 on, and up to 0.5.13),
# and where fusion is turned off at run time: by the workspace preflight (0.5.11 on), a failed
# workspace creation (0.5.10 on), a group that spans NVLink cliques (0.5.23) or a FlashInfer
# without the comm API (every release). Read off sglang/srt/layers/flashinfer_comm_fusion.py.
FUSION_WIRING = Wiring(
    ran=(
        r"FlashInfer AllReduce Fusion enabled and workspace initialized",
        r"FlashInfer workspace initialized for rank",
    ),
    skipped=(
        r"Skipping allreduce fusion",
        r"Disabling flashinfer allreduce fusion permanently",
        r"FlashInfer allreduce fusion disabled globally",
        r"FlashInfer AllReduce fusion disabled",
        r"FlashInfer comm not available, skipping workspace initialization",
        r"flashinfer\.comm (unified allreduce_fusion API )?is not available",
    ),
)


def _mentions_flags(node: cst.CSTNode) -> bool:
    names = ARCH_FLAGS | {SM120}
    return bool(
        h.matching_nodes(node, cst.Name, lambda n: isinstance(n, cst.Name) and n.value in names)
    )


def transform(module: cst.Module) -> Result:
    site, scope = op.one_of_defs(module, FUNCTIONS, fallback=(CLASS, METHOD), required=True)

    # The gate is the one condition (an `if` test or a returned value) testing the arch flags.
    tests = [test for test in h.conditions(scope) if _mentions_flags(test)]
    if len(tests) != 1:
        flags = " / ".join(sorted(ARCH_FLAGS))
        raise Refuse(site, f"one condition testing {flags}", f"{len(tests)} conditions")
    first = h.and_operands(tests[0])[0]
    if h.or_operands(first) is None:
        raise Refuse(site, EXPECTED, f"`{h.code(first)}`")
    res = op.widen_arch_or(
        module, first, scope, site=site, expected=EXPECTED, forms=("flag",),
        others_ok=False, upstream_ok=False,
    )
    if res.status is not Status.APPLIED:
        return res
    if not h.module_assignments(module, SM120):
        # Widening without the flag would raise NameError when the gate first runs.
        raise Refuse(
            site, f"a module flag `{SM120} = ...` (patch sglang.sm120-flag runs first)", "none"
        )
    return applied(site, res.module, f"{h.code(first)} -> ... or {SM120}")


COMMUNICATOR = "sglang/srt/layers/communicator.py"
ADD_NORM = "sglang/srt/layers/layer_boundary/residual/add_norm.py"
FACTS = (
    Fact(releases=">=0.5.2,<0.5.4", status=Status.REFUSED,
         shape="as 0.5.4; refused with the flag patch of the same "
         "file", file=COMMUNICATOR, function=f"{CLASS}.{METHOD}", source="released files"),
    Fact(releases=">=0.5.4,<0.5.8", status=Status.APPLIED, shape=f"{CLASS}.{METHOD}, "
         "`if ((_is_sm100_supported or _is_sm90_supported) and ...)`", file=COMMUNICATOR,
         function=f"{CLASS}.{METHOD}", source="released files"),
    Fact(releases=">=0.5.8,<0.5.21", status=Status.APPLIED,
         shape="apply_flashinfer_allreduce_fusion(batch_size) "
         "returns `(_is_sm90_supported or _is_sm100_supported) and ...`", file=COMMUNICATOR,
         function="apply_flashinfer_allreduce_fusion", source="released files"),
    Fact(releases="==0.5.21", status=Status.APPLIED,
         shape="same function, in layer_boundary/residual/add_norm.py", file=ADD_NORM,
         function="apply_flashinfer_allreduce_fusion", source="released files"),
    Fact(releases=">=0.5.22,<0.5.24", status=Status.APPLIED,
         shape="renamed flashinfer_ar_fusion_applies", file=ADD_NORM,
         function="flashinfer_ar_fusion_applies", source="released files"),
)


def explain_read(site: Site) -> Reading:
    """The runtime allreduce-fusion gate at batch size 1, every condition of it that is not
    about the GPU architecture held true: the answer is the architecture's. Runs in the
    target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib
    import types
    from types import SimpleNamespace

    found = None
    problems = []
    names = [f for f in site.functions if "." not in f]  # not the method before 0.5.8
    for name in site.modules:
        try:
            candidate = importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name}: {site.error(exc)}")
            continue
        gate = next((getattr(candidate, f) for f in names if hasattr(candidate, f)), None)
        if gate is not None:
            found = (candidate, gate)
            break
    if found is None:
        return {"error": "no gate function found; " + "; ".join(problems)}
    module, fn = found
    comm = SimpleNamespace(flashinfer_allreduce_fusion_backend="auto")
    # What the gate reads of the server arguments, across releases (0.5.10 adds attn_cp_size,
    # 0.5.16 reads them through get_server_args()).
    args = SimpleNamespace(
        enable_flashinfer_allreduce_fusion=True,
        flashinfer_allreduce_fusion_backend="auto",
        attn_cp_size=1,
    )
    held_true = {
        "_is_flashinfer_available": True,
        "is_dp_attention_enabled": lambda: False,
        "get_global_server_args": lambda: args,
        "get_server_args": lambda: args,
        "get_exec": lambda: SimpleNamespace(comm=comm),
        "uses_cutedsl_ar_fusion": lambda: False,
        "is_flashinfer_allreduce_unavailable": lambda: False,
    }
    scope = dict(module.__dict__)
    scope.update({k: v for k, v in held_true.items() if k in scope})
    flags = {k: bool(v) for k, v in module.__dict__.items() if k.startswith("_is_sm")}
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    try:
        passes = bool(copy(1))
    except Exception as exc:
        return {"module": module.__name__, "function": fn.__name__, "error": site.error(exc)}
    return {"module": module.__name__, "function": fn.__name__, "passes": passes, "flags": flags}


def explain_row(answer: Answer) -> str:
    if "error" in answer:
        return f"error: {answer['error']}"
    return ("passes" if answer["passes"] else "closed") + f" ({answer['function']})"


EXPLAIN = Explain(name="gate", label="runtime fusion gate", read=explain_read, row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """The gate's one `(_is_sm90_supported or _is_sm100_supported)` group, in the fact's
    function, gains `_is_sm120_supported`; nothing else changes."""
    return sc.widened_or(before, after, fact)


PATCH = Patch(
    id="sglang.fusion-gate",
    check=check,
    target="sglang",
    title="Let the FlashInfer allreduce-fusion gate pass on SM120",
    explain=EXPLAIN,
    why=(
        "SGLang fuses allreduce with the residual RMSNorm (FlashInfer) only where "
        "`(_is_sm90_supported or _is_sm100_supported)` holds, so on SM120 "
        "--enable-flashinfer-allreduce-fusion silently does nothing. This widens that operand "
        "with `or _is_sm120_supported` (the flag added by sglang.sm120-flag)."
    ),
    # Same files and marker as sglang.sm120-flag: both must pick the same file.
    marker="_is_sm100_supported = ",
    facts=FACTS,
    transform=transform,
    wiring=FUSION_WIRING,
)
