"""sglang.moe-backend: choose flashinfer_cutlass as the MoE runner of GLM-4 MoE on SM120 (site D).

The SM120 branch is built from the release's own SM100 branch on the syntax tree, so it keeps
the release's quantization handling and spelling; only the parts that are about TRT-LLM change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import (
    Patch,
    Result,
    Status,
    already_applied,
    applied,
    not_applicable,
    refused,
)

if TYPE_CHECKING:
    import libcst as cst

ARCH = "Glm4MoeForCausalLM"
SERVER_ARGS_FUNC = "_handle_model_specific_adjustments"
OVERRIDES_FUNC = "_glm4_moe_overrides"
OLD_BACKEND = "flashinfer_trtllm"
NEW_BACKEND = "flashinfer_cutlass"
NEW_LOG = f"Use {NEW_BACKEND} as MoE runner backend on sm120 for {ARCH}"
VERSION_GATE = "check_pkg_version_at_least"
# The SM100 tests the anchor branch may have (their SM120 twins: cst_helpers.sglang_arch_twin).
SM100_TESTS = ("is_sm100_supported()", "get_platform().is_sm100")
# Names whose presence in a test makes it an SM120 branch, whatever its exact form.
SM120_NAMES = {"is_sm120_supported", "_is_sm120_supported", "is_sm120"}
# The only variables the copied part of the SM100 branch may write: it derives the
# quantization from the checkpoint, which the SM120 branch needs just as much.
QUANT_TARGETS = {
    "quantization_config",
    "quant_method",
    "quantization",
    "self.quantization",
    'overrides["quantization"]',
}


def transform(module: cst.Module) -> Result:
    import libcst as cst

    from sm120patch.patchkit import arch
    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    # 1. The site: the Glm4Moe branch of server_args (0.5.8-0.5.14) or the overrides
    # function (0.5.15 on). Exactly one of them.
    overrides = h.functions(module, OVERRIDES_FUNC)
    arch_ifs = [
        node
        for func in h.functions(module, SERVER_ARGS_FUNC)
        for node in h.statements(func)
        if isinstance(node, cst.If) and _is_arch_test(node.test)
    ]
    sites: list[tuple[str, cst.BaseSuite]] = [(OVERRIDES_FUNC, f.body) for f in overrides]
    sites += [(f"{SERVER_ARGS_FUNC}[{ARCH}]", n.body) for n in arch_ifs]
    if not sites:
        return not_applicable(
            f"{SERVER_ARGS_FUNC}[{ARCH}]",
            f'no `def {OVERRIDES_FUNC}` and no `elif model_arch in ["{ARCH}"]:` branch '
            f"in `def {SERVER_ARGS_FUNC}`",
        )
    if len(sites) > 1:
        return refused(
            sites[0][0], f"one {ARCH} MoE site", f"{len(sites)} ({', '.join(s for s, _ in sites)})"
        )
    site, suite = sites[0]
    if not isinstance(suite, cst.IndentedBlock):
        return refused(site, "an indented block", f"`{h.code(suite)}`")

    # 2. The anchor: exactly one SM100 branch among the site's top-level if/elif chains.
    chains = op.branches_in(suite)
    sm100 = [b for b in chains if h.key(b.test) in SM100_TESTS]
    if len(sm100) != 1:
        expected = "one `if is_sm100_supported():` or `if get_platform().is_sm100:` branch"
        mentions = [b for b in chains if "sm100" in h.code(b.test)]
        if len(sm100) > 1:
            return refused(site, expected, f"{len(sm100)} such branches")
        if mentions:
            return refused(site, expected, f"`if {h.code(mentions[0].test)}:`")
        return refused(site, expected, "no SM100 branch")
    anchor = sm100[0]
    sm100_key = h.key(anchor.test)
    assert sm100_key is not None
    sm120_key = arch.sglang_arch_twin(sm100_key)
    assert sm120_key is not None

    # 3. An SM120 branch already there: ours (already applied) or someone else's (refused).
    sm120_ifs = [
        node
        for node in h.statements(suite)
        if isinstance(node, cst.If)
        and h.find(node.test, cst.Name, lambda n: n.value in SM120_NAMES)  # type: ignore[attr-defined]
    ]
    if sm120_ifs:
        ours = anchor.orelse
        if (
            len(sm120_ifs) == 1
            and sm120_ifs[0] is ours
            and h.key(sm120_ifs[0].test) == sm120_key
            and _chooses(sm120_ifs[0], NEW_BACKEND)
        ):
            return already_applied(site, f"`elif {sm120_key}:` choosing {NEW_BACKEND}")
        return refused(
            site,
            f"no SM120 branch, or an `elif {sm120_key}:` right after the SM100 branch "
            f"choosing {NEW_BACKEND}",
            f"`if {h.code(sm120_ifs[0].test)}:` (an SM120 branch in another form)",
        )

    # 4. Build the SM120 body from the SM100 one.
    built = _sm120_body(anchor.body)
    if isinstance(built, str):
        return refused(site, f"the SM100 branch in a known shape ({_KNOWN})", built)
    body, notes = built
    sm120_test = (
        anchor.test.with_changes(func=cst.Name("is_sm120_supported"))  # type: ignore[attr-defined]
        if sm100_key.endswith("()")
        else anchor.test.with_changes(attr=cst.Name("is_sm120"))  # type: ignore[attr-defined]
    )
    branch = op.new_elif(anchor, sm120_test, body)  # an existing elif/else follows it
    problem = _self_check(branch, sm120_key)
    if problem:
        return refused(site, "the built SM120 branch to be the intended one", problem)
    res = op.add_elif(module, anchor, branch, site=site, shape="")

    # 5. The function form needs `is_sm120_supported` imported next to `is_sm100_supported`.
    if sm120_key == "is_sm120_supported()" and not h.import_sources(
        res.module, "is_sm120_supported"
    ):
        found = len(h.import_sources(res.module, "is_sm100_supported"))
        res = op.then(
            res,
            op.add_import(
                res.module,
                "is_sm120_supported",
                next_to="is_sm100_supported",
                site=site,
                expected="one module-level `from ... import (..., is_sm100_supported, ...)` "
                "to add is_sm120_supported to",
                found=f"{found} such imports",
            ),
        )
        if res.status is Status.REFUSED:
            return res
        notes.append("is_sm120_supported imported")
    shape = "; ".join([f"`elif {sm120_key}:` after `if {sm100_key}:`", *notes])
    return applied(site, res.module, shape)


_KNOWN = (
    'quantization derivation, then `if <quantization> == "modelopt_fp4" (or in '
    '{"modelopt_fp4", None}) and ...moe_a2a_backend == "none" and '
    '...moe_runner_backend == "auto":` setting flashinfer_trtllm and logging it, '
    'optionally under `if check_pkg_version_at_least("flashinfer-python", ...):`'
)


def _is_arch_test(test: cst.BaseExpression) -> bool:
    """`model_arch in [..., "Glm4MoeForCausalLM", ...]` or `model_arch == "Glm4MoeForCausalLM"`.

    Only a whole if-test counts: the fusion auto-enable block also lists Glm4Moe, but inside
    an `and` chain, and is not this site.
    """
    import libcst as cst

    if not (
        isinstance(test, cst.Comparison)
        and isinstance(test.left, cst.Name)
        and test.left.value == "model_arch"
        and len(test.comparisons) == 1
    ):
        return False
    op = test.comparisons[0].operator
    value = test.comparisons[0].comparator
    if isinstance(op, cst.Equal):
        return _string(value) == ARCH
    if isinstance(op, cst.In) and isinstance(value, (cst.List, cst.Tuple, cst.Set)):
        return any(_string(el.value) == ARCH for el in value.elements)
    return False


def _string(node: cst.CSTNode) -> str | None:
    import libcst as cst

    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _target_key(node: cst.BaseAssignTargetExpression) -> str | None:
    """`x`, `self.x` or `overrides["x"]`, spelled canonically; None for anything else."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name):
        if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
            name = _string(node.slice[0].slice.value)
            return None if name is None else f'{node.value.value}["{name}"]'
        return None
    return h.key(node)


def _single_assign(stmt: cst.BaseStatement) -> cst.Assign | None:
    import libcst as cst

    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            return small
    return None


def _writes_quantization_only(stmt: cst.BaseStatement) -> bool:
    """An assignment to a quantization variable, or an else-less `if` made only of those."""
    import libcst as cst

    assign = _single_assign(stmt)
    if assign is not None:
        return _target_key(assign.targets[0].target) in QUANT_TARGETS
    if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock):
        return stmt.orelse is None and all(_writes_quantization_only(s) for s in stmt.body.body)
    return False


def _is_backend_target(node: cst.BaseAssignTargetExpression) -> bool:
    key = _target_key(node)
    return key is not None and (
        key.endswith(".moe_runner_backend") or key.endswith('["moe_runner_backend"]')
    )


def _chooses(branch: cst.If, backend: str) -> bool:
    """Whether the branch assigns `backend` to the MoE runner backend somewhere inside."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    return any(
        isinstance(a, cst.Assign)
        and len(a.targets) == 1
        and _is_backend_target(a.targets[0].target)
        and _string(a.value) == backend
        for a in h.find(branch.body, cst.Assign)
    )


def _sm120_body(body: cst.BaseSuite) -> tuple[cst.IndentedBlock, list[str]] | str:
    """The SM100 body turned into the SM120 one, with notes on what changed; else what was found.

    Kept: the quantization derivation (the SM120 branch needs `quantization` just as much).
    Changed in the choice `if`: `quantization in {"modelopt_fp4", None}` becomes
    `== "modelopt_fp4"` (NVFP4 is what flashinfer_cutlass was measured on for SM120; bf16
    keeps upstream's choice), the backend string, the log message, and the FlashInfer version
    gate is dropped (it guards the TRT-LLM-gen kernels, which flashinfer_cutlass does not use).
    """
    import libcst as cst

    from sm120patch.patchkit import syntax as hh

    if not isinstance(body, cst.IndentedBlock):
        return f"`{hh.code(body)}`"
    choice_ifs = [
        (i, s)
        for i, s in enumerate(body.body)
        if isinstance(s, cst.If) and _choice_operands(s.test) is not None
    ]
    if len(choice_ifs) != 1:
        return f'{len(choice_ifs)} `if ... and ...moe_runner_backend == "auto":` statements'
    index, choice = choice_ifs[0]
    assert isinstance(choice, cst.If)
    for stmt in body.body:
        if stmt is not choice and not _writes_quantization_only(stmt):
            return f"an SM100-branch statement this patch does not know: `{hh.code(stmt)}`"
    if choice.orelse is not None:
        return f"an else branch on `if {hh.code(choice.test)}:`"

    notes: list[str] = []
    operands = _choice_operands(choice.test)
    assert operands is not None
    quant = operands[0]
    new_test = choice.test
    if isinstance(quant.comparisons[0].operator, cst.In):
        target = quant.comparisons[0]
        fp4 = next(
            el.value
            for el in target.comparator.elements  # type: ignore[attr-defined]
            if _string(el.value) == "modelopt_fp4"
        )
        narrowed = quant.with_changes(
            comparisons=[
                cst.ComparisonTarget(
                    operator=cst.Equal(
                        whitespace_before=target.operator.whitespace_before,  # type: ignore[attr-defined]
                        whitespace_after=target.operator.whitespace_after,  # type: ignore[attr-defined]
                    ),
                    comparator=fp4,
                )
            ]
        )
        new_test = new_test.deep_replace(quant, narrowed)  # type: ignore[assignment]
        notes.append('quantization narrowed to == "modelopt_fp4"')

    inner = choice.body
    if not isinstance(inner, cst.IndentedBlock):
        return f"`if {hh.code(choice.test)}: {hh.code(inner)}` on one line"
    stmts = list(inner.body)
    if len(stmts) == 1 and isinstance(stmts[0], cst.If) and _is_version_gate(stmts[0]):
        gate = stmts[0]
        if gate.orelse is not None or not isinstance(gate.body, cst.IndentedBlock):
            return f"`if {hh.code(gate.test)}:` with an else branch or on one line"
        # Dropping the gate also drops its comment (about flashinfer_trtllm); the statements
        # move up one level, and libcst's relative indentation re-indents them.
        stmts = list(gate.body.body)
        notes.append("FlashInfer version gate dropped")
    new_stmts = _choose_cutlass(stmts)
    if isinstance(new_stmts, str):
        return new_stmts
    new_choice = choice.with_changes(test=new_test, body=inner.with_changes(body=new_stmts))
    new_body = list(body.body)
    new_body[index] = new_choice
    local = _local_quantization(new_body)
    if isinstance(local, str):
        return local
    new_body, derived = local
    if derived:
        notes.append("quantization derived locally")
    # The first statement may carry blank lines or comments meant for the SM100 branch.
    new_body[0] = new_body[0].with_changes(leading_lines=())
    return body.with_changes(body=new_body), notes


# The server-argument fields the SM100 branch writes the checkpoint's quantization into.
QUANT_FIELDS = {"self.quantization", 'overrides["quantization"]'}


def _local_quantization(
    stmts: list[cst.BaseStatement],
) -> tuple[list[cst.BaseStatement], bool] | str:
    """The SM120 branch reads the checkpoint's quantization as upstream's SM100 check does,
    but keeps it in a local `quantization` and writes no server-argument field with it:
    `self.quantization` becomes the local (seeded from `self.quantization` first) and a write
    to `overrides["quantization"]` is dropped (the local beside it stays). Upstream sets the
    field later from the model config; setting it here changed it for every quantized Glm4Moe
    checkpoint on SM120 (an FP8 one's `quantization` went None -> fp8). Returns the new
    statements and whether anything changed, or what was found when an `if` would be left
    empty. A body that only reads the field is kept as it is."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    class Localize(cst.CSTTransformer):
        def __init__(self) -> None:
            self.problem: str | None = None

        def leave_Attribute(
            self, original: cst.Attribute, updated: cst.Attribute
        ) -> cst.BaseExpression:
            if h.key(original) == "self.quantization":
                return cst.Name("quantization")
            return updated

        def leave_SimpleStatementLine(
            self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
        ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
            assign = _single_assign(original)
            if assign is not None and (
                _target_key(assign.targets[0].target) == 'overrides["quantization"]'
            ):
                return cst.RemoveFromParent()
            return updated

        def leave_IndentedBlock(
            self, original: cst.IndentedBlock, updated: cst.IndentedBlock
        ) -> cst.IndentedBlock:
            if not updated.body:
                self.problem = "an `if` writing only the quantization field"
            return updated

    writes = {
        _target_key(a.targets[0].target)
        for s in stmts
        for a in h.find(s, (cst.Assign,))
        if isinstance(a, cst.Assign) and len(a.targets) == 1
    } & QUANT_FIELDS
    if not writes:
        return stmts, False
    localize = Localize()
    out = [s.visit(localize) for s in stmts]
    if localize.problem:
        return localize.problem
    kept = [s for s in out if isinstance(s, cst.BaseStatement)]
    if "self.quantization" in writes:
        kept.insert(0, cst.parse_statement("quantization = self.quantization\n"))
    return kept, True


def _choice_operands(test: cst.BaseExpression) -> list[cst.Comparison] | None:
    """The three comparisons of the choice `if`, or None when `test` is not of that shape."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    ops = h.and_operands(test)
    if len(ops) != 3 or not all(
        isinstance(op, cst.Comparison) and len(op.comparisons) == 1 and not op.lpar for op in ops
    ):
        return None
    comps: list[cst.Comparison] = ops  # type: ignore[assignment]
    quant, a2a, runner = comps
    q_op, q_val = quant.comparisons[0].operator, quant.comparisons[0].comparator
    quant_ok = (isinstance(q_op, cst.Equal) and _string(q_val) == "modelopt_fp4") or (
        isinstance(q_op, cst.In)
        and isinstance(q_val, cst.Set)
        and sorted(
            "None"
            if isinstance(el.value, cst.Name) and el.value.value == "None"
            else str(_string(el.value))
            for el in q_val.elements
        )
        == ["None", "modelopt_fp4"]
    )
    if not quant_ok or _target_key(quant.left) not in QUANT_TARGETS:  # type: ignore[arg-type]
        return None
    for comp, attr, value in (
        (a2a, "moe_a2a_backend", "none"),
        (runner, "moe_runner_backend", "auto"),
    ):
        key = h.key(comp.left)
        if not (
            key is not None
            and key.endswith(f".{attr}")
            and isinstance(comp.comparisons[0].operator, cst.Equal)
            and _string(comp.comparisons[0].comparator) == value
        ):
            return None
    return comps


def _is_version_gate(node: cst.If) -> bool:
    """`if check_pkg_version_at_least("flashinfer-python", "<version>"):`"""
    import libcst as cst

    test = node.test
    return (
        isinstance(test, cst.Call)
        and isinstance(test.func, cst.Name)
        and test.func.value == VERSION_GATE
        and len(test.args) == 2
        and _string(test.args[0].value) == "flashinfer-python"
        and _string(test.args[1].value) is not None
    )


def _choose_cutlass(stmts: list[cst.BaseStatement]) -> list[cst.BaseStatement] | str:
    """`<backend> = "flashinfer_trtllm"` then `logger.info("...")`, retargeted to cutlass."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    found = "`" + "; ".join(h.code(s) for s in stmts) + "`"
    if len(stmts) != 2:
        return found
    assign = _single_assign(stmts[0])
    if assign is None or not _is_backend_target(assign.targets[0].target):
        return found
    if _string(assign.value) != OLD_BACKEND:
        return found
    log = stmts[1]
    if not (
        isinstance(log, cst.SimpleStatementLine)
        and len(log.body) == 1
        and isinstance(log.body[0], cst.Expr)
        and isinstance(call := log.body[0].value, cst.Call)
        and isinstance(call.func, cst.Attribute)
        and call.func.attr.value == "info"
        and len(call.args) == 1
        and isinstance(message := call.args[0].value, cst.SimpleString)
        and OLD_BACKEND in str(message.evaluated_value)
    ):
        return found
    old_value = assign.value
    assert isinstance(old_value, cst.SimpleString)
    new_value = old_value.with_changes(value=f"{old_value.quote}{NEW_BACKEND}{old_value.quote}")
    new_message = message.with_changes(value=f"{message.quote}{NEW_LOG}{message.quote}")
    return [
        stmts[0].deep_replace(old_value, new_value),  # type: ignore[list-item]
        log.deep_replace(message, new_message),  # type: ignore[list-item]
    ]


def _self_check(branch: cst.If, sm120_key: str) -> str | None:
    """Say what is wrong with the built branch, if anything (a guard against our own bugs)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as hh

    if hh.key(branch.test) != sm120_key:
        return f"test `{hh.code(branch.test)}`"
    # Strings and comments alike: a copied comment about TRT-LLM or SM100 would mislead.
    text = cst.Module(body=[]).code_for_node(branch.with_changes(orelse=None)).lower()
    stale = [word for word in ("trtllm", "trt-llm", "sm100") if word in text]
    if stale:
        return f"{' and '.join(stale)} left in the branch (a string or a comment)"
    strings = [_string(s) for s in hh.find(branch.body, cst.SimpleString)]
    if (
        strings.count(NEW_BACKEND) != 1
        or strings.count(NEW_LOG) != 1
        or not _chooses(branch, NEW_BACKEND)
    ):
        return f"not exactly one {NEW_BACKEND} choice with its log line"
    calls = [hh.key(c.func) for c in hh.find(branch.body, cst.Call)]  # type: ignore[attr-defined]
    if VERSION_GATE in calls:
        return "a FlashInfer version gate left in the branch"
    if isinstance(branch.body, cst.IndentedBlock) and not branch.body.body:
        return "an empty branch"
    return None


SERVER_ARGS = "sglang/srt/server_args.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
GLM4_MOE = "sglang/srt/arg_groups/model_overrides/glm4_moe.py"
FACTS = (
    Fact("<0.5.8", Status.NOT_APPLICABLE, "no Glm4MoeForCausalLM MoE branch",
         source="released files", note="no Glm4MoeForCausalLM branch before 0.5.8"),
    Fact(">=0.5.8,<0.5.10", Status.APPLIED, '`elif model_arch in ["Glm4MoeForCausalLM"]:` '
         '`if is_sm100_supported():` ... flashinfer_trtllm under '
         '`if check_pkg_version_at_least("flashinfer-python", ...):`', SERVER_ARGS,
         "ServerArgs._handle_model_specific_adjustments", "utils", "released files"),
    Fact(">=0.5.10,<0.5.15", Status.APPLIED, "same, without the version gate", SERVER_ARGS,
         "ServerArgs._handle_model_specific_adjustments", "utils", "released files"),
    Fact(">=0.5.15,<0.5.19", Status.APPLIED, '`if is_sm100_supported():` ... '
         'overrides["moe_runner_backend"] = "flashinfer_trtllm"', OVERRIDES, OVERRIDES_FUNC,
         "utils", "released files",
         note="server_args.py keeps an empty `elif model_arch in [\"Glm4MoeForCausalLM\"]: "
         "pass` pointing at overrides.py (real files): the site is in overrides.py"),
    Fact(">=0.5.19,<0.5.24", Status.APPLIED, "`if get_platform().is_sm100:`", GLM4_MOE,
         OVERRIDES_FUNC, "platform", "released files"),
)


PATCH = Patch(
    id="sglang.moe-backend",
    target="sglang",
    title="Choose flashinfer_cutlass as the MoE runner for GLM-4 MoE NVFP4 on SM120",
    why=(
        "For Glm4MoeForCausalLM SGLang picks a MoE runner backend only on SM100 "
        "(flashinfer_trtllm, whose TRT-LLM-gen kernels do not run on SM120); on SM120 the "
        "backend stays 'auto'. The patch adds an SM120 branch right after the SM100 one, in "
        "the release's own form (`elif is_sm120_supported():` or `elif "
        "get_platform().is_sm120:`), built from the SM100 branch on the syntax tree: the "
        "quantization read from the checkpoint's config as the SM100 branch reads it, but into "
        "a local variable (the branch writes nothing but the MoE runner backend; upstream "
        "leaves the quantization to the model config), then flashinfer_cutlass, the backend "
        "that ran best on SM120 for NVFP4 MoE, for modelopt_fp4 with moe_a2a_backend 'none' "
        "and moe_runner_backend 'auto', with its own log line. Where the SM100 condition also "
        "takes unquantized models (0.5.15 on), the SM120 branch keeps to modelopt_fp4: bf16 "
        "on SM120 was not measured and keeps upstream's choice. The FlashInfer version gate "
        "of 0.5.8 and 0.5.9 is not copied: its comment says it guards flashinfer_trtllm, "
        "flashinfer_cutlass does not use TRT-LLM-gen kernels (SGLang selects it elsewhere "
        "without a gate), and 0.5.8 ships FlashInfer 0.6.1, below its own 0.6.2 gate, where "
        "a copied gate would make the branch dead."
    ),
    files=(
        "sglang/srt/arg_groups/model_overrides/glm4_moe.py",
        "sglang/srt/arg_groups/overrides.py",
        "sglang/srt/server_args.py",
    ),
    marker=ARCH,
    facts=FACTS,
    notes=(
        (
            ">=0.5.13",
            "upstream already picks flashinfer_cutlass on SM120 when --quantization "
            "modelopt_fp4 is given; this patch adds the choice when the quantization comes "
            "from the checkpoint's config",
        ),
    ),
    transform=transform,
)
