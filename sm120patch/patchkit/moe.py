"""SGLang's per-model MoE runner choice, and its SM120 twin.

For some MoE models SGLang picks a MoE runner backend by GPU arch, in the model's override
(`_<model>_overrides` in arg_groups/overrides.py or arg_groups/model_overrides/, from 0.5.15)
or in its `elif model_arch in [...]:` branch of `ServerArgs._handle_model_specific_adjustments`
(before): only on SM100, a TRT-LLM-gen backend (`flashinfer_trtllm`, `flashinfer_trtllm_routed`)
whose kernels do not run on SM120. `add_sm120_choice` adds, right after that SM100 branch, an
SM120 one built from it on the syntax tree, in the release's own spelling:

- the SM100 branch either derives the quantization from the checkpoint's config, then makes
  the choice in an `if <quantization> ... and <a2a> == "none" and <runner> == "auto":` (GLM-4
  MoE, the Qwen3 MoE family), or is that `if` itself, its test led by the arch check
  (`if <sm100> and <runner> == "auto" and <model config>.quantization == "modelopt_fp4":`,
  MiniMax-M2);
- the SM120 branch keeps the derivation, but into a local (it writes no quantization field:
  upstream sets it later from the model config), keeps the choice for `modelopt_fp4` alone
  (bf16 and FP8 on SM120 keep upstream's choice), chooses `flashinfer_cutlass`, and logs it in
  upstream's words with the backend and the arch changed; a FlashInfer version gate around the
  TRT-LLM choice is not copied (it guards TRT-LLM-gen kernels), nor are the branches before the
  choice in its `if`/`elif` chain (other quantizations' SM100 choices) and the locals only they
  read. Anything else in the SM100 branch is a shape this does not know: refused.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sm120patch.patchkit.model import Result, already_applied, not_applicable, refused

if TYPE_CHECKING:
    import libcst as cst

SERVER_ARGS_FUNC = "_handle_model_specific_adjustments"
# What the MoE patches tell a user from SGLang 0.5.13 (their facts' `user_note` there).
FLAG_NOTE = (
    "upstream already picks flashinfer_cutlass on SM120 when --quantization modelopt_fp4 is "
    "given; this patch adds the choice when the quantization comes from the checkpoint's config"
)
NEW_BACKEND = "flashinfer_cutlass"
FP4 = "modelopt_fp4"
OLD_BACKEND = re.compile(r"flashinfer_trtllm\w*")
# The arch in upstream's log line -> the SM120 line's.
ARCH_WORDS = {"sm100": "sm120", "SM100": "SM120", "SM10X": "SM120", "sm10x": "sm120"}
VERSION_GATE = "check_pkg_version_at_least"
# What the SM100 branch may write besides the choice: the quantization it derives.
QUANT_TARGETS = {"quantization_config", "quant_method", "quantization", "self.quantization",
                 'overrides["quantization"]'}
QUANT_FIELDS = {"self.quantization", 'overrides["quantization"]'}
KNOWN = (
    'quantization derivation, then `if <quantization> == "modelopt_fp4" (or in '
    '{"modelopt_fp4", None}) and ...moe_a2a_backend == "none" and '
    '...moe_runner_backend == "auto":` setting flashinfer_trtllm and logging it, '
    'optionally under `if check_pkg_version_at_least("flashinfer-python", ...):`; or that '
    '`if` itself, its test led by the SM100 check'
)


def site(module: cst.Module, model: str, overrides: str) -> tuple[str, cst.BaseSuite] | Result:
    """(site name, block): the body of `def <overrides>`, else the `model_arch in [...]` branch
    naming `model` in `ServerArgs._handle_model_specific_adjustments`; exactly one of them."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    branch = f"{SERVER_ARGS_FUNC}[{model}]"
    found = [(overrides, f.body) for f in h.functions(module, overrides)] + [
        (branch, n.body)
        for func in h.functions(module, SERVER_ARGS_FUNC)
        for n in h.statements(func)
        if isinstance(n, cst.If) and _names_model(n.test, model)
    ]
    if not found:
        return not_applicable(branch, f'no `def {overrides}` and no `elif model_arch in '
                              f'["{model}"]:` branch in `def {SERVER_ARGS_FUNC}`')
    if len(found) > 1:
        return refused(found[0][0], f"one {model} MoE site",
                       f"{len(found)} ({', '.join(s for s, _ in found)})")
    return found[0]


def _names_model(test: cst.BaseExpression, model: str) -> bool:
    """`model_arch == "<model>"` or `model_arch in [..., "<model>", ...]`, as a whole if-test
    (the fusion auto-enable lists models too, inside an `and` chain: not this site)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    if not (isinstance(test, cst.Comparison) and h.key(test.left) == "model_arch"
            and len(test.comparisons) == 1):
        return False
    operator, value = test.comparisons[0].operator, test.comparisons[0].comparator
    if isinstance(operator, cst.Equal):
        return h.string(value) == model
    return isinstance(operator, cst.In) and isinstance(value, (cst.List, cst.Tuple, cst.Set)) and (
        any(h.string(el.value) == model for el in value.elements))


def add_sm120_choice(
    module: cst.Module, where: tuple[str, cst.BaseSuite] | Result, *, absent: str | None = None
) -> Result:
    """The SM120 twin of the SM100 MoE runner choice in `where` (from `site`), right after it.

    Already applied where that twin is there; refused for an SM120 branch of another form or
    an SM100 branch of a shape this does not know. With `absent`, a site testing no GPU arch
    at all is not-applicable (upstream picks no backend for that model there) instead of
    refused. The call form requests `is_sm120_supported` (next to `is_sm100_supported`)."""
    import libcst as cst

    from sm120patch.patchkit import arch
    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    if isinstance(where, Result):
        return where
    name, suite = where
    if not isinstance(suite, cst.IndentedBlock):
        return refused(name, "an indented block", f"`{h.code(suite)}`")
    chains = op.branches_in(suite)
    anchors = [(b, check) for b in chains if (check := _sm100_check(b.test)) is not None]
    if len(anchors) != 1:
        expected = "one `if is_sm100_supported():` or `if get_platform().is_sm100:` branch"
        mentions = [b for b in chains if "sm100" in h.code(b.test)]
        if len(anchors) > 1:
            return refused(name, expected, f"{len(anchors)} such branches")
        if mentions:
            return refused(name, expected, f"`if {h.code(mentions[0].test)}:`")
        if absent and not arch.mentions_sglang_arch(suite):
            return not_applicable(name, absent)
        return refused(name, expected, "no SM100 branch")
    anchor, sm100 = anchors[0]
    twin = arch.sglang_arch_twin_node(sm100)
    twin_key = h.key(twin) or ""
    needs = arch.sglang_arch_import("sm120", _form(twin))

    # An SM120 branch already there: ours (already applied) or someone else's (refused).
    theirs = [n for n in h.statements(suite)
              if isinstance(n, cst.If) and arch.mentions_sglang_arch(n.test, "sm120")]
    if theirs:
        ours = anchor.orelse
        if len(theirs) == 1 and theirs[0] is ours and _is_ours(theirs[0], twin_key):
            return already_applied(name, f"`elif {twin_key}:` choosing {NEW_BACKEND}").needing(
                needs)
        return refused(
            name,
            f"no SM120 branch, or an `elif {twin_key}:` right after the SM100 branch "
            f"choosing {NEW_BACKEND}",
            f"`if {h.code(theirs[0].test)}:` (an SM120 branch in another form)",
        )

    built = _build(anchor, sm100, twin)
    if isinstance(built, str):
        return refused(name, f"the SM100 branch in a known shape ({KNOWN})", built)
    test, body, notes = built
    branch = op.new_elif(anchor, test, body)  # an existing elif/else follows it
    problem = _self_check(branch, twin_key)
    if problem:
        return refused(name, "the built SM120 branch to be the intended one", problem)
    shape = "; ".join([f"`elif {twin_key}:` after `if {h.key(sm100)}:`", *notes])
    return op.add_elif(module, anchor, branch, site=name, shape=shape).needing(needs)


def _is_ours(branch: cst.If, twin_key: str) -> bool:
    from sm120patch.patchkit import syntax as h

    lead = _lead(branch.test)
    return lead is not None and h.key(lead) == twin_key and _chooses(branch)


def _build(
    anchor: cst.If, sm100: cst.BaseExpression, twin: cst.BaseExpression
) -> tuple[cst.BaseExpression, cst.BaseSuite, list[str]] | str:
    """(test, body, notes) of the SM120 branch, or what was found where it cannot be built."""
    import libcst as cst

    if sm100 is anchor.test:  # the SM100 branch derives the quantization, then chooses
        built = _sm120_body(anchor.body)
        return built if isinstance(built, str) else (twin, *built)
    retargeted = _retarget(anchor)  # the SM100 branch is the choice itself
    if isinstance(retargeted, str):
        return retargeted
    choice, notes = retargeted
    test = choice.test.deep_replace(sm100, twin)
    assert isinstance(test, cst.BaseExpression)
    return test, choice.body, notes


def _form(check: cst.BaseExpression) -> str:
    from sm120patch.patchkit import arch

    found = arch.sglang_arch(check)
    return found[1] if found else ""


def _lead(test: cst.BaseExpression) -> cst.BaseExpression | None:
    """The arch check a branch tests (call or platform form): its whole test, or the first
    operand of its `and`."""
    from sm120patch.patchkit import syntax as h

    for candidate in (test, h.and_operands(test)[0]):
        if _form(candidate) in ("call", "platform"):
            return candidate
    return None


def _sm100_check(test: cst.BaseExpression) -> cst.BaseExpression | None:
    """The SM100 check of an SM100 branch: the whole test, or the first operand of a choice's
    test (`<sm100> and <runner> == "auto" and ...`)."""
    from sm120patch.patchkit import arch
    from sm120patch.patchkit import syntax as h

    lead = _lead(test)
    found = arch.sglang_arch(lead) if lead is not None else None
    if lead is None or found is None or found[0] != "sm100":
        return None
    if lead is test or _choice(h.and_operands(test)[1:]) is not None:
        return lead
    return None


def _choice(operands: list[cst.BaseExpression]) -> cst.BaseExpression | None:
    """The quantization operand of a MoE choice's test, made of one quantization condition
    admitting modelopt_fp4, `<x>.moe_runner_backend == "auto"` and at most one
    `<x>.moe_a2a_backend == "none"`, in any order; None for any other test."""
    from sm120patch.patchkit import syntax as h

    def equals(op: cst.BaseExpression, attr: str, value: str) -> bool:
        comp = _comparison(op)
        return comp is not None and (h.key(comp.left) or "").endswith(f".{attr}") and (
            _operator(comp) == "==" and h.string(comp.comparisons[0].comparator) == value)

    quant = [op for op in operands if _fp4_comparison(op) is not None]
    runner = [op for op in operands if equals(op, "moe_runner_backend", "auto")]
    a2a = [op for op in operands if equals(op, "moe_a2a_backend", "none")]
    if len(quant) != 1 or len(runner) != 1 or len(a2a) > 1 or len(operands) != 2 + len(a2a):
        return None
    return quant[0]


def _comparison(node: cst.CSTNode) -> cst.Comparison | None:
    """`node` when it is one unparenthesised comparison (`a == b`, not `a < b < c`)."""
    import libcst as cst

    if isinstance(node, cst.Comparison) and len(node.comparisons) == 1 and not node.lpar:
        return node
    return None


def _operator(comp: cst.Comparison) -> str:
    import libcst as cst

    kinds = {cst.Equal: "==", cst.In: "in", cst.Is: "is"}
    return kinds.get(type(comp.comparisons[0].operator), "")


def _fp4_comparison(op: cst.BaseExpression) -> cst.Comparison | None:
    """The comparison admitting modelopt_fp4 of a quantization condition: `q ==
    "modelopt_fp4"`, `q in {"modelopt_fp4", ...}`, or an `or` of such and `q is None`, all on
    one quantization (`quantization`, `<x>.quantization`)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    parts = h.or_operands(op) or [op]
    comps = [c for c in map(_comparison, parts) if c is not None]
    spelled = {h.code(c.left) for c in comps}
    if len(comps) != len(parts) or len(spelled) != 1:
        return None
    if not any(q == "quantization" or q.endswith(".quantization") for q in spelled):
        return None
    for comp in comps:
        value = comp.comparisons[0].comparator
        if _operator(comp) == "==" and h.string(value) == FP4:
            return comp
        if _operator(comp) == "in" and isinstance(value, (cst.Set, cst.Tuple, cst.List)) and any(
                h.string(el.value) == FP4 for el in value.elements):
            return comp
    return None


def _narrowed(test: cst.BaseExpression, notes: list[str]) -> cst.BaseExpression:
    """The choice's test with its quantization condition made `q == "modelopt_fp4"`."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    operands = h.and_operands(test)
    quant = _choice(operands[1:] if _lead(test) is not None else operands)
    comp = _fp4_comparison(quant) if quant is not None else None
    assert quant is not None and comp is not None  # `_choice` found them
    if quant is comp and _operator(comp) == "==":
        return test
    target = comp.comparisons[0]
    fp4 = target.comparator
    if isinstance(fp4, (cst.Set, cst.Tuple, cst.List)):
        fp4 = next(el.value for el in fp4.elements if h.string(el.value) == FP4)
    operator = target.operator
    assert isinstance(operator, (cst.Equal, cst.In))
    equal = cst.Equal(whitespace_before=operator.whitespace_before,
                      whitespace_after=operator.whitespace_after)
    notes.append(f'quantization narrowed to == "{FP4}"')
    narrowed = comp.with_changes(comparisons=[cst.ComparisonTarget(operator=equal, comparator=fp4)])
    new = test.deep_replace(quant, narrowed)
    assert isinstance(new, cst.BaseExpression)
    return new


def _sm120_body(body: cst.BaseSuite) -> tuple[cst.IndentedBlock, list[str]] | str:
    """The SM100 branch's body as the SM120 one (see the module's docstring), with notes on
    what changed; else what was found."""
    import libcst as cst

    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    if not isinstance(body, cst.IndentedBlock):
        return f"`{h.code(body)}`"
    statements = list(body.body)
    choices = [(i, b) for i, s in enumerate(statements) if isinstance(s, cst.If)
               for b in op.if_chain(s) if _choice(h.and_operands(b.test)) is not None]
    if len(choices) != 1:
        return f'{len(choices)} `if ... and ...moe_runner_backend == "auto":` statements'
    index, choice = choices[0]
    # Besides the choice: the quantization derivation (kept), and locals nothing kept reads
    # (the branches before the choice test them; left out with those branches).
    kept = [i for i, s in enumerate(statements) if i == index or _writes_quantization_only(s)]
    read = {n.value for i in kept for n in h.nodes(statements[i] if i != index else choice,
                                                     cst.Name)}
    for i, stmt in enumerate(statements):
        assign = h.single_assign(stmt)
        target = assign.targets[0].target if assign is not None else None
        unused = isinstance(target, cst.Name) and target.value not in read
        if i not in kept and not unused:
            return f"an SM100-branch statement this patch does not know: `{h.code(stmt)}`"
    if choice.orelse is not None:
        return f"an else branch on `if {h.code(choice.test)}:`"
    retargeted = _retarget(choice)
    if isinstance(retargeted, str):
        return retargeted
    new_choice, notes = retargeted
    if choice is not statements[index]:
        notes.insert(0, "the branches before the choice left out")
    local = _local_quantization([new_choice if i == index else statements[i] for i in kept])
    if isinstance(local, str):
        return local
    new_body, derived = local
    notes += ["quantization derived locally"] if derived else []
    # The first statement may carry blank lines or comments meant for the SM100 branch.
    new_body[0] = new_body[0].with_changes(leading_lines=())
    return body.with_changes(body=new_body), notes


def _retarget(choice: cst.If) -> tuple[cst.If, list[str]] | str:
    """The choice `if` narrowed to modelopt_fp4, its version gate dropped, choosing cutlass."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    notes: list[str] = []
    test = _narrowed(choice.test, notes)
    inner = choice.body
    if not isinstance(inner, cst.IndentedBlock):
        return f"`if {h.code(choice.test)}: {h.code(inner)}` on one line"
    stmts = list(inner.body)
    if len(stmts) == 1 and isinstance(stmts[0], cst.If) and _is_version_gate(stmts[0]):
        gate = stmts[0]
        if gate.orelse is not None or not isinstance(gate.body, cst.IndentedBlock):
            return f"`if {h.code(gate.test)}:` with an else branch or on one line"
        # Dropping the gate also drops its comment (about flashinfer_trtllm); the statements
        # move up one level, and libcst's relative indentation re-indents them.
        stmts = list(gate.body.body)
        notes.append("FlashInfer version gate dropped")
    found = "`" + "; ".join(h.code(s) for s in stmts) + "`"
    assign = h.single_assign(stmts[0]) if len(stmts) == 2 else None
    message = _log_message(stmts[1]) if assign is not None else None
    if (assign is None or message is None or not _is_backend(assign.targets[0].target)
            or not isinstance(old := assign.value, cst.SimpleString)
            or not OLD_BACKEND.fullmatch(h.string(old) or "")):
        return found
    new = old.with_changes(value=f"{old.quote}{NEW_BACKEND}{old.quote}")
    body = [stmts[0].deep_replace(old, new), stmts[1].deep_replace(message, _reworded(message))]
    return choice.with_changes(test=test, body=inner.with_changes(body=body)), notes


def _log_message(stmt: cst.BaseStatement) -> cst.BaseExpression | None:
    """The message of a line `<logger>.info(<message>)` naming the old backend, else None."""
    import libcst as cst

    line = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ()
    call = line[0].value if len(line) == 1 and isinstance(line[0], cst.Expr) else None
    message = _info_message(call) if call is not None else None
    if message is None or not any(OLD_BACKEND.search(t.value) for t in _texts(message)):
        return None
    return message


def _info_message(call: cst.BaseExpression) -> cst.BaseExpression | None:
    """The one argument of `<logger>.info(...)`, else None."""
    import libcst as cst

    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == "info" and len(call.args) == 1):
        return None
    return call.args[0].value


def _texts(message: cst.BaseExpression) -> list[cst.SimpleString | cst.FormattedStringText]:
    """The literal parts of a string message (plain, implicitly concatenated, or an f-string)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    if not isinstance(message, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return []
    return [*h.nodes(message, cst.SimpleString), *h.nodes(message, cst.FormattedStringText)]


def _reworded(message: cst.BaseExpression) -> cst.BaseExpression:
    """Upstream's log message with the backend and the arch it names changed."""
    import libcst as cst

    for text in _texts(message):
        words = OLD_BACKEND.sub(NEW_BACKEND, text.value)
        words = re.sub("|".join(ARCH_WORDS), lambda m: ARCH_WORDS[m.group()], words)
        new = message.deep_replace(text, text.with_changes(value=words))
        assert isinstance(new, cst.BaseExpression)
        message = new
    return message


def _is_backend(node: cst.BaseAssignTargetExpression) -> bool:
    from sm120patch.patchkit import syntax as h

    spelled = h.target_key(node) or ""
    return spelled.endswith((".moe_runner_backend", '["moe_runner_backend"]'))


def _chooses(branch: cst.If) -> bool:
    """Whether the branch assigns flashinfer_cutlass to the MoE runner backend somewhere."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    return any(len(a.targets) == 1 and _is_backend(a.targets[0].target)
               and h.string(a.value) == NEW_BACKEND for a in h.nodes(branch.body, cst.Assign))


def _writes_quantization_only(stmt: cst.BaseStatement) -> bool:
    """An assignment to a quantization variable, or an else-less `if` made only of those."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    assign = h.single_assign(stmt)
    if assign is not None:
        return h.target_key(assign.targets[0].target) in QUANT_TARGETS
    if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock):
        return stmt.orelse is None and all(_writes_quantization_only(s) for s in stmt.body.body)
    return False


def _is_version_gate(node: cst.If) -> bool:
    """`if check_pkg_version_at_least("flashinfer-python", "<version>"):`"""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    test = node.test
    return (isinstance(test, cst.Call) and h.key(test.func) == VERSION_GATE
            and len(test.args) == 2 and h.string(test.args[0].value) == "flashinfer-python"
            and h.string(test.args[1].value) is not None)


def _local_quantization(
    stmts: list[cst.BaseStatement],
) -> tuple[list[cst.BaseStatement], bool] | str:
    """The statements reading the checkpoint's quantization into a local `quantization` and
    writing no server-argument field with it: `self.quantization` becomes the local (seeded
    from `self.quantization` first), a write to `overrides["quantization"]` is dropped.
    (Upstream sets the field later from the model config; setting it here changed it for every
    quantized checkpoint on SM120: an FP8 one's `quantization` went None -> fp8.) Returns the
    new statements and whether anything changed, or what was found when an `if` would be left
    empty. A body that only reads the field is kept as it is."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    class Localize(cst.CSTTransformer):
        problem: str | None = None

        def leave_Attribute(
            self, original: cst.Attribute, updated: cst.Attribute
        ) -> cst.BaseExpression:
            return cst.Name("quantization") if h.key(original) == "self.quantization" else updated

        def leave_SimpleStatementLine(
            self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
        ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
            assign = h.single_assign(original)
            field = assign and h.target_key(assign.targets[0].target)
            return cst.RemoveFromParent() if field == 'overrides["quantization"]' else updated

        def leave_IndentedBlock(
            self, original: cst.IndentedBlock, updated: cst.IndentedBlock
        ) -> cst.IndentedBlock:
            if not updated.body:
                self.problem = "an `if` writing only the quantization field"
            return updated

    writes = {h.target_key(a.targets[0].target) for s in stmts for a in h.nodes(s, cst.Assign)
              if len(a.targets) == 1} & QUANT_FIELDS
    if not writes:
        return stmts, False
    localize = Localize()
    kept = [new for s in stmts if isinstance(new := s.visit(localize), cst.BaseStatement)]
    if localize.problem:
        return localize.problem
    if "self.quantization" in writes:
        kept.insert(0, cst.parse_statement("quantization = self.quantization\n"))
    return kept, True


def _self_check(branch: cst.If, twin_key: str) -> str | None:
    """What is wrong with the built branch, if anything (a guard against our own bugs)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    lead = _lead(branch.test)
    if lead is None or h.key(lead) != twin_key:
        return f"test `{h.code(branch.test)}`"
    # Strings and comments alike: a copied comment about TRT-LLM or SM100 would mislead.
    text = cst.Module(body=[]).code_for_node(branch.with_changes(orelse=None)).lower()
    stale = [word for word in ("trtllm", "trt-llm", "sm100", "sm10x") if word in text]
    if stale:
        return f"{' and '.join(stale)} left in the branch (a string or a comment)"
    strings = [h.string(s) for s in h.nodes(branch.body, cst.SimpleString)]
    calls = h.nodes(branch.body, cst.Call)
    messages = [m for c in calls if (m := _info_message(c)) is not None]
    logs = [m for m in messages if any(NEW_BACKEND in t.value for t in _texts(m))]
    if strings.count(NEW_BACKEND) != 1 or len(logs) != 1 or not _chooses(branch):
        return f"not exactly one {NEW_BACKEND} choice with its log line"
    if VERSION_GATE in {h.key(c.func) for c in calls}:
        return "a FlashInfer version gate left in the branch"
    return None
