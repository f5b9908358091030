"""sglang.fusion-backend: let the fusion backend resolution accept SM120 (site X)."""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import arch
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Refuse, Result, Sought, Status
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site, error_row

SITE = "_resolve_backend"
EXPECTED = (
    "`if not (is_sm90_supported() or is_sm100_supported()): raise ...` (or the "
    "`get_platform().is_sm90 or get_platform().is_sm100` form) at the top of the function"
)


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, SITE, f"no `def {SITE}` in this file (it exists from 0.5.14 on)")
    # The arch check guards the whole function, so it sits in its body, not nested: the
    # checks nested under one backend (`if backend == "cutedsl": if not <sm100>: raise`,
    # 0.5.23) are that backend's own business.
    checks = [
        stmt
        for stmt in func.body.body
        if isinstance(stmt, cst.If) and arch.mentions_sglang_arch(stmt.test)
    ]
    if len(checks) != 1:
        found = "; ".join(f"`if {h.code(c.test)}`" for c in checks) or "no GPU-arch check"
        raise Refuse(SITE, EXPECTED, found if len(checks) < 2 else f"several: {found}")
    check = checks[0]
    test = check.test
    found = f"`if {h.code(test)}`"
    if (
        not isinstance(test, cst.UnaryOperation)
        or not isinstance(test.operator, cst.Not)
        or h.or_operands(test.expression) is None
        or not _raises(check)
    ):
        raise Refuse(SITE, EXPECTED, found)
    # The error message ("requires SM90 or SM10X NVIDIA GPUs") stays: it is shown only on
    # GPUs the widened check still rejects, and leaving it keeps the diff to the check. In the
    # call form (0.5.14 to 0.5.18) the widened check requests is_sm120_supported, which those
    # releases do not import here yet: the runner puts it next to is_sm100_supported.
    return op.widen_arch_or(module, test.expression, func, site=SITE, expected=EXPECTED,
                            found=found)


def _raises(check: cst.If) -> list[cst.CSTNode]:
    return h.matching_nodes(check.body, cst.Raise)


COMM_FUSION = "sglang/srt/layers/flashinfer_comm_fusion.py"
FACTS = (
    Fact(releases="<0.5.14", status=Status.NOT_APPLICABLE, shape="no _resolve_backend",
         source="released files", note="_resolve_backend exists from 0.5.14 on"),
    Fact(releases=">=0.5.14,<0.5.19", status=Status.APPLIED,
         shape="`if not (is_sm90_supported() or "
         "is_sm100_supported()): raise ValueError(...)`, is_sm120_supported not imported",
         file=COMM_FUSION, function=SITE, form="utils", source="released files"),
    Fact(releases=">=0.5.19,<0.5.24", status=Status.APPLIED,
         shape="`if not (get_platform().is_sm90 or "
         "get_platform().is_sm100): raise ValueError(...)`", file=COMM_FUSION, function=SITE,
         form="platform", source="released files"),
)


def explain_read(site: Site) -> Reading:
    """What `_resolve_backend` returns or raises for each requested fusion backend. Runs in
    the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib

    name = site.functions[0]
    try:
        module = importlib.import_module(site.modules[0])
        resolve = getattr(module, name, None)
        if resolve is None:  # the words of `from MODULE import name` (before 0.5.14)
            raise ImportError(f"cannot import name {name!r} from {module.__name__!r} "
                              f"({getattr(module, '__file__', None) or 'unknown location'})")
    except ImportError as exc:
        return {"error": site.error(exc)}
    out: Reading = {}
    for backend in ("auto", "trtllm"):
        try:
            out[backend] = {"value": resolve(backend, False)}
        except Exception as exc:
            out[backend] = {"error": site.error(exc)}
    return {"backends": out}


def explain_row(answer: Answer) -> str:
    if (error := error_row(answer, "cannot import name")) is not None:
        return error
    auto = answer["backends"]["auto"]
    return f"returns {auto['value']}" if "value" in auto else f"raises {auto['error']}"


EXPLAIN = Explain(name="resolve_backend", label="_resolve_backend('auto')", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """The backend check's one `(sm90 or sm100)` group, in the fact's function, gains the SM120
    test in the SM100 operand's form; nothing else changes."""
    return sc.widened_or(before, after, fact)


PATCH = Patch(
    id="sglang.fusion-backend",
    check=check,
    target="sglang",
    title="Accept SM120 when resolving the FlashInfer allreduce fusion backend",
    explain=EXPLAIN,
    why=(
        "_resolve_backend raises 'FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA "
        "GPUs.' unless `is_sm90_supported() or is_sm100_supported()` (from 0.5.19 the "
        "get_platform() form), so with fusion enabled the server fails at start-up on SM120. "
        "The patch adds the SM120 check in the same form (and its import where needed); on "
        "SM120 `auto` then resolves to the single-node trtllm backend, and multi-node keeps "
        "being refused as on other non-MNNVL systems."
    ),
    marker=f"def {SITE}",
    sought=Sought(SITE, (SITE,)),  # `one_def` looks it up first
    facts=FACTS,
    transform=transform,
)
