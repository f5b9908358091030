"""sglang.fp4-gemm-auto: `--fp4-gemm-backend auto` picks flashinfer_b12x on SM120 (site G).

`initialize_fp4_gemm_config` maps `auto` to a backend by GPU: SM100 flashinfer_cutedsl, SM80 to
SM90 marlin, and SM120 falls to flashinfer_cutlass (0.5.13 on; 0.5.10 to 0.5.12 pick
flashinfer_cudnn there). The patch puts one branch first in that chain, in the release's own
arch spelling: on SM120, when the installed FlashInfer's mm_fp4 offers b12x (the backend exists
for this compute capability and CUDA is as new as its b12x requirement asks), `auto` becomes
flashinfer_b12x, with a log line; everywhere else the chain decides as before. The check is a
helper the patch adds after the function, `_flashinfer_offers_b12x()`, that answers no when it
cannot tell. 0.5.8 and 0.5.9 map nothing: SGLang passes `auto` on to FlashInfer's own `auto`,
which already prefers b12x on SM120 (upstream).
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.helpers import ensure_type

from sm120patch.patchkit import arch, imports
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    Import,
    Patch,
    Refuse,
    Result,
    Status,
    already_applied,
    applied,
    upstream,
)
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site, error_row

SITE = "initialize_fp4_gemm_config"
HELPER = "_flashinfer_offers_b12x"
BACKEND = "flashinfer_b12x"
LOG = (
    "SM120 detected and FlashInfer's mm_fp4 offers b12x: ",
    "auto-selecting fp4-gemm-backend=flashinfer_b12x",
)
# The helper, in the module's own newline and indentation (filled in by `_helper`).
HELPER_SOURCE = '''\
def {name}() -> bool:
    """Whether the installed FlashInfer's mm_fp4 can run its "b12x" backend here (added by
    sm120patch fp4-gemm): FlashInfer has the backend for this GPU's compute capability, and
    CUDA is as new as its b12x requirement asks (13.0, or FlashInfer's own minimum where it
    names one). Whatever cannot be told counts as no, and `auto` keeps upstream's choice."""
    try:
        import torch
        from flashinfer import mm_fp4
        from flashinfer.gemm import gemm_base
        from flashinfer.jit.cpp_ext import get_cuda_version
        from packaging.version import Version

        major, minor = torch.cuda.get_device_capability()
        minimum = getattr(gemm_base, "_MIN_B12X_CUDA_VERSION", Version("13.0"))
        return bool(
            mm_fp4.is_backend_supported("b12x", major * 10 + minor)
            and get_cuda_version() >= minimum
        )
    except Exception:
        return False
'''
EXPECTED = (
    '`if backend == "auto":` holding one if/elif chain that picks the backend by GPU arch '
    "(`is_sm100_supported()` / `is_sm120_supported()` or the `get_platform()` form)"
)


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, SITE, f"no `def {SITE}` in this file (it exists from 0.5.8)")
    if not isinstance(func.body, cst.IndentedBlock):
        raise Refuse(SITE, "a function body", f"`{h.code(func)}`")
    autos = [s for s in func.body.body if isinstance(s, cst.If) and _is_auto_test(s.test)]
    if not autos:
        if arch.mentions_sglang_arch(func) or _assigns_backend_string(func):
            raise Refuse(SITE, EXPECTED, 'an arch check outside `if backend == "auto":`')
        return upstream(
            SITE,
            "SGLang passes `auto` on to FlashInfer's mm_fp4, whose own `auto` prefers b12x "
            "on SM120 (FlashInfer 0.6.9 and later)",
            "auto passed through",
        )
    if len(autos) > 1 or autos[0].orelse is not None:
        raise Refuse(SITE, EXPECTED, f'{len(autos)} `if backend == "auto":` statements')
    auto = autos[0]
    inner = auto.body
    chain = inner.body[0] if isinstance(inner, cst.IndentedBlock) and len(inner.body) == 1 else None
    if not isinstance(chain, cst.If):
        raise Refuse(SITE, EXPECTED, f"`{h.code(inner)}`")
    branches = op.if_chain(chain)

    ours = _is_ours(branches[0])
    if ours and _defines_helper(module):
        return already_applied(SITE, f"`if <SM120> and {HELPER}():` first, choosing {BACKEND}")
    if ours or _defines_helper(module):
        raise Refuse(
            SITE,
            f"our SM120 branch first in the chain and `def {HELPER}`",
            "one of them without the other",
        )
    if any(_chooses(b.body, BACKEND) for b in branches) or (
        isinstance(branches[-1].orelse, cst.Else) and _chooses(branches[-1].orelse.body, BACKEND)
    ):
        return upstream(SITE, f"the release's own `auto` already picks {BACKEND}")

    forms = {
        check[1]
        for b in branches
        for operand in h.and_operands(b.test)
        if (check := arch.sglang_arch(operand)) is not None
    }
    if len(forms) != 1 or not forms <= {"call", "platform"}:
        tests = "; ".join(f"`{h.code(b.test)}`" for b in branches)
        raise Refuse(SITE, EXPECTED, f"arch checks in {len(forms)} forms: {tests}")
    form = forms.pop()
    if not h.module_assignments(module, "logger"):
        raise Refuse(SITE, "a module-level `logger = ...` (the new branch logs)", "none")

    sm120 = arch.sglang_arch_check("sm120", form)
    test = cst.BooleanOperation(
        left=sm120,
        operator=cst.And(),
        right=cst.Call(func=cst.Name(HELPER)),
    )
    nl = module.default_newline
    body = ensure_type(
        h.parse_statement(
            f"if x:{nl}"
            f'    backend = "{BACKEND}"{nl}'
            f"    logger.info({nl}"
            f'        "{LOG[0]}"{nl}'
            f'        "{LOG[1]}"{nl}'
            f"    ){nl}",
            module,
        ),
        cst.If,
    ).body
    res = op.add_function_after(module, func, HELPER_SOURCE.format(name=HELPER), site=SITE)
    if res.status is not Status.APPLIED:
        return res
    spelled = h.code(test)
    res = op.then(res, op.add_first_branch(res.module, chain, test, body, site=SITE, shape=""))
    notes = [
        f"`if {spelled}:` choosing {BACKEND} first in the auto chain",
        f"`def {HELPER}` added after {SITE}",
    ]
    if form == "call" and not imports.import_sources(res.module, "is_sm120_supported"):
        # The runner places it next to is_sm100_supported, or refuses where it cannot.
        res = res.needing(Import("is_sm120_supported", next_to="is_sm100_supported"))
        notes.append("is_sm120_supported imported")
    if res.status is not Status.APPLIED:
        return res
    return applied(SITE, res.module, "; ".join(notes)).needing(*res.imports)


def _is_auto_test(test: cst.BaseExpression) -> bool:
    """`backend == "auto"`."""

    return (
        isinstance(test, cst.Comparison)
        and h.key(test.left) == "backend"
        and len(test.comparisons) == 1
        and isinstance(test.comparisons[0].operator, cst.Equal)
        and isinstance(test.comparisons[0].comparator, cst.SimpleString)
        and test.comparisons[0].comparator.evaluated_value == "auto"
    )


def _chooses(body: cst.BaseSuite, backend: str) -> bool:
    """Whether the block assigns `backend = "<backend>"`."""

    return any(
        isinstance(a, cst.Assign)
        and len(a.targets) == 1
        and h.key(a.targets[0].target) == "backend"
        and isinstance(a.value, cst.SimpleString)
        and a.value.evaluated_value == backend
        for a in h.matching_nodes(body, cst.Assign)
    )


def _assigns_backend_string(func: cst.FunctionDef) -> bool:
    """Whether the function assigns `backend` a literal of its own (a mapping we do not know)."""

    return any(
        isinstance(a, cst.Assign)
        and len(a.targets) == 1
        and h.key(a.targets[0].target) == "backend"
        and isinstance(a.value, cst.SimpleString)
        for a in h.matching_nodes(func.body, cst.Assign)
    )


def _is_ours(branch: cst.If) -> bool:
    """`if <SM120 check> and _flashinfer_offers_b12x():` choosing flashinfer_b12x."""
    ops = h.and_operands(branch.test)
    return (
        len(ops) == 2
        and (arch.sglang_arch(ops[0]) or ("", ""))[0] == "sm120"
        and h.key(ops[1]) == f"{HELPER}()"
        and _chooses(branch.body, BACKEND)
    )


def _defines_helper(module: cst.Module) -> bool:
    return any(isinstance(s, cst.FunctionDef) and s.name.value == HELPER for s in module.body)


FP4_UTILS = "sglang/srt/layers/quantization/fp4_utils.py"
FACTS = (
    Fact(
        releases="<0.5.8",
        status=Status.NOT_APPLICABLE,
        shape="no initialize_fp4_gemm_config",
        source="real files",
        note="fp4_utils.py exists from 0.5.8",
    ),
    Fact(
        releases=">=0.5.8,<0.5.10",
        status=Status.UPSTREAM,
        shape="no `auto` mapping: `Fp4GemmRunnerBackend(backend)` passes auto to mm_fp4, whose own "
        "auto prefers b12x on SM120",
        file=FP4_UTILS,
        function=SITE,
        source="real files",
    ),
    Fact(
        releases=">=0.5.10,<0.5.13",
        status=Status.APPLIED,
        shape='`if backend == "auto": if is_sm120_supported(): backend = "flashinfer_cudnn"` '
        "(cutlass NaN on SM120: https://github.com/sgl-project/sglang/issues/20043) ... `else: "
        "flashinfer_cutlass`",
        file=FP4_UTILS,
        function=SITE,
        form="call",
        source="real files",
    ),
    Fact(
        releases=">=0.5.13,<0.5.19",
        status=Status.APPLIED,
        shape="`if is_sm100_supported(): flashinfer_cutedsl` / `elif` SM80-SM90 `marlin` / "
        "`else: flashinfer_cutlass`; is_sm120_supported not imported",
        file=FP4_UTILS,
        function=SITE,
        form="call",
        source="real files",
    ),
    Fact(
        releases=">=0.5.19,<0.5.24",
        status=Status.APPLIED,
        shape="the same chain with `get_platform().is_sm100`, reading the backend from "
        "`get_exec().kernel`",
        file=FP4_UTILS,
        function=SITE,
        form="platform",
        source="real files",
    ),
)


def explain_read(site: Site) -> Reading:
    """What `initialize_fp4_gemm_config` resolves each requested FP4 GEMM backend to: run on
    a copy of the function whose configuration reads return the request (the server
    arguments up to 0.5.18, `get_exec().kernel` from 0.5.19), the module's global left as it
    was. Runs in the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib
    import types
    from types import SimpleNamespace

    name, function = site.modules[0], site.functions[0]
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return {"error": site.error(exc)}
    fn = getattr(module, function, None)
    if fn is None:
        return {"error": f"{name} has no {function}"}
    out: Reading = {}
    for requested in ("auto",):
        config = SimpleNamespace(fp4_gemm_runner_backend=requested)
        scope = dict(module.__dict__)
        if "get_exec" in scope:
            scope["get_exec"] = lambda config=config: SimpleNamespace(kernel=config)
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        try:
            copy(*([config] if fn.__code__.co_argcount else []))
            out[requested] = {"value": getattr(scope["FP4_GEMM_RUNNER_BACKEND"], "value", None)}
        except Exception as exc:
            out[requested] = {"error": site.error(exc)}
    return {"backends": out}


def explain_row(answer: Answer) -> str:
    if (error := error_row(answer, "No module named")) is not None:
        return error
    auto = answer["backends"]["auto"]
    return str(auto["value"]) if "value" in auto else f"raises {auto['error']}"


EXPLAIN = Explain(name="fp4_gemm", field="fp4_gemm_backend", label="FP4 GEMM backend (auto)",
                  read=explain_read, row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In the `auto` if of the fact's function, a new first branch `if <SM120 in the release's
    form> and _flashinfer_offers_b12x():` choosing flashinfer_b12x with a log line, the
    release's chain after it as elif; the helper right after the function, exactly ours;
    is_sm120_supported imported where the call form needs it; with all that taken out, the file
    is the release's. Upstream (0.5.8, 0.5.9): the function maps no `auto` itself and hands the
    backend to Fp4GemmRunnerBackend, which passes it to FlashInfer's own auto."""
    auto_test = "backend == 'auto'"
    if fact.status is Status.UPSTREAM:
        func = sc.one_function(before, fact.function)
        # (0.5.8 has an `if backend == "auto":` of its own, inside the deprecated env var's
        # branch: it takes the env var's backend, it maps no GPU)
        assert not [s for s in func.body if isinstance(s, ast.If)
                    and ast.unparse(s.test) == auto_test], "the release maps auto itself"
        assert any(isinstance(n, ast.Call) and ast.unparse(n.func) == "Fp4GemmRunnerBackend"
                   for n in ast.walk(func)), "no Fp4GemmRunnerBackend(...) in the function"
        sc.same_but(before, after, "nothing")
        return sc.Spans()
    auto = sc.direct_if(sc.one_function(after, fact.function).body, auto_test)
    chain = sc.one(auto.body, "statement in the auto branch")
    assert isinstance(chain, ast.If), ast.unparse(chain)
    test = chain.test
    assert isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And), ast.unparse(test)
    arch, helper = test.values
    assert sc.arch_of(arch) == 120, f"first test `{ast.unparse(test)}`"
    assert isinstance(arch, ast.Call if fact.form == "call" else ast.Attribute), ast.unparse(arch)
    assert ast.unparse(helper) == f"{HELPER}()", ast.unparse(helper)
    chosen = [n.value.value for n in ast.walk(chain.body[0]) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant)]
    assert chosen == ["flashinfer_b12x"], chosen
    assert any(isinstance(n, ast.Call) and ast.unparse(n.func) == "logger.info"
               for n in ast.walk(chain.body[1])), "no log line"
    assert len(chain.orelse) == 1 and isinstance(chain.orelse[0], ast.If), "no elif after ours"
    node = sc.helper_after(after, fact.function, HELPER, HELPER_SOURCE.format(name=HELPER))
    restored = sc.without(after, [node])
    r_auto = sc.direct_if(sc.one_function(restored, fact.function).body, auto_test)
    r_chain = r_auto.body[0]
    assert isinstance(r_chain, ast.If)
    r_auto.body = list(r_chain.orelse)
    spans = sc.import_changes(before, after)
    if fact.form == "call":
        sc.requires_sm120_import(after)
        if "is_sm120_supported" not in sc.imported(before):
            restored = sc.drop_import(restored, "is_sm120_supported")
    sc.same_but(before, restored, "the SM120 branch, the helper and the import")
    spans.before.append(sc.span(auto))
    spans.after += [sc.span(auto), sc.with_blank_lines(node, 2)]
    return spans


PATCH = Patch(
    id="sglang.fp4-gemm-auto",
    check=check,
    target="sglang",
    title="--fp4-gemm-backend auto picks flashinfer_b12x on SM120 when FlashInfer offers it",
    explain=EXPLAIN,
    why=(
        "On SM120 SGLang's `auto` FP4 GEMM backend resolves to flashinfer_cutlass "
        "(flashinfer_cudnn in 0.5.10 to 0.5.12), while FlashInfer's own `auto` prefers its "
        "SM120 kernel, b12x. The patch puts `if <SM120> and _flashinfer_offers_b12x():` first "
        "in the `auto` chain, in the release's arch spelling, choosing flashinfer_b12x with a "
        "log line; the helper it adds asks the installed FlashInfer whether mm_fp4 has b12x "
        "for this compute capability and whether CUDA is as new as b12x requires, and answers "
        "no when it cannot tell, so `auto` then keeps upstream's choice. SM100, SM80-SM90 and "
        "an explicit --fp4-gemm-backend are unchanged, as in "
        "https://github.com/sgl-project/sglang/pull/38170. "
        "Needs sglang.fp4-gemm-enum (the member it selects)."
    ),
    marker=f"def {SITE}",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/pull/38170",
    transform=transform,
)
