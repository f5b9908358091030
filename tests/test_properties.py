"""Property tests: formatting variants of every site (comments inside the
condition, extra parentheses, line breaks, trailing commas, operand order, aliased imports,
`from x import (a,\\n b)` shapes, CRLF). Whatever the variant, a patch either applies exactly
its intended change (checked on the `ast` syntax tree: the patched tree equals the original
tree with that change made by hand) or refuses; it never writes invalid Python; a second run
is `already-applied`; and through the engine, apply then revert gives back every byte.

Each site's generator draws the layout of the code around the anchor; the expected change is
made on the original's `ast` independently of libcst, so a patch that lost a comment's line,
reordered operands or touched a neighbour would show as a different tree.
"""

from __future__ import annotations

import ast
import copy
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from patches_under_test import load_patch

from sm120patch.patchkit.model import Patch, Status
from sm120patch.patchkit.runner import transform_text

# A few seconds per property by default; SM120PATCH_EXAMPLES=500 for a thorough run.
EXAMPLES = settings(
    max_examples=int(os.environ.get("SM120PATCH_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
COMMENT = st.sampled_from(["", "  # note", "  # (or) and: a comment with ) in it"])


# ---- formatting primitives ------------------------------------------------------------------


@st.composite
def parens(draw: st.DrawFn, expr: str, most: int = 2) -> str:
    n = draw(st.integers(0, most))
    return "(" * n + expr + ")" * n


@st.composite
def or_group(draw: st.DrawFn, exprs: list[str], indent: str) -> str:
    """`(a or b)` in any layout: operand order, parentheses, line breaks, comments."""
    ops = [draw(parens(e)) for e in draw(st.permutations(exprs))]
    outer = draw(st.integers(1, 2))
    layout = draw(st.sampled_from(["one-line", "leading-or", "trailing-or", "backslash"]))
    if layout == "one-line":
        return "(" * outer + " or ".join(ops) + ")" * outer
    if layout == "backslash":  # a continuation line inside the parentheses, where none is needed
        return "(" * outer + " or \\\n    ".join(ops) + ")" * outer
    inner = indent + "    "
    lines = [f"{inner}# why these arches"] if draw(st.booleans()) else []
    for i, op in enumerate(ops):
        last = i == len(ops) - 1
        if layout == "leading-or":
            lines.append(f"{inner}{'' if i == 0 else 'or '}{op}{draw(COMMENT)}")
        else:
            lines.append(f"{inner}{op}{'' if last else ' or'}{draw(COMMENT)}")
    first = draw(st.sampled_from(["", "  # a comment right after the parenthesis"]))
    return "(" * outer + first + "\n" + "\n".join(lines) + "\n" + indent + ")" * outer


@st.composite
def and_chain(draw: st.DrawFn, first: str, rest: list[str], indent: str) -> str:
    """`first and r1 and r2` as an `if`/`return` test: one line or broken in parentheses."""
    if draw(st.booleans()):
        return " and ".join([first, *rest])
    inner = indent + "    "
    lines = [f"{inner}# a comment line before the arch test"] if draw(st.booleans()) else []
    lines.append(f"{inner}{first}{draw(COMMENT)}")
    lines += [f"{inner}and {r}{draw(COMMENT)}" for r in rest]
    return "(\n" + "\n".join(lines) + f"\n{indent})"


@st.composite
def import_from(draw: st.DrawFn, module: str, names: list[str]) -> str:
    """`from module import ...` in any shape; unrelated extra names, some aliased."""
    extra = draw(st.sampled_from([[], ["is_hip as _is_hip"], ["ceil_align", "is_hip as hip"]]))
    names = names + extra
    if draw(st.booleans()):
        names = draw(st.permutations(names))
    shape = draw(st.sampled_from(["flat", "parens", "hanging", "one-per-line", "split"]))
    trailing = "," if draw(st.booleans()) else ""
    if shape == "flat":
        return f"from {module} import {', '.join(names)}\n"
    if shape == "parens":
        return f"from {module} import ({', '.join(names)}{trailing})\n"
    if shape == "hanging":  # `from x import (a,\n    b)`
        head, *tail = names
        body = "".join(f",\n    {n}" for n in tail)
        return f"from {module} import ({head}{body}{trailing})\n"
    if shape == "one-per-line":
        body = "".join(f"    {n},{draw(COMMENT)}\n" for n in names[:-1])
        last = f"    {names[-1]}{trailing}{draw(COMMENT)}\n"
        return f"from {module} import (\n{body}{last})\n"
    # "split": every name in its own statement
    return "".join(f"from {module} import {n}\n" for n in names)


def line_endings(text: str, crlf: bool) -> str:
    return text.replace("\n", "\r\n") if crlf else text


# ---- the property -----------------------------------------------------------------------------


def check(patch: Patch, source: str, expected: Callable[[ast.Module], ast.Module]) -> str:
    """Run `patch` on `source`: applied exactly as `expected` says, or refused. Returns the
    outcome, after checking idempotence."""
    before = ast.parse(source)
    res = transform_text([patch], "variant.py", source)
    [outcome] = res.outcomes
    event(f"{patch.id}: {outcome.status.value}")
    assert outcome.status in (Status.APPLIED, Status.REFUSED), outcome.describe()
    if outcome.status is Status.REFUSED:
        assert res.after == source
        return outcome.status.value
    after = ast.parse(res.after)  # never invalid Python
    compile(res.after, "variant.py", "exec", dont_inherit=True)
    want = expected(copy.deepcopy(before))
    assert ast.dump(after) == ast.dump(want), f"{source}\n--- became ---\n{res.after}"
    if "\r\n" in source:
        assert res.after.count("\n") == res.after.count("\r\n"), "line endings changed"
    again = transform_text([patch], "variant.py", res.after)
    assert [o.status for o in again.outcomes] == [Status.ALREADY_APPLIED], again.outcomes
    assert again.after == res.after
    return outcome.status.value


def expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def add_import(tree: ast.Module, name: str, after: str) -> None:
    """`name` after `after` in the one module-level `from ... import` holding `after`,
    unless `name` is imported already."""
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    if any(a.name == name and a.asname is None for i in imports for a in i.names):
        return
    [holder] = [i for i in imports if any(a.name == after and not a.asname for a in i.names)]
    index = next(k for k, a in enumerate(holder.names) if a.name == after)
    holder.names.insert(index + 1, ast.alias(name=name))


def widen(node: ast.BoolOp, extra: str) -> None:
    """The or-group gets `extra` as its last operand (ast flattens `(a or b) or c`)."""
    node.values.append(expr(extra))


def find_or(tree: ast.AST, keys: set[str]) -> ast.BoolOp:
    found = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.BoolOp)
        and isinstance(n.op, ast.Or)
        and {ast.unparse(v) for v in n.values} == keys
    ]
    assert len(found) == 1, [ast.unparse(f) for f in found]
    return found[0]


# ---- flashinfer.comm-arch -------------------------------------------------------------------


@st.composite
def comm_arch_source(draw: st.DrawFn) -> str:
    sep = draw(st.sampled_from([", ", ",", ",\n            "]))
    trailing = draw(st.sampled_from(["", ",", f",{draw(COMMENT)}\n        "]))
    first, second = draw(st.sampled_from([("9", "10"), ("10", "9"), ("0x9", "0xA")]))
    majors = draw(parens(f"[{first}{sep}{second}{trailing}]", most=1))
    kw = draw(st.sampled_from(["supported_major_versions=", "supported_major_versions = "]))
    other = draw(st.sampled_from(["", "extra_flags=None, ", "\n        extra_flags=None,\n        "]))
    call_trailing = draw(st.sampled_from(["", ","]))
    call = f"get_nvcc_flags_list(\n        {other}{kw}{majors}{call_trailing}\n    )"
    if draw(st.booleans()):
        call = f"get_nvcc_flags_list({other.strip()} {kw}{majors})".replace("( ", "(")
    source = f'''
def gen_vllm_comm_module():
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10]
    )
    return gen_jit_spec("vllm_comm", [], extra_cuda_cflags=nvcc_flags)


def gen_trtllm_comm_module():{draw(COMMENT)}
    nvcc_flags = current_compilation_context.{call}
    return gen_jit_spec("trtllm_comm", [], extra_cuda_cflags=nvcc_flags)
'''
    return line_endings(source, draw(st.booleans()))


def comm_arch_expected(tree: ast.Module) -> ast.Module:
    [func] = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("gen_t")]
    [kw] = [k for k in ast.walk(func) if isinstance(k, ast.keyword) and k.arg.startswith("supp")]
    assert isinstance(kw.value, ast.List)
    kw.value.elts.append(ast.Constant(12))
    return tree


@EXAMPLES
@given(comm_arch_source())
def test_comm_arch_variants(source):
    check(load_patch("flashinfer.comm-arch"), source, comm_arch_expected)


# ---- sglang.sm120-flag ----------------------------------------------------------------------


@st.composite
def sm120_flag_source(draw: st.DrawFn) -> tuple[str, str, str]:
    cuda = draw(st.sampled_from(["_is_cuda", "is_cuda()"]))
    form = draw(st.sampled_from(["call", "platform"]))
    arch = "is_sm100_supported()" if form == "call" else "get_platform().is_sm100"
    names = ["is_cuda", "is_sm90_supported", "is_sm100_supported"]
    alias = draw(st.sampled_from(["", "is_sm100_supported as is_sm100_supported", "as-other"]))
    if alias == "as-other":  # the SM100 check under another name: not a shape the patch knows
        names[2] = "is_sm100_supported as _sm100"
        arch = "_sm100()" if form == "call" else arch
    elif alias:
        names[2] = alias
    imports = draw(import_from("sglang.srt.utils", names))
    if form == "platform":
        imports += "from sglang.srt.runtime_context import get_platform\n"
    sm90 = arch.replace("100", "90")
    value = f"{cuda} and {arch}"
    rhs = draw(
        st.sampled_from(
            [value, f"({value})", f"(\n    {cuda}\n    and {arch}\n)", f"{cuda} \\\n    and {arch}"]
        )
    )
    source = (
        f"{imports}\n_is_cuda = is_cuda()\n_is_sm90_supported = {cuda} and {sm90}\n"
        f"_is_sm100_supported = {rhs}{draw(COMMENT)}\n_use_aiter = False\n"
    )
    return line_endings(source, draw(st.booleans())), cuda, form


@EXAMPLES
@given(sm120_flag_source())
def test_sm120_flag_variants(drawn):
    source, cuda, form = drawn

    def expected(tree: ast.Module) -> ast.Module:
        index = next(
            i
            for i, n in enumerate(tree.body)
            if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_is_sm100_supported"
        )
        arch = "is_sm120_supported()" if form == "call" else "get_platform().is_sm120"
        tree.body.insert(index + 1, ast.parse(f"_is_sm120_supported = {cuda} and {arch}").body[0])
        if form == "call":
            add_import(tree, "is_sm120_supported", "is_sm100_supported")
        return tree

    check(load_patch("sglang.sm120-flag"), source, expected)


# ---- sglang.fusion-gate -----------------------------------------------------------------------

FLAGS = """
_is_sm90_supported = _is_cuda and is_sm90_supported()
_is_sm100_supported = _is_cuda and is_sm100_supported()
_is_sm120_supported = _is_cuda and is_sm120_supported()
"""


@st.composite
def fusion_gate_source(draw: st.DrawFn) -> str:
    group = draw(or_group(["_is_sm90_supported", "_is_sm100_supported"], "        "))
    rest = ["_is_flashinfer_available", "batch_size > 0"]
    if draw(st.booleans()):  # the function of 0.5.8 on
        name = draw(st.sampled_from(["apply_flashinfer_allreduce_fusion", "flashinfer_ar_fusion_applies"]))
        test = draw(and_chain(group, rest, "    "))
        gate = f"\n\ndef {name}(batch_size: int):\n    return {test}\n"
    else:  # the method of 0.5.2 to 0.5.7
        test = draw(and_chain(group, rest, "        "))
        gate = (
            "\n\nclass CommunicateWithAllReduceAndLayerNormFn:\n"
            "    def _gather_hidden_states_and_residual(self, batch_size):\n"
            f"        if {test}:\n            return 1\n        return 0\n"
        )
    return line_endings(FLAGS + gate, draw(st.booleans()))


def fusion_gate_expected(tree: ast.Module) -> ast.Module:
    widen(find_or(tree, {"_is_sm90_supported", "_is_sm100_supported"}), "_is_sm120_supported")
    return tree


@EXAMPLES
@given(fusion_gate_source())
def test_fusion_gate_variants(source):
    check(load_patch("sglang.fusion-gate"), source, fusion_gate_expected)


# ---- sglang.fusion-autoenable and sglang.fusion-backend ----------------------------------------


def arch_names(form: str) -> tuple[list[str], str]:
    if form == "call":
        return ["is_sm90_supported()", "is_sm100_supported()"], "is_sm120_supported()"
    return ["get_platform().is_sm90", "get_platform().is_sm100"], "get_platform().is_sm120"


@st.composite
def utils_import(draw: st.DrawFn, form: str) -> tuple[str, bool]:
    """The imports of a server-args module, with or without is_sm120_supported."""
    names = ["is_sm90_supported", "is_sm100_supported"]
    has_sm120 = draw(st.booleans())
    if has_sm120:
        names.append("is_sm120_supported")
    text = draw(import_from("sglang.srt.utils", names))
    if form == "platform":
        text += "from sglang.srt.runtime_context import get_platform\n"
    return text, has_sm120


@st.composite
def fusion_autoenable_source(draw: st.DrawFn) -> tuple[str, str]:
    form = draw(st.sampled_from(["call", "platform"]))
    imports, _ = draw(utils_import(form))
    ops, _ = arch_names(form)
    group = draw(or_group(ops, "            "))
    test = draw(
        and_chain(
            "not self.enable_flashinfer_allreduce_fusion",
            ['model_arch in ["DeepseekV3ForCausalLM"]', group, "self.nnodes == 1"],
            "        ",
        )
    )
    source = f"""{imports}

class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if is_sm100_supported():
            self.attention_backend = "trtllm_mla"
        if {test}:{draw(COMMENT)}
            self.enable_flashinfer_allreduce_fusion = True
"""
    return line_endings(source, draw(st.booleans())), form


@EXAMPLES
@given(fusion_autoenable_source())
def test_fusion_autoenable_variants(drawn):
    source, form = drawn
    ops, extra = arch_names(form)

    def expected(tree: ast.Module) -> ast.Module:
        # SM120 auto-enables at TP2 only: `(<sm120> and self.tp_size == 2)`.
        widen(find_or(tree, set(ops)), f"({extra} and self.tp_size == 2)")
        if form == "call":
            add_import(tree, "is_sm120_supported", "is_sm100_supported")
        return tree

    check(load_patch("sglang.fusion-autoenable"), source, expected)


@st.composite
def fusion_backend_source(draw: st.DrawFn) -> tuple[str, str]:
    form = draw(st.sampled_from(["call", "platform"]))
    imports, _ = draw(utils_import(form))
    ops, _ = arch_names(form)
    group = draw(or_group(ops, "    "))
    space = draw(st.sampled_from(["", " "]))  # `not(` or `not (`
    source = f'''{imports}

def _resolve_backend(backend, is_multi_node=False):
    """Resolve the backend."""
    if not{space}{group}:{draw(COMMENT)}
        raise ValueError(
            "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."
        )
    if backend == "auto":
        return "trtllm"
    return backend
'''
    return line_endings(source, draw(st.booleans())), form


@EXAMPLES
@given(fusion_backend_source())
def test_fusion_backend_variants(drawn):
    source, form = drawn
    ops, extra = arch_names(form)

    def expected(tree: ast.Module) -> ast.Module:
        widen(find_or(tree, set(ops)), extra)
        if form == "call":
            add_import(tree, "is_sm120_supported", "is_sm100_supported")
        return tree

    check(load_patch("sglang.fusion-backend"), source, expected)


# ---- sglang.moe-backend -----------------------------------------------------------------------
# The SM120 branch is literal, and goes only beside the SM100 text it was written for
# (patchkit/moe.py): the variants are of the code around that text (imports, comments, an
# `else` or `elif` after it, CRLF); the SM100 branch itself, redrawn in any other layout, is
# refused and left as it is.


def glm_sm100(fixture: str) -> str:
    """The SM100 branch of the Glm4MoeForCausalLM site of a server_args fixture of
    test_sglang_moe_backend.py (upstream's text, at the site's indentation)."""
    lines = fixture.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "Glm4MoeForCausalLM" in line) + 1
    end = next(i for i in range(start + 1, len(lines))
               if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= 12)
    return "".join(lines[start:end]).rstrip("\n") + "\n"


def moe_forms() -> dict[str, str]:
    """The SM100 branch -> the name of the literal branch the patch puts after it."""
    from test_sglang_moe_backend import SERVER_ARGS_ELSE, SERVER_ARGS_GATED

    return {glm_sm100(SERVER_ARGS_GATED): "SGLang 0.5.8 to 0.5.10",
            glm_sm100(SERVER_ARGS_ELSE): "SGLang 0.5.11 to 0.5.14"}


# Layouts of the SM100 branch the patch has no literal twin for: (old, new) in its text.
MOE_RELAYOUTS = [
    ('"flashinfer_trtllm"', "'flashinfer_trtllm'"),
    ("if is_sm100_supported():\n", "if is_sm100_supported():  # note\n"),
    ("                if (\n", "\n                if (\n"),
    ('and self.moe_a2a_backend == "none"\n', 'and self.moe_a2a_backend == "none"  # a2a\n'),
]


@st.composite
def moe_drawn(draw: st.DrawFn) -> tuple[str, str, bool]:
    """(source, the SM100 branch's form, whether that branch was laid out anew)."""
    imports, _ = draw(utils_import("call"))
    sm100, form = draw(st.sampled_from(sorted(moe_forms().items())))
    relayout = draw(st.sampled_from([None, None, *MOE_RELAYOUTS]))
    if relayout is not None:
        sm100 = sm100.replace(*relayout, 1)
    q = draw(st.sampled_from(['"', "'"]))
    after = draw(st.sampled_from([
        "", "            else:\n                self.x = 1\n",
        "            elif is_sm90_supported():  # note\n                self.x = 1\n",
    ]))
    source = f"""{imports}

class ServerArgs:
    def _handle_model_specific_adjustments(self):
        if model_arch in [{q}DeepseekV3ForCausalLM{q}]:
            if is_sm100_supported():
                self.moe_runner_backend = {q}flashinfer_trtllm{q}
        elif model_arch in [{q}Glm4MoeForCausalLM{q}]:{draw(COMMENT)}
{sm100}{after}"""
    return line_endings(source, draw(st.booleans())), form, relayout is not None


def moe_source() -> st.SearchStrategy[str]:
    return moe_drawn().map(lambda drawn: drawn[0])


def moe_expected(form: str) -> Callable[[ast.Module], ast.Module]:
    """The tree with the literal branch named `form` right after the SM100 branch."""
    import importlib

    module = importlib.import_module(load_patch("sglang.moe-backend").transform.__module__)
    [branch] = [b for b in module.BRANCHES if b.name == form]

    def expected(tree: ast.Module) -> ast.Module:
        glm = next(n for n in ast.walk(tree)
                   if isinstance(n, ast.If) and "Glm4Moe" in ast.unparse(n.test))
        sm100 = glm.body[0]
        assert isinstance(sm100, ast.If)
        [new] = ast.parse(branch.code.removeprefix("el")).body
        assert isinstance(new, ast.If)
        new.orelse, sm100.orelse = sm100.orelse, [new]
        add_import(tree, "is_sm120_supported", "is_sm100_supported")
        return tree

    return expected


@EXAMPLES
@given(moe_drawn())
def test_moe_backend_variants(drawn):
    source, form, relaid = drawn
    status = check(load_patch("sglang.moe-backend"), source, moe_expected(form))
    assert status == ("refused" if relaid else "applied"), source


# ---- through the engine: apply then revert gives back every byte -----------------------------


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_source())
def test_engine_apply_then_revert_is_the_identity(source):
    from trees import make_tree

    from sm120patch.engine import apply, revert
    from sm120patch.plan import plans

    with tempfile.TemporaryDirectory() as tmp:
        sg = make_tree(Path(tmp), "sglang", "0.5.8", "installed")
        path = sg / "sglang" / "srt" / "server_args.py"
        path.write_bytes(source.encode())
        paths = {"sglang": sg}
        try:
            report = apply.apply("moe", paths)
        except plans.PlanRefused:
            event("engine: refused")
            assert path.read_bytes() == source.encode()
            return
        assert report.action == "applied"
        again = apply.apply("moe", paths)
        assert again.action == "nothing-to-do"
        revert.revert("moe", paths)
        assert path.read_bytes() == source.encode()


# ---- sglang.pcie-allreduce --------------------------------------------------------------------

PCIE_OVERRIDE = (
    "if world_size > 2 and not full_nvlink"
    ' and os.environ.get("SM120PATCH_PCIE_ALLREDUCE") != "0":\n'
    "    full_nvlink = True\n"
)


@st.composite
def pcie_allreduce_source(draw: st.DrawFn) -> tuple[str, bool]:
    """The gate in either release layout (a method up to 0.5.9, a function from 0.5.10), its
    test in any layout; `import os` alone, in a list, aliased (then the patch must refuse) or
    missing."""
    gate = draw(st.sampled_from([
        "world_size > 2 and not full_nvlink",
        "(world_size > 2 and not full_nvlink)",
        "world_size > 2 and (not full_nvlink)",
        "(\n{i}    world_size > 2  # more than two\n{i}    and not full_nvlink\n{i})",
    ]))
    imports = draw(st.sampled_from(["import os\n", "import json, os\n", "import os as _os\n", ""]))
    comment = draw(st.sampled_from(["", "{i}# test nvlink first\n", "\n{i}# a comment\n{i}\n"]))
    method = draw(st.booleans())
    i = "        " if method else "    "
    body = (
        f"{i}full_nvlink = is_full_nvlink(ids, world_size)\n"
        + comment.format(i=i)
        + f"{i}if {gate.format(i=i)}:{draw(COMMENT)}\n"
        f'{i}    logger.warning("disabled on PCIe")\n'
        f"{i}    return\n"
        f"{i}self_check = can_p2p()\n"
    )
    if method:
        code = f"class CustomAllreduce:\n    def __init__(self, world_size):\n{body}"
    else:
        code = (
            f"def can_use_custom_all_reduce_with_nvlink(world_size):\n{body}"
            "    return full_nvlink\n"
        )
    source = f"{imports}import logging\n\nlogger = logging.getLogger(__name__)\n\n\n{code}"
    ok = imports in ("import os\n", "import json, os\n")
    return line_endings(source, draw(st.booleans())), ok


def pcie_expected(tree: ast.Module) -> ast.Module:
    holders = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    func = holders[-1]
    index = next(k for k, s in enumerate(func.body) if isinstance(s, ast.If))
    func.body.insert(index, ast.parse(PCIE_OVERRIDE).body[0])
    return tree


@EXAMPLES
@given(pcie_allreduce_source())
def test_pcie_allreduce_variants(drawn):
    source, ok = drawn
    outcome = check(load_patch("sglang.pcie-allreduce"), source, pcie_expected)
    assert outcome == ("applied" if ok else "refused"), source
