"""vllm.moe-b12x: let vLLM's NVFP4 MoE auto-selection try B12X, then FLASHINFER_B12X, before
MARLIN on SM120.

vLLM's `select_nvfp4_moe_backend` leaves both SM12x fused MoEs out of its ordered
`AVAILABLE_BACKENDS`: B12X (the optional `b12x` package's MoE, `vllm[b12x]`, merged in
https://github.com/vllm-project/vllm/pull/52018 as an explicitly selected backend) and
FLASHINFER_B12X (FlashInfer's CuTe-DSL port; "intentionally excluded from auto-selection until
the upstream CUTLASS SM121 MMA op guard is resolved"). So on SM120 an NVFP4 checkpoint that
resolves as W4A16 auto-selects the MARLIN weight-only fallback; b12x runs there only when the
user names it (`--moe-backend b12x` or `flashinfer_b12x`). On compute capability exactly 12.0
(`current_platform.is_device_capability(120)`, so SM121 keeps Marlin) and without expert
parallelism, the patch puts B12X right before MARLIN, as open
https://github.com/vllm-project/vllm/pull/54669 and
https://github.com/vllm-project/vllm/pull/54719 do, then FLASHINFER_B12X right before MARLIN,
as open https://github.com/vllm-project/vllm/pull/47577 does: [..., B12X, FLASHINFER_B12X,
MARLIN, ...]. No source orders the two against each other: B12X goes first because it is the
backend the merged PR's documentation names (`--moe-backend b12x`) and the one that needs a
package of its own, so it falls through where `b12x` is not installed
(`B12xExperts._supports_current_device`: no `b12x.moe.fused_moe`, not supported). Each
backend's own support check still decides, so a deployment neither can run falls through to
MARLIN as before; an explicit `--moe-backend` is not touched (it returns before the list is
walked).
"""

from __future__ import annotations

import ast
from types import FrameType
from typing import Any

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
)
from sm120patch.patchkit.readers import Answer, Explain, Reading, Site, error_row

PR_47577 = "https://github.com/vllm-project/vllm/pull/47577"
PR_54669 = "https://github.com/vllm-project/vllm/pull/54669"
ENUM = "NvFp4MoeBackend"
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
FUNCTION = "select_nvfp4_moe_backend"
LIST = "AVAILABLE_BACKENDS"
FI_B12X = "NvFp4MoeBackend.FLASHINFER_B12X"
B12X = "NvFp4MoeBackend.B12X"
MARLIN = "NvFp4MoeBackend.MARLIN"
HUMMING_CALL = f"{LIST} = prioritize_humming({LIST})"
# The two statements the patch writes (the import is local, as vLLM's own code in this function
# and in `prefers_humming` imports `current_platform`: nvfp4.py imports nothing from
# vllm.platforms at module level in any pinned release).
IMPORT = "from vllm.platforms import current_platform"
TEST = "current_platform.is_device_capability(120) and not config.moe_parallel_config.use_ep"
BODY = (f"{LIST}.insert({LIST}.index({MARLIN}), {B12X})\n"
        f"    {LIST}.insert({LIST}.index({MARLIN}), {FI_B12X})")
# The patch's previous form (FLASHINFER_B12X alone), told apart so that its refusal says so.
OLD_BODY = f"{LIST}.insert({LIST}.index({MARLIN}), {FI_B12X})"
COMMENT = (
    "# sm120patch vllm.moe-b12x: on SM120 (exactly 12.0; SM121 keeps Marlin) without expert",
    "# parallelism, try B12X (the b12x package; falls through where it is not installed),",
    "# then FLASHINFER_B12X, right before MARLIN, as open PRs",
    f"# {PR_54669} (B12X) and",
    f"# {PR_47577} (FLASHINFER_B12X) do.",
)
SHAPE_LIST = f"`{LIST} = [...]` lists {MARLIN} and neither {B12X} nor {FI_B12X}"

FACTS = (
    Fact(releases=">=0.30.0,<0.32.0", status=Status.APPLIED,
         shape=f"{SHAPE_LIST}; the statement after it is the swiglu filter", file=ORACLE,
         function=FUNCTION, form="list", source="real files",
         note="the log line is the inner `_make_log_backend`: "
         "\"Using 'FLASHINFER_B12X' NvFp4 MoE backend out of potential backends: [...]\""),
    Fact(releases=">=0.32.0,<0.34.0", status=Status.APPLIED,
         shape=f"{SHAPE_LIST}, then `{HUMMING_CALL}` (Humming ahead of Marlin on SM90 only): "
         "the SM120 change goes after that", file=ORACLE, function=FUNCTION, form="humming",
         source="real files",
         note="log line as in 0.30-0.31 (inner `_make_log_backend`)"),
    Fact(releases=">=0.34.0,<0.35", status=Status.APPLIED,
         shape=f"{SHAPE_LIST}, then `{HUMMING_CALL}`; selection goes through "
         "NvFp4MoEKernelOracle", file=ORACLE, function=FUNCTION, form="humming",
         source="real files",
         note="the log line is `oracle.make_log_backend` (oracle/base.py): "
         "\"Using FLASHINFER_B12X NvFp4 MoE backend out of potential backends: [...]\""),
)


def _is_list(stmt: cst.CSTNode) -> bool:
    """`AVAILABLE_BACKENDS = [...]`, a list literal."""
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
        and len(stmt.body[0].targets) == 1
        and isinstance(stmt.body[0].targets[0].target, cst.Name)
        and stmt.body[0].targets[0].target.value == LIST
        and isinstance(stmt.body[0].value, cst.List)
    )


def _same(node: cst.CSTNode, source: str) -> bool:
    """`node` (a statement) is `source`, whatever its layout and comments (compared as Python's
    own syntax trees)."""
    try:
        text = cst.Module(body=[node]).code  # type: ignore[list-item]
        return ast.dump(ast.parse(text)) == ast.dump(ast.parse(source))
    except (SyntaxError, TypeError):
        return False


def _is_ours(stmt: cst.CSTNode) -> bool:
    """An `if` naming B12X or FLASHINFER_B12X: the patch's, or an edit of it (upstream's
    function has none in any pinned release), told apart by `_same`."""
    return isinstance(stmt, cst.If) and any(name in _code(stmt) for name in (B12X, FI_B12X))


def _members(module: cst.Module) -> set[str]:
    """The names `class NvFp4MoeBackend` assigns (the members the inserted lines name must be
    there, or the patched selection raises AttributeError on SM120 only)."""

    names: set[str] = set()
    for cls in h.matching_nodes(module, cst.ClassDef, lambda c: c.name.value == ENUM):  # type: ignore[attr-defined]
        for target in h.matching_nodes(cls, cst.AssignTarget, lambda t: True):
            if isinstance(target.target, cst.Name):  # type: ignore[attr-defined]
                names.add(target.target.value)  # type: ignore[attr-defined]
    return names


def _code(node: cst.CSTNode) -> str:
    return h.code(node, 10_000)


def transform(module: cst.Module) -> Result:
    func = op.one_def(module, FUNCTION)
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    lists = h.matching_nodes(func, cst.SimpleStatementLine, _is_list)
    if not lists:
        raise NotApplicable(FUNCTION, f"no `{LIST} = [...]` in `def {FUNCTION}`")
    if len(lists) > 1:
        raise Refuse(FUNCTION, f"one `{LIST} = [...]`", f"{len(lists)} such statements")
    listed = lists[0]
    index = next((i for i, stmt in enumerate(body) if stmt is listed), None)
    if index is None:
        raise Refuse(
            FUNCTION, f"`{LIST} = [...]` in the function's own body", "it nested in a block"
        )
    elements = [h.code(e.value) for e in listed.body[0].value.elements]  # type: ignore[attr-defined]
    if MARLIN not in elements:
        raise Refuse(FUNCTION, f"{MARLIN} in `{LIST}`", f"`{h.code(listed)}`")
    for name in (B12X, FI_B12X):
        if name in elements:  # a hand edit, or upstream's own choice: neither is ours to judge
            raise Refuse(
                FUNCTION, f"`{LIST}` without {name} (vLLM leaves it out)", f"`{h.code(listed)}`"
            )
    members = _members(module)
    missing = [n for n in ("B12X", "FLASHINFER_B12X") if n not in members]
    if missing:
        raise Refuse(
            FUNCTION,
            f"`class {ENUM}` with members B12X and FLASHINFER_B12X",
            f"no {', '.join(missing)}",
        )
    params = [p.name.value for p in func.params.params]
    if "config" not in params:
        raise Refuse(FUNCTION, "a `config` parameter (the FusedMoEConfig)", ", ".join(params))
    if index + 1 < len(body) and _same(body[index + 1], HUMMING_CALL):
        index += 1
    anchor = body[index]
    ours = [s for s in h.statements(func) if _is_ours(s)]
    if ours:
        follows = body[index + 1 : index + 3]
        if (
            len(ours) == 1 and len(follows) == 2 and _same(follows[0], IMPORT)
            and follows[1] is ours[0] and _same(ours[0], f"if {TEST}:\n    {BODY}")
        ):
            return already_applied(FUNCTION, f"B12X, FLASHINFER_B12X before MARLIN when {TEST}")
        if len(ours) == 1 and _same(ours[0], f"if {TEST}:\n    {OLD_BODY}"):
            raise Refuse(
                FUNCTION,
                f"`if {TEST}: {BODY}`",
                "the previous vllm.moe-b12x (FLASHINFER_B12X alone): revert vllm-moe "
                "with the sm120patch that applied it, then apply again",
            )
        raise Refuse(
            FUNCTION,
            f"at most one `if {TEST}: {BODY}`, right after `{h.code(anchor)}`",
            f"{len(ours)}, elsewhere or edited",
        )
    nl, ind = module.default_newline, module.default_indent
    new = [
        h.parse_statement("".join(f"{line}{nl}" for line in COMMENT) + f"{IMPORT}{nl}", module),
        h.parse_statement(
            f"if ({nl}{ind}current_platform.is_device_capability(120){nl}"
            f"{ind}and not config.moe_parallel_config.use_ep{nl}):{nl}"
            f"{ind}{LIST}.insert({nl}{ind}{ind}{LIST}.index({MARLIN}),{nl}"
            f"{ind}{ind}{B12X},{nl}{ind}){nl}"
            f"{ind}{LIST}.insert({nl}{ind}{ind}{LIST}.index({MARLIN}),{nl}"
            f"{ind}{ind}{FI_B12X},{nl}{ind}){nl}",
            module,
        ).with_changes(leading_lines=[cst.EmptyLine(indent=False)]),  # a blank line, no spaces
    ]
    # The kit's `insert_after` takes a statement the statement walk holds (a compound one);
    # the anchor here is a simple assignment, so the function's own block is rebuilt.
    block = func.body
    assert isinstance(block, cst.IndentedBlock)  # `body` came from it
    rebuilt = block.with_changes(body=[*body[: index + 1], *new, *body[index + 1 :]])
    shape = f"B12X, FLASHINFER_B12X inserted before MARLIN when {TEST}"
    return applied(FUNCTION, h.replace(module, block, rebuilt, scope=func), shape)


def explain_read(site: Site) -> Reading:
    """The order NVFP4 MoE auto-selection walks on this GPU (or the simulated one), read from
    the release's own `select_nvfp4_moe_backend`: run with an `auto` MoE backend, no expert
    parallelism and no SwiGLU limit, its local `AVAILABLE_BACKENDS` is read as each line runs
    (a trace on that one frame); whatever the function does past the list (try a kernel that
    cannot load here) is caught: the list is the decision. Runs in the target's interpreter
    (patchkit.readers)."""
    # Imported here: the probe runs this reader from its source text alone (patchkit.readers).
    import importlib
    import importlib.util
    import sys
    from types import SimpleNamespace

    module = importlib.import_module(site.modules[0])
    fn = getattr(module, site.functions[0])
    seen: list[Any] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not fn.__code__:
            return None

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            listed = frame.f_locals.get("AVAILABLE_BACKENDS")
            if listed is not None:
                seen[:] = [listed]
            return local

        return local

    config = SimpleNamespace(
        moe_backend="auto",
        swiglu_limit=None,
        activation_format=SimpleNamespace(is_batched=False),
        moe_parallel_config=SimpleNamespace(use_ep=False),
    )
    stopped = None
    old = sys.gettrace()
    sys.settrace(trace)
    try:
        fn(config, None, None)
    except Exception as exc:  # past the list the function may need what is not here
        stopped = site.error(exc)
    finally:
        sys.settrace(old)
    if not seen:
        return {"error": stopped or "the function returned before it listed the backends"}
    order = [str(getattr(b, "value", b)) for b in list(seen[0])]
    # B12X runs only where the `b12x` package is (vLLM's own test: `find_spec("b12x")`).
    has_b12x = importlib.util.find_spec("b12x") is not None
    return {"order": order, "stopped": stopped, "b12x": has_b12x}


def explain_row(answer: Answer) -> str:
    """`B12X, FLASHINFER_B12X before MARLIN` or `MARLIN, no B12X/FLASHINFER_B12X`: the part of
    the auto-selection order the patch changes; `(no b12x package)` where B12X would fall
    through because the target's Python has no `b12x`."""
    failed = error_row(answer, "No module named")
    if failed is not None:
        return failed
    order = list(answer["order"])
    absent = " (no b12x package)" if answer.get("b12x") is False else ""
    if "MARLIN" not in order:
        return "auto tries: " + ", ".join(order)
    ahead = [
        b
        for b in ("B12X", "FLASHINFER_B12X")
        if b in order and order.index(b) < order.index("MARLIN")
    ]
    if ahead:
        return f"{', '.join(ahead)} before MARLIN{absent}"
    return f"MARLIN, no B12X/FLASHINFER_B12X{absent}"


EXPLAIN = Explain(name="nvfp4_moe_order", label="NVFP4 MoE auto order", read=explain_read,
                  row=explain_row)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """In the fact's function, right after `AVAILABLE_BACKENDS = [...]` (and after
    `AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)` where the release has it), the
    two statements `from vllm.platforms import current_platform` and `if
    current_platform.is_device_capability(120) and not config.moe_parallel_config.use_ep:`
    inserting NvFp4MoeBackend.B12X, then NvFp4MoeBackend.FLASHINFER_B12X, each at the index of
    NvFp4MoeBackend.MARLIN; the list itself still without either; `class NvFp4MoeBackend`
    defines both; with those two statements taken out, the file is the release's."""
    func = sc.one_function(after, fact.function)
    body = func.body

    def is_list(stmt: ast.stmt) -> bool:
        return (
            isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.List)
            and [ast.unparse(t) for t in stmt.targets] == ["AVAILABLE_BACKENDS"]
        )

    i = body.index(sc.one([s for s in body if is_list(s)], "AVAILABLE_BACKENDS list"))
    listed = body[i]
    assert isinstance(listed, ast.Assign) and isinstance(listed.value, ast.List)
    names = [ast.unparse(e) for e in listed.value.elts]
    assert "NvFp4MoeBackend.MARLIN" in names, f"no MARLIN in {names}"
    for name in ("NvFp4MoeBackend.B12X", "NvFp4MoeBackend.FLASHINFER_B12X"):
        assert name not in names, f"the list itself was changed: {name}"
    [enum] = [n for n in after.body if isinstance(n, ast.ClassDef) and n.name == "NvFp4MoeBackend"]
    members = {
        t.id
        for n in enum.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert {"B12X", "FLASHINFER_B12X"} <= members, f"NvFp4MoeBackend members: {members}"
    humming = "AVAILABLE_BACKENDS = prioritize_humming(AVAILABLE_BACKENDS)"
    if fact.form == "humming":
        assert ast.unparse(body[i + 1]) == humming, f"after the list: `{ast.unparse(body[i + 1])}`"
        i += 1
    else:
        assert ast.unparse(body[i + 1]) != humming, "a prioritize_humming the fact does not name"
    new = body[i + 1 : i + 3]
    want = ast.parse(
        "from vllm.platforms import current_platform\n"
        "if current_platform.is_device_capability(120) and "
        "not config.moe_parallel_config.use_ep:\n"
        "    AVAILABLE_BACKENDS.insert(AVAILABLE_BACKENDS.index(NvFp4MoeBackend.MARLIN), "
        "NvFp4MoeBackend.B12X)\n"
        "    AVAILABLE_BACKENDS.insert(AVAILABLE_BACKENDS.index(NvFp4MoeBackend.MARLIN), "
        "NvFp4MoeBackend.FLASHINFER_B12X)\n"
    ).body
    assert [ast.dump(s) for s in new] == [ast.dump(s) for s in want], (
        f"after the list: {[ast.unparse(s) for s in new]}"
    )
    sc.same_but(before, sc.without(after, new), "the SM120 insertion")
    # the comment lines, the import, the blank line and the if
    return sc.Spans([], [(new[0].lineno - len(COMMENT), new[1].end_lineno or new[1].lineno)])


PATCH = Patch(
    id="vllm.moe-b12x",
    check=check,
    target="vllm",
    title="NVFP4 MoE auto-selection tries B12X, then FLASHINFER_B12X, before MARLIN on SM120 "
    "(vLLM)",
    why=(
        "vLLM leaves both SM12x fused MoEs out of the NVFP4 MoE auto-selection list: B12X (the "
        "b12x package, vllm[b12x]) and FLASHINFER_B12X ('FLASHINFER_B12X is intentionally "
        "excluded from auto-selection until the upstream CUTLASS SM121 MMA op guard is "
        "resolved'), so on SM120 an NVFP4 checkpoint that resolves as W4A16 lands on MARLIN "
        "unless --moe-backend b12x (or flashinfer_b12x) is given. As open "
        f"{PR_54669} does for B12X and {PR_47577} for FLASHINFER_B12X, the patch puts B12X, "
        "then FLASHINFER_B12X, right before MARLIN on compute capability exactly 12.0 "
        "(SM121 keeps Marlin) without expert parallelism; each backend's own support check "
        "still decides (B12X falls through where b12x is not installed), so a deployment "
        "neither can run falls through to MARLIN, and an explicit --moe-backend is untouched."
    ),
    marker=f"def {FUNCTION}",
    transform=transform,
    facts=FACTS,
    upstream=PR_47577,
    sought=Sought(FUNCTION, (FUNCTION,)),
    wiring=Wiring(
        ran=(r"Using '?(?:FLASHINFER_)?B12X'? NvFp4 MoE backend",),
        skipped=(r"Using '?MARLIN'? NvFp4 MoE backend",),
    ),
    explain=EXPLAIN,
)
