"""vllm.fp4-gemm-b12x: let vLLM's NVFP4 linear auto-selection try the native B12X dense GEMM
before FlashInfer's CUTLASS one on SM120.

`init_nvfp4_linear_kernel` (vllm/model_executor/kernels/linear/__init__.py) walks
`_POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]` and takes the first kernel whose `is_supported` and
`can_implement` say yes. In 0.30 to 0.34 that list puts `FlashInferCutlassNvFp4LinearKernel`
second and `B12xNvFp4LinearKernel` (the optional `b12x` package's SM12x dense GEMM,
`vllm[b12x]`) near the end, after Marlin: https://github.com/vllm-project/vllm/pull/52016
(merged) has it "participate in automatic kernel selection after established optimized backends
and before emulation", so on SM120 it runs only with `--linear-backend b12x`. On compute
capability exactly 12.0 (`current_platform.is_device_capability(120)`: SM121 is left as
released) and with `--linear-backend auto` (an explicit backend, or a per-quantization
override, is untouched), the patch moves `B12xNvFp4LinearKernel` right before
`FlashInferCutlassNvFp4LinearKernel` in the walk's own copy of the list. Its own support check
still decides: without the `b12x` package (or where `b12x` says its GEMM is not supported) it
says no and the walk goes on to FlashInfer's CUTLASS kernel, as released.

FlashInfer's b12x port (`FlashInferB12xNvFp4LinearKernel`) is left where it is, after CUTLASS:
in a vLLM serving run on SM12x that changed only the linear backend it was slower than CUTLASS
(https://github.com/flashinfer-ai/flashinfer/pull/5100), and its support check does not ask the
CUDA version, so on CUDA 12.8 it is chosen and the engine dies at first use
(https://github.com/vllm-project/vllm/pull/55651).
"""

from __future__ import annotations

import ast

import libcst as cst

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
    Wiring,
    already_applied,
    applied,
    upstream,
)

PR_52016 = "https://github.com/vllm-project/vllm/pull/52016"
INIT = "vllm/model_executor/kernels/linear/__init__.py"
FUNCTION = "init_nvfp4_linear_kernel"
REGISTRY = "_POSSIBLE_NVFP4_KERNELS"
B12X = "B12xNvFp4LinearKernel"
CUTLASS = "FlashInferCutlassNvFp4LinearKernel"
# The statement the patch goes after: the walk's own copy of the registry's CUDA list.
ANCHOR = f"possible = list({REGISTRY}.get(platform, []))"
TEST = (
    f"current_platform.is_device_capability(120) and linear_backend == 'auto' "
    f"and {B12X} in possible and {CUTLASS} in possible"
)
BODY = f"possible.remove({B12X})\n    possible.insert(possible.index({CUTLASS}), {B12X})"
COMMENT = (
    "# sm120patch vllm.fp4-gemm-b12x: on SM120 (exactly 12.0) with --linear-backend auto, try",
    "# the native B12X dense GEMM (the b12x package; its own check says no where it is not",
    "# installed) right before FlashInfer's CUTLASS kernel.",
)
SHAPE = (
    f"`{ANCHOR}` in `def {FUNCTION}`; `{REGISTRY}[PlatformEnum.CUDA]` lists {CUTLASS} "
    f"before {B12X}; `linear_backend` and `current_platform` in scope"
)

FACTS = (
    Fact(
        releases=">=0.30.0,<0.35",
        status=Status.APPLIED,
        shape=SHAPE,
        file=INIT,
        function=FUNCTION,
        source="real files",
        note="the list is the same in 0.30 to 0.34 but for B12xNvFp4W4A16LinearKernel (0.32 "
        'on), which the patch does not move; the log line is "Using %s for NVFP4 GEMM"',
    ),
)


def _code(node: cst.CSTNode) -> str:

    return h.code(node, 10_000)


def _same(node: cst.CSTNode, source: str) -> bool:
    """`node` (a statement) is `source`, whatever its layout and comments (compared as Python's
    own syntax trees)."""

    try:
        text = cst.Module(body=[node]).code  # type: ignore[list-item]
        return ast.dump(ast.parse(text)) == ast.dump(ast.parse(source))
    except (SyntaxError, TypeError):
        return False


def _cuda_list(module: cst.Module) -> list[str] | None:
    """The names `_POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]` lists at module level, or None
    where the registry is not a dict literal with that key."""

    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            continue
        node = stmt.body[0]
        value = None
        if isinstance(node, cst.AnnAssign) and isinstance(node.target, cst.Name):
            value = node.value if node.target.value == REGISTRY else None
        elif isinstance(node, cst.Assign) and len(node.targets) == 1:
            target = node.targets[0].target
            value = (
                node.value if isinstance(target, cst.Name) and target.value == REGISTRY else None
            )
        if not isinstance(value, cst.Dict):
            continue
        for element in value.elements:
            if (
                isinstance(element, cst.DictElement)
                and _code(element.key) == "PlatformEnum.CUDA"
                and isinstance(element.value, cst.List)
            ):
                return [_code(e.value) for e in element.value.elements]
    return None


def _module_names(module: cst.Module) -> set[str]:
    """The names the module's top-level `from ... import` statements bind."""

    names: set[str] = set()
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for node in stmt.body:
            if isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
                for alias in node.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    if isinstance(bound, cst.Name):
                        names.add(bound.value)
    return names


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, FUNCTION)
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    anchors = [i for i, stmt in enumerate(body) if _same(stmt, ANCHOR)]
    if not anchors:
        raise NotApplicable(FUNCTION, f"no `{ANCHOR}` in the body of `def {FUNCTION}`")
    if len(anchors) > 1:
        raise Refuse(FUNCTION, f"one `{ANCHOR}`", f"{len(anchors)}")
    listed = _cuda_list(module)
    if listed is None or CUTLASS not in listed or B12X not in listed:
        raise Refuse(
            FUNCTION,
            f"`{REGISTRY}[PlatformEnum.CUDA] = [...]` listing {CUTLASS} and {B12X}",
            f"{listed}",
        )
    missing = [n for n in ("current_platform", B12X, CUTLASS) if n not in _module_names(module)]
    if missing:
        raise Refuse(
            FUNCTION,
            "the module importing current_platform and both kernels",
            f"no import of {', '.join(missing)}",
        )
    index = anchors[0]
    before = [h.code(s) for s in body[:index]]
    if not any(line.lstrip().startswith("linear_backend =") for line in before):
        raise Refuse(
            FUNCTION,
            "`linear_backend = _get_linear_backend(...)` before the walk",
            "no `linear_backend` assigned there",
        )
    ours = [s for s in h.statements(func) if isinstance(s, cst.If) and B12X in _code(s.test)]
    if ours:
        if (
            len(ours) == 1
            and index + 1 < len(body)
            and body[index + 1] is ours[0]
            and _same(ours[0], f"if {TEST}:\n    {BODY}")
        ):
            return already_applied(FUNCTION, f"{B12X} before {CUTLASS} when {TEST}")
        raise Refuse(
            FUNCTION,
            f"at most one `if {TEST}: {BODY}`, right after `{ANCHOR}`",
            f"{len(ours)}, elsewhere or edited",
        )
    if listed.index(B12X) < listed.index(CUTLASS):
        return upstream(
            FUNCTION, f"{REGISTRY}[PlatformEnum.CUDA] already lists {B12X} before {CUTLASS}"
        )
    nl, ind = module.default_newline, module.default_indent
    comment = [cst.EmptyLine(indent=True, comment=cst.Comment(line)) for line in COMMENT]
    new = h.parse_statement(
        f"if ({nl}{ind}current_platform.is_device_capability(120){nl}"
        f'{ind}and linear_backend == "auto"{nl}'
        f"{ind}and {B12X} in possible{nl}"
        f"{ind}and {CUTLASS} in possible{nl}"
        f"):{nl}"
        f"{ind}possible.remove({B12X}){nl}"
        f"{ind}possible.insert({nl}{ind}{ind}possible.index({CUTLASS}), {B12X}{nl}{ind}){nl}",
        module,
    ).with_changes(leading_lines=comment)
    block = func.body
    assert isinstance(block, cst.IndentedBlock)  # `body` came from it
    rebuilt = block.with_changes(body=[*body[: index + 1], new, *body[index + 1 :]])
    shape = f"{B12X} moved before {CUTLASS} when {TEST}"
    return applied(FUNCTION, h.replace(module, block, rebuilt, scope=func), shape)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In `def init_nvfp4_linear_kernel`, right after `possible =
    list(_POSSIBLE_NVFP4_KERNELS.get(platform, []))`, one `if
    current_platform.is_device_capability(120) and linear_backend == 'auto' and
    B12xNvFp4LinearKernel in possible and FlashInferCutlassNvFp4LinearKernel in possible:` that
    removes B12xNvFp4LinearKernel and inserts it at FlashInferCutlassNvFp4LinearKernel's index;
    the module-level registry still lists CUTLASS before B12X (the change is the walk's, at run
    time); with that statement taken out, the file is the release's."""

    func = sc.one_function(after, fact.function)
    body = func.body
    anchor = "possible = list(_POSSIBLE_NVFP4_KERNELS.get(platform, []))"
    [i] = [n for n, s in enumerate(body) if ast.unparse(s) == anchor]
    new = body[i + 1]
    want = ast.parse(
        "if current_platform.is_device_capability(120) and linear_backend == 'auto' and "
        "B12xNvFp4LinearKernel in possible and FlashInferCutlassNvFp4LinearKernel in possible:\n"
        "    possible.remove(B12xNvFp4LinearKernel)\n"
        "    possible.insert(possible.index(FlashInferCutlassNvFp4LinearKernel), "
        "B12xNvFp4LinearKernel)\n"
    ).body[0]
    assert ast.dump(new) == ast.dump(want), f"after the walk's list: {ast.unparse(new)}"
    assigned = [
        s
        for s in body[:i]
        if isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == ["linear_backend"]
    ]
    assert assigned, "no `linear_backend = ...` before the walk"
    [registry] = [
        s
        for s in after.body
        if isinstance(s, ast.AnnAssign | ast.Assign)
        and "_POSSIBLE_NVFP4_KERNELS" in ast.unparse(s).split("=", 1)[0]
    ]
    assert isinstance(registry.value, ast.Dict)
    [cuda] = [
        v
        for k, v in zip(registry.value.keys, registry.value.values, strict=True)
        if k is not None and ast.unparse(k) == "PlatformEnum.CUDA"
    ]
    assert isinstance(cuda, ast.List)
    names = [ast.unparse(e) for e in cuda.elts]
    assert names.index("FlashInferCutlassNvFp4LinearKernel") < names.index(
        "B12xNvFp4LinearKernel"
    ), f"the registry itself was changed: {names}"
    sc.same_but(before, sc.without(after, [new]), "the SM120 reordering")
    return sc.Spans([], [(new.lineno - len(COMMENT), new.end_lineno or new.lineno)])


PATCH = Patch(
    id="vllm.fp4-gemm-b12x",
    check=check,
    target="vllm",
    title="NVFP4 linear auto-selection tries the native B12X GEMM before FlashInfer CUTLASS on "
    "SM120 (vLLM)",
    why=(
        "vLLM's NVFP4 linear auto-selection walks FlashInferCutlassNvFp4LinearKernel second and "
        "the native B12xNvFp4LinearKernel (the b12x package, vllm[b12x]) after Marlin "
        f"('after established optimized backends and before emulation', {PR_52016}), so on "
        "SM120 the b12x dense GEMM runs only with --linear-backend b12x. On compute capability "
        "exactly 12.0 with --linear-backend auto, the patch moves it right before FlashInfer's "
        "CUTLASS kernel in the walk's own list; its support check still decides, so without "
        "the b12x package the walk takes FlashInfer CUTLASS as released. SM121, other GPUs, "
        "an explicit --linear-backend and W4A16 layers are untouched."
    ),
    marker=f"def {FUNCTION}",
    transform=transform,
    facts=FACTS,
    upstream=PR_52016,
    sought=Sought(FUNCTION, (FUNCTION,)),
    wiring=Wiring(
        ran=(r"Using B12xNvFp4LinearKernel for NVFP4 GEMM",),
        # Without b12x the walk takes FlashInfer's CUTLASS kernel, as released.
        skipped=(r"Using FlashInferCutlassNvFp4LinearKernel for NVFP4 GEMM",),
    ),
)
