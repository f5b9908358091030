"""sglang.moe-runner-auto: `--moe-runner-backend auto` picks flashinfer_cutlass for NVFP4 MoE on
SM120 (site I).

`ModelOptNvFp4FusedMoEMethod.create_moe_runner` (layers/quantization/modelopt_quant.py) resolves
`auto` for every ModelOpt NVFP4 MoE layer: from 0.5.13 Marlin for `(8, 0) <= capability <
(10, 0)`, else FLASHINFER_TRTLLM, whose TRT-LLM-gen kernels are SM100-only. A launch reaches it
whenever the runner stays `auto` on SM120: the quantization comes from the checkpoint and no
model override (the moe profile's other patches) chose a runner. What SM120 then meets depends
on how `apply()` picks its path: up to 0.5.15 it reads the global flags and falls back to
SGLang's own `cutlass_moe_fp4`; 0.5.16 to 0.5.20 raise NotImplementedError at the first forward;
from 0.5.21 it follows the resolved backend into the TRT-LLM-gen path.

The patch makes two edits in the class, as https://github.com/sgl-project/sglang/pull/39807
proposes: an `elif` after the Marlin branch, in the release's own spelling, choosing
FLASHINFER_CUTLASS for compute capability 12.x and marking the method; and the property
`enable_flashinfer_cutlass_moe`, which reads only the global `--moe-runner-backend` (still
`auto`), also answers yes for a method so marked. Without the second edit the weights are never
prepared for CUTLASS (input scales, the up/gate order, the SwiGLU parameters) and `apply()` skips
its CUTLASS branch. The mark is set only by the new branch, so off SM120 and for an explicit
backend every line reads as upstream's. The branch keeps to a layer without expert parallelism
(`moe_ep_size == 1`): the token dispatcher of these releases maps expert ids to local ones from
the global backend (`auto`), and FlashInfer's CUTLASS MoE takes global ids.

0.5.11 and 0.5.12 resolve `auto` to FLASHINFER_TRTLLM with no arch check and keep no resolved
backend: `apply()` never reads that choice, so there is nothing to change (not-applicable).
"""

from __future__ import annotations

import ast
import copy

import libcst as cst
from libcst.helpers import ensure_type

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
    Stop,
    already_applied,
    applied,
)
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site, error_row

CLASS = "ModelOptNvFp4FusedMoEMethod"
METHOD = "create_moe_runner"
SITE = f"{CLASS}.{METHOD}"
PROPERTY = "enable_flashinfer_cutlass_moe"
FLAG = "_sm120_auto_flashinfer_cutlass"
AUTO_TEST = "moe_runner_backend.is_auto()"
WHOLE = 1000  # `h.code` shortens what it spells past its limit: comparisons take it whole
VARIABLE = "moe_runner_backend"
MARLIN_TEST = "is_cuda() and (8, 0) <= get_device_capability() < (10, 0)"
SM120_TEST = (
    "is_cuda() and (12, 0) <= get_device_capability() < (13, 0) "
    'and getattr(layer, "moe_ep_size", None) == 1'
)
MARLIN = "MoeRunnerBackend.MARLIN"
TRTLLM = "MoeRunnerBackend.FLASHINFER_TRTLLM"
CUTLASS = "MoeRunnerBackend.FLASHINFER_CUTLASS"
GLOBAL_READ = "get_moe_runner_backend().is_flashinfer_cutlass()"
OURS_READ = f'{GLOBAL_READ} or getattr(self, "{FLAG}", False)'
COMMENT = "# sm120patch moe: SM120 cannot run TRT-LLM-gen MoE; FlashInfer's CUTLASS MoE runs there."
EXPECTED = (
    f"in {SITE}: `if {AUTO_TEST}:` holding `if {MARLIN_TEST}: {VARIABLE} = {MARLIN}` / "
    f"`else: {VARIABLE} = {TRTLLM}`"
)


def transform(module: cst.Module) -> Result:
    func = _method(module, METHOD)
    # No `auto` choice is looked for before the method's shape is: a method without one is
    # not-applicable whatever its shape, as `sought` promises.
    block = func.body.body if isinstance(func.body, cst.IndentedBlock) else ()
    autos = [s for s in block if isinstance(s, cst.If) and h.key(s.test) == AUTO_TEST]
    if not autos:
        if _mentions(func, "is_auto"):
            raise Refuse(SITE, EXPECTED, "`is_auto()` outside a top-level `if`")
        raise NotApplicable(
            SITE, "no `auto` choice in create_moe_runner: the runner follows "
            "--moe-runner-backend (before 0.5.11)"
        )
    params = [p.name.value for p in func.params.params]
    if params[:2] != ["self", "layer"]:
        raise Refuse(SITE, f"`def {METHOD}(self, layer, ...)`", f"({', '.join(params)})")
    if len(autos) > 1 or autos[0].orelse is not None:
        raise Refuse(SITE, EXPECTED, f"{len(autos)} `if {AUTO_TEST}:` statements")
    inner = autos[0].body.body if isinstance(autos[0].body, cst.IndentedBlock) else ()
    if len(inner) == 1 and _assigns(inner[0], TRTLLM) and not _stores_backend(func):
        raise NotApplicable(
            SITE, "`auto` becomes FLASHINFER_TRTLLM on every GPU, and apply() never reads "
            "that choice: it picks its path from --moe-runner-backend (0.5.11, 0.5.12)"
        )
    if len(inner) != 1 or not isinstance(inner[0], cst.If):
        listed = "; ".join(f"`{h.code(s, 60)}`" for s in inner) or f"`{h.code(autos[0])}`"
        raise Refuse(SITE, EXPECTED, f"{len(inner)} statements: {listed}")
    chain = op.if_chain(inner[0])
    last = chain[-1].orelse
    tests = "; ".join(f"`{h.code(b.test)}`" for b in chain)
    if (
        h.code(chain[0].test, WHOLE) != MARLIN_TEST
        or not _assigns_only(chain[0].body, MARLIN)
        or not isinstance(last, cst.Else)
        or not _assigns_only(last.body, TRTLLM)
        or len(chain) > 2
        or (len(chain) == 2 and not _is_ours(chain[1]))
    ):
        raise Refuse(SITE, EXPECTED, tests)

    prop = _property(module)
    if prop is None:
        raise Refuse(SITE, f"a property `{CLASS}.{PROPERTY}`", "none")
    ret = _last_return(prop)
    reads = None if ret is None or ret.value is None else h.code(ret.value, WHOLE)
    if reads not in (GLOBAL_READ, OURS_READ):
        raise Refuse(SITE, f"`{PROPERTY}` returning `{GLOBAL_READ}`", f"`{reads}`")
    branch_done, property_done = len(chain) == 2, reads == OURS_READ
    if branch_done and property_done:
        return already_applied(
            SITE, f"`elif {SM120_TEST}:` choosing {CUTLASS}; {PROPERTY} reads the choice"
        )
    if branch_done or property_done:
        raise Refuse(SITE, f"our SM120 branch and our `{PROPERTY}`", "one without the other")

    nl = module.default_newline
    template = (
        f"if x:{nl}"
        f"    {COMMENT}{nl}"
        f"    {VARIABLE} = {CUTLASS}{nl}"
        f"    self.{FLAG} = True{nl}"
    )
    body = ensure_type(h.parse_statement(template, module), cst.If).body
    branch = op.new_elif(chain[0], cst.parse_expression(SM120_TEST), body)
    res = op.add_elif(module, chain[0], branch, site=SITE, shape="")
    if res.status is not Status.APPLIED:
        return res
    # The property, found again in the new module (the elif rebuilt the class above it).
    prop = _property(res.module)
    ret = _last_return(prop) if prop is not None else None
    if prop is None or ret is None or not isinstance(prop.body, cst.IndentedBlock):
        raise Refuse(SITE, f"`{PROPERTY}` after the elif", "none")
    new_ret = ret.with_changes(value=cst.parse_expression(OURS_READ))
    lines = [
        s.with_changes(body=[new_ret]) if ret in getattr(s, "body", ()) else s
        for s in prop.body.body
    ]
    new_prop = prop.with_changes(body=prop.body.with_changes(body=lines))
    res = op.then(res, op.replace_statement(res.module, prop, new_prop, site=SITE, shape=""))
    if res.status is not Status.APPLIED:
        return res
    return applied(
        SITE,
        res.module,
        f"`elif {SM120_TEST}:` choosing {CUTLASS} after the Marlin branch; "
        f"`{PROPERTY}` also true where that branch chose",
    )


def _method(module: cst.Module, name: str) -> cst.FunctionDef:
    """The one method `name` of the one class CLASS. Raises `NotApplicable` when the class or
    the method is absent, `Refuse` when there are several."""
    classes = h.classes(module, CLASS)
    if len(classes) != 1:
        if not classes:
            raise NotApplicable(SITE, f"no class {CLASS} in this file")
        raise Refuse(SITE, f"one class {CLASS}", f"{len(classes)}")
    funcs = h.functions(classes[0], name)
    if len(funcs) != 1:
        if not funcs:
            raise NotApplicable(SITE, f"no {CLASS}.{name}")
        raise Refuse(SITE, f"one {CLASS}.{name}", f"{len(funcs)}")
    return funcs[0]


def _property(module: cst.Module) -> cst.FunctionDef | None:
    """The one method PROPERTY of the one class CLASS; None where there is not exactly one
    (the transform refuses in its own words there)."""
    try:
        return _method(module, PROPERTY)
    except Stop:
        return None


def _assigns(stmt: cst.CSTNode, value: str) -> bool:
    """`moe_runner_backend = <value>`."""
    assign = h.single_assign(stmt)
    return (
        assign is not None
        and h.key(assign.targets[0].target) == VARIABLE
        and h.key(assign.value) == value
    )


def _assigns_only(body: cst.BaseSuite, value: str) -> bool:
    """A block of one statement, `moe_runner_backend = <value>` (comments aside)."""
    return (
        isinstance(body, cst.IndentedBlock)
        and len(body.body) == 1
        and _assigns(body.body[0], value)
    )


def _is_ours(branch: cst.If) -> bool:
    """`elif <SM120_TEST>:` choosing FLASHINFER_CUTLASS and setting the mark."""

    body = branch.body.body if isinstance(branch.body, cst.IndentedBlock) else ()
    return (
        h.code(branch.test, WHOLE) == SM120_TEST
        and len(body) == 2
        and _assigns(body[0], CUTLASS)
        and h.code(body[1], WHOLE) == f"self.{FLAG} = True"
    )


def _stores_backend(func: cst.FunctionDef) -> bool:
    """Whether the method keeps its resolved backend (`self._moe_runner_backend = ...`), the
    one apply() reads from 0.5.13 on."""

    return any(
        h.key(t.target) == "self._moe_runner_backend"
        for a in h.nodes(func.body, cst.Assign)
        for t in a.targets
    )


def _mentions(node: cst.CSTNode, attr: str) -> bool:
    return any(a.attr.value == attr for a in h.nodes(node, cst.Attribute))


def _last_return(func: cst.FunctionDef) -> cst.Return | None:
    """The return statement ending the function's body, else None."""
    if not isinstance(func.body, cst.IndentedBlock) or not func.body.body:
        return None
    last = func.body.body[-1]
    if isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1:
        small = last.body[0]
        return small if isinstance(small, cst.Return) else None
    return None


MODELOPT = "sglang/srt/layers/quantization/modelopt_quant.py"
PR_39807 = "https://github.com/sgl-project/sglang/pull/39807"
FACTS = (
    Fact(
        releases="<0.5.11",
        status=Status.NOT_APPLICABLE,
        shape="create_moe_runner has no `auto` choice: the runner follows "
        "--moe-runner-backend",
        source="real files",
        note="0.5.4 to 0.5.10 read from the released modelopt_quant.py",
    ),
    Fact(
        releases=">=0.5.11,<0.5.13",
        status=Status.NOT_APPLICABLE,
        shape="`if moe_runner_backend.is_auto(): moe_runner_backend = "
        "MoeRunnerBackend.FLASHINFER_TRTLLM` on every GPU, the choice not kept; apply() picks "
        "its path from the global flags and, with `auto`, falls back to SGLang's own "
        "cutlass_moe_fp4",
        file=MODELOPT,
        function=SITE,
        source="real files",
        note="before 0.5.13 upstream's modelopt_fp4 rule does not pick flashinfer_cutlass on "
        "SM120 either; nothing here for the patch to follow",
    ),
    Fact(
        releases=">=0.5.13,<0.5.16",
        status=Status.APPLIED,
        shape="`if moe_runner_backend.is_auto():` Marlin for `(8, 0) <= "
        "get_device_capability() < (10, 0)`, else FLASHINFER_TRTLLM, kept as "
        "`self._moe_runner_backend`; apply() reads the global flags and, with `auto`, falls "
        "back to SGLang's own cutlass_moe_fp4",
        file=MODELOPT,
        function=SITE,
        source="real files",
        user_note="on these releases SM120 with `auto` runs SGLang's own cutlass_moe_fp4; the "
        "patch gives it the flashinfer_cutlass runner that --quantization modelopt_fp4 gets",
    ),
    Fact(
        releases=">=0.5.16,<0.5.21",
        status=Status.APPLIED,
        shape="the same choice; apply() has no fallback: with `auto` on SM120 it raises "
        "NotImplementedError (\"Unsupported moe_runner_backend for NVFP4 MoE\")",
        file=MODELOPT,
        function=SITE,
        source="real files",
    ),
    Fact(
        releases=">=0.5.21,<0.5.24",
        status=Status.APPLIED,
        shape="the same choice; apply() follows the kept backend into the FLASHINFER_TRTLLM "
        "(TRT-LLM-gen, SM100-only) path",
        file=MODELOPT,
        function=SITE,
        source="real files",
        note=f"{PR_39807} (open) describes the failure on this shape",
    ),
)


def explain_read(site: Site) -> Reading:
    """What the NVFP4 MoE method's `create_moe_runner` resolves `--moe-runner-backend auto` to
    for a layer without expert parallelism, and whether `enable_flashinfer_cutlass_moe` then
    says the weights are prepared for CUTLASS: a copy of the method reading `auto`, run on a
    stand-in up to the backend it keeps (before 0.5.13, the runner it builds); the property
    reads `auto`. Runs in the target's interpreter (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib
    import types
    from types import SimpleNamespace
    from unittest import mock

    class Chosen(Exception):
        """Stops `create_moe_runner` at the backend it keeps."""

    class MethodStandIn:
        """The `self` of `create_moe_runner`: raises `Chosen` when it keeps
        `_moe_runner_backend`."""

        def __setattr__(self, name: str, value: object) -> None:
            object.__setattr__(self, name, value)
            if name == "_moe_runner_backend":
                raise Chosen(value)

    module = importlib.import_module(site.modules[0])
    class_name, method_name = site.functions[0].split(".")
    cls = getattr(module, class_name)
    fn, auto = getattr(cls, method_name), module.MoeRunnerBackend("auto")

    def runner(backend: object, config: object) -> None:
        raise Chosen(backend)

    scope = dict(fn.__globals__, get_moe_runner_backend=lambda: auto, MoeRunner=runner)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    method = MethodStandIn()
    try:
        copy(method, SimpleNamespace(moe_ep_size=1), SimpleNamespace())
        return {"backend": None}  # no `auto` choice here: the runner follows the flag
    except Chosen as chosen:
        backend = getattr(chosen.args[0], "value", str(chosen.args[0]))
    moe = importlib.import_module("sglang.srt.layers.moe")
    with mock.patch.object(moe, "get_moe_runner_backend", lambda: auto):
        cutlass = bool(cls.enable_flashinfer_cutlass_moe.__get__(method))
    return {"backend": backend, "cutlass_weights": cutlass}


def explain_row(answer: Answer) -> str:
    if (error := error_row(answer, "No module named")) is not None:
        return error
    if answer["backend"] is None:
        return "no auto choice (the runner follows --moe-runner-backend)"
    prepared = "; weights prepared for CUTLASS" if answer["cutlass_weights"] else ""
    return f"{answer['backend']}{prepared}"


EXPLAIN = Explain(name="moe_runner", field="moe_runner_auto",
                  label="NVFP4 MoE runner (auto, no expert parallelism)", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In the `auto` if of the fact's method, right after the Marlin branch, the patch's SM120
    elif choosing FLASHINFER_CUTLASS and setting the method's mark, the release's TRT-LLM `else`
    after it; the class's `enable_flashinfer_cutlass_moe` returns the global read `or` the
    mark; with both taken out, the file is the release's."""

    def auto_of(tree: ast.Module) -> ast.If:
        return sc.direct_if(sc.one_function(tree, fact.function).body, AUTO_TEST)

    def returned(tree: ast.Module) -> ast.Return:
        last = sc.one_function(tree, f"{CLASS}.{PROPERTY}").body[-1]
        assert isinstance(last, ast.Return), ast.unparse(last)
        return last

    marlin = sc.one(auto_of(after).body, "statement in the auto branch")
    assert isinstance(marlin, ast.If) and ast.unparse(marlin.test) == MARLIN_TEST
    assert [ast.unparse(s) for s in marlin.body] == [f"{VARIABLE} = {MARLIN}"]
    ours = sc.one(marlin.orelse, "statement after the Marlin branch")
    assert isinstance(ours, ast.If), "no elif after the Marlin branch"
    assert ast.unparse(ours.test) == ast.unparse(ast.parse(SM120_TEST, mode="eval").body)
    assert [ast.unparse(s) for s in ours.body] == [
        f"{VARIABLE} = {CUTLASS}", f"self.{FLAG} = True"]
    assert [ast.unparse(s) for s in ours.orelse] == [f"{VARIABLE} = {TRTLLM}"]
    new_ret = returned(after)
    value = new_ret.value
    assert isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or), ast.unparse(new_ret)
    assert [ast.unparse(v) for v in value.values] == [
        GLOBAL_READ, f"getattr(self, '{FLAG}', False)"], ast.unparse(value)
    restored = copy.deepcopy(after)
    r_marlin = auto_of(restored).body[0]
    assert isinstance(r_marlin, ast.If)
    r_marlin.orelse = ours.orelse
    r_ret = returned(restored)
    r_ret.value = value.values[0]
    sc.same_but(before, restored, "the SM120 branch and the property")
    return sc.Spans([sc.span(auto_of(before)), sc.span(returned(before))],
                    [sc.span(auto_of(after)), sc.span(new_ret)])


PATCH = Patch(
    id="sglang.moe-runner-auto",
    check=check,
    target="sglang",
    title="--moe-runner-backend auto picks flashinfer_cutlass for NVFP4 MoE on SM120",
    explain=EXPLAIN,
    why=(
        "SGLang resolves `--moe-runner-backend auto` for every ModelOpt NVFP4 MoE layer in "
        "ModelOptNvFp4FusedMoEMethod.create_moe_runner: Marlin on SM80 to SM90, otherwise "
        "flashinfer_trtllm, whose TRT-LLM-gen kernels are SM100-only. Any NVFP4 MoE checkpoint "
        "the moe profile's per-model patches do not cover reaches it on SM120 whenever the "
        "runner stays `auto`; from 0.5.16 that fails at the first forward "
        f"({PR_39807}, open, describes it). The patch adds an SM120 branch after the Marlin "
        "one choosing flashinfer_cutlass, the runner upstream's own rule picks on SM120 for "
        "--quantization modelopt_fp4 (0.5.13 on) and the one the moe profile's other patches "
        "pick, and makes `enable_flashinfer_cutlass_moe` true where that branch chose, so the "
        "weights are prepared for CUTLASS and apply() takes its CUTLASS path, as the pull "
        "request does. The branch keeps to layers without expert parallelism: with it the token "
        "dispatcher of these releases maps expert ids for the global `auto`, and FlashInfer's "
        "CUTLASS MoE takes global ids. Marlin (SGLang's W4A16 fallback for SM80 to SM90) was "
        "the other candidate, and public SM12x figures favour it, all from vLLM: on 4 RTX PRO "
        "6000 Marlin's 46 to 49 tok/s against 14.6 for native FP4 on a hand-patched "
        "FlashInfer 0.6.5 (https://github.com/flashinfer-ai/flashinfer/issues/2723), 39 after "
        "more patching (https://github.com/NVIDIA/cutlass/issues/3096); native NVFP4 7 to 25% "
        "slower than Marlin on GB10 (SM121, https://github.com/NVIDIA/cutlass/issues/3227). "
        "It was not chosen: no "
        "public run of SGLang's NVFP4 Marlin MoE on SM120 was found (SGLang runs Marlin there "
        "for MXFP4: https://github.com/sgl-project/sglang/pull/28231), that path was reported "
        "to give incoherent output with `auto` on Hopper "
        "(https://github.com/sgl-project/sglang/pull/29931, closed), and flashinfer_cutlass is "
        "what SGLang itself runs on SM120 for --quantization modelopt_fp4. SM80, SM90, SM100 "
        "and an explicit --moe-runner-backend keep upstream's choice."
    ),
    marker=f"class {CLASS}",
    # Without `is_auto` in the file there is no `auto` choice, the site (before 0.5.11: the
    # class and its method are there, the choice is not).
    sought=Sought(SITE, ("is_auto",)),
    facts=FACTS,
    upstream=PR_39807,
    transform=transform,
)
