"""sglang.fp4-gemm-enum: a `flashinfer_b12x` member of SGLang's FP4 GEMM runner backends (site G).

FlashInfer's `mm_fp4` has a backend written for SM120/SM121, `b12x` (FlashInfer 0.6.9 on);
SGLang's `Fp4GemmRunnerBackend` has no member that reaches it. The patch adds
`FLASHINFER_B12X = "flashinfer_b12x"` after `FLASHINFER_TRTLLM` and its predicate
`is_flashinfer_b12x()` after `is_flashinfer_trtllm()`, as
https://github.com/sgl-project/sglang/pull/38170 proposes.
The mapping to FlashInfer's name needs no change: `get_flashinfer_backend()` strips the
`flashinfer_` prefix in every release that has the enum, so the member maps to `b12x`; the patch
refuses a release where it does not.
"""

from __future__ import annotations

import ast
from enum import Enum
from typing import Any

import libcst as cst

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import NotApplicable, Patch, Refuse, Result, Status, already_applied

CLASS = "Fp4GemmRunnerBackend"
MEMBER = "FLASHINFER_B12X"
VALUE = "flashinfer_b12x"
PREDICATE = "is_flashinfer_b12x"
ANCHOR_MEMBER = ("FLASHINFER_TRTLLM", "flashinfer_trtllm")
ANCHOR_PREDICATE = "is_flashinfer_trtllm"
MAPPING = "get_flashinfer_backend"
PREFIX = "flashinfer_"


def transform(module: cst.Module) -> Result:
    found = h.classes(module, CLASS)
    if not found:
        raise NotApplicable(CLASS, f"no `class {CLASS}` in this file (it exists from 0.5.8)")
    if len(found) > 1:
        raise Refuse(CLASS, f"one `class {CLASS}`", f"{len(found)} definitions")
    cls = found[0]
    if not isinstance(cls.body, cst.IndentedBlock):
        raise Refuse(CLASS, "a class body", f"`{h.code(cls)}`")
    body = list(cls.body.body)
    members = _members(body)
    methods = {s.name.value: s for s in body if isinstance(s, cst.FunctionDef)}

    if not _maps_by_prefix(methods.get(MAPPING)):
        raise Refuse(
            CLASS,
            f'`def {MAPPING}` returning `self.value.removeprefix("{PREFIX}")` (so that '
            f"{VALUE} reaches FlashInfer's mm_fp4 as b12x)",
            "another mapping" if MAPPING in methods else f"no `def {MAPPING}`",
        )
    others = [n for n, v in members.items() if v == VALUE and n != MEMBER]
    if others:
        raise Refuse(CLASS, f"no member valued {VALUE!r} but {MEMBER}", f"`{others[0]}`")
    if MEMBER in members or PREDICATE in methods:
        if members.get(MEMBER) == VALUE and _is_predicate(methods.get(PREDICATE)):
            return already_applied(CLASS, f'{MEMBER} = "{VALUE}" and {PREDICATE}()')
        raise Refuse(
            CLASS,
            f'no {MEMBER}, or `{MEMBER} = "{VALUE}"` with `def {PREDICATE}`',
            f"{MEMBER} = {members.get(MEMBER)!r}, {PREDICATE} "
            + ("defined" if PREDICATE in methods else "missing"),
        )

    anchor_name, anchor_value = ANCHOR_MEMBER
    if members.get(anchor_name) != anchor_value or ANCHOR_PREDICATE not in methods:
        raise Refuse(
            CLASS,
            f'`{anchor_name} = "{anchor_value}"` and `def {ANCHOR_PREDICATE}` to add the new '
            "member and predicate after",
            f"{anchor_name} = {members.get(anchor_name)!r}, {ANCHOR_PREDICATE} "
            + ("defined" if ANCHOR_PREDICATE in methods else "missing"),
        )
    member_stmt = next(s for s in body if _assigned(s) == anchor_name)
    new_member = h.parse_statement(f'{MEMBER} = "{VALUE}"{module.default_newline}', module)
    anchor_def = methods[ANCHOR_PREDICATE]
    # The predicate in the form of its neighbour: `return self == <Class>.<MEMBER>`.
    new_def = anchor_def.with_changes(name=anchor_def.name.with_changes(value=PREDICATE))
    attrs = [
        a
        for a in h.matching_nodes(new_def.body, cst.Attribute)
        if isinstance(a, cst.Attribute) and a.attr.value == anchor_name
    ]
    if len(attrs) != 1 or not _is_predicate_of(anchor_def, anchor_name):
        raise Refuse(
            CLASS,
            f"`def {ANCHOR_PREDICATE}(self)` returning `self == {CLASS}.{anchor_name}`",
            f"`{h.code(anchor_def)}`",
        )
    attr = attrs[0]
    new_def = new_def.with_deep_changes(attr, attr=cst.Name(MEMBER))
    index_member = body.index(member_stmt)
    body.insert(index_member + 1, new_member)
    index_def = next(i for i, s in enumerate(body) if s is anchor_def)
    body.insert(index_def + 1, new_def)  # its leading blank line comes with the copy
    new_cls = cls.with_changes(body=cls.body.with_changes(body=body))
    shape = f'{MEMBER} = "{VALUE}" after {anchor_name}; {PREDICATE}() after {ANCHOR_PREDICATE}()'
    return op.replace_statement(module, cls, new_cls, site=CLASS, shape=shape)


def _assigned(stmt: cst.CSTNode) -> str | None:
    """The name a one-target `NAME = ...` statement assigns, else None."""
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
        and len(stmt.body[0].targets) == 1
        and isinstance(stmt.body[0].targets[0].target, cst.Name)
    ):
        return stmt.body[0].targets[0].target.value
    return None


def _members(body: list[cst.BaseStatement]) -> dict[str, str | None]:
    """Enum members of a class body: name -> its string value (None for any other value)."""
    out: dict[str, str | None] = {}
    for stmt in body:
        name = _assigned(stmt)
        if name is None or not isinstance(stmt, cst.SimpleStatementLine):
            continue
        assign = stmt.body[0]
        value = assign.value if isinstance(assign, cst.Assign) else None
        text = value.evaluated_value if isinstance(value, cst.SimpleString) else None
        out[name] = text if isinstance(text, str) else None  # a bytes value is no member's
    return out


def _maps_by_prefix(func: cst.FunctionDef | None) -> bool:
    """Whether the mapping method strips the `flashinfer_` prefix off the member's value."""

    if func is None:
        return False
    def strips_prefix(c: cst.CSTNode) -> bool:
        return (
            isinstance(c, cst.Call)
            and isinstance(c.func, cst.Attribute)
            and c.func.attr.value == "removeprefix"
            and h.key(c.func.value) == "self.value"
            and len(c.args) == 1
            and isinstance(c.args[0].value, cst.SimpleString)
            and c.args[0].value.evaluated_value == PREFIX
        )

    calls = h.matching_nodes(func.body, cst.Call, strips_prefix)
    return len(calls) == 1


def _is_predicate_of(func: cst.FunctionDef | None, member: str) -> bool:
    """`def is_x(self) -> bool: return self == Fp4GemmRunnerBackend.<member>`."""

    if func is None or not isinstance(func.body, cst.IndentedBlock) or len(func.body.body) != 1:
        return False
    line = func.body.body[0]
    if not (isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Return)):
        return False
    value = line.body[0].value
    return (
        isinstance(value, cst.Comparison)
        and h.key(value.left) == "self"
        and len(value.comparisons) == 1
        and isinstance(value.comparisons[0].operator, cst.Equal)
        and h.key(value.comparisons[0].comparator) == f"{CLASS}.{member}"
    )


def _is_predicate(func: cst.FunctionDef | None) -> bool:
    return _is_predicate_of(func, MEMBER)


FP4_UTILS = "sglang/srt/layers/quantization/fp4_utils.py"
FACTS = (
    Fact(
        releases="<0.5.8",
        status=Status.NOT_APPLICABLE,
        shape="no Fp4GemmRunnerBackend: modelopt_quant.py picks the mm_fp4 backend from "
        "environment variables",
        source="real files",
        note="fp4_utils.py exists from 0.5.8",
    ),
    Fact(
        releases=">=0.5.8,<0.5.24",
        status=Status.APPLIED,
        shape='`class Fp4GemmRunnerBackend(Enum)` with `FLASHINFER_TRTLLM = "flashinfer_trtllm"`, '
        "`is_flashinfer_trtllm()` and `get_flashinfer_backend()` stripping `flashinfer_`",
        file=FP4_UTILS,
        function=CLASS,
        source="real files",
    ),
)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """FLASHINFER_B12X = "flashinfer_b12x" right after FLASHINFER_TRTLLM, is_flashinfer_b12x()
    right after is_flashinfer_trtllm(), both in the fact's class; the class, run, maps the new
    member to mm_fp4's "b12x"; with the two taken out, the file is the release's."""

    def name_of(stmt: ast.stmt) -> str | None:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            return stmt.targets[0].id
        return stmt.name if isinstance(stmt, ast.FunctionDef) else None

    cls = sc.one([n for n in after.body if isinstance(n, ast.ClassDef)
                  and n.name == fact.function], f"class {fact.function}")
    names = [name_of(s) for s in cls.body]
    i, j = names.index("FLASHINFER_TRTLLM"), names.index("is_flashinfer_trtllm")
    assert names[i + 1] == "FLASHINFER_B12X", f"after FLASHINFER_TRTLLM: {names[i + 1]}"
    assert names[j + 1] == "is_flashinfer_b12x", f"after is_flashinfer_trtllm: {names[j + 1]}"
    member, method = cls.body[i + 1], cls.body[j + 1]
    assert isinstance(member, ast.Assign) and isinstance(method, ast.FunctionDef)
    assert ast.literal_eval(member.value) == "flashinfer_b12x", ast.unparse(member)
    # The release's own enum class, run on its own (its body defines members and methods): what
    # mm_fp4 is told is the behaviour that matters, whatever the method's spelling.
    scope: dict[str, Any] = {"Enum": Enum}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), "fp4_utils.py", "exec"), scope)
    b12x = scope[cls.name]("flashinfer_b12x")
    assert b12x.get_flashinfer_backend() == "b12x" and b12x.is_flashinfer_b12x()
    assert not scope[cls.name]("flashinfer_cutlass").is_flashinfer_b12x()
    sc.same_but(before, sc.without(after, [member, method]), "the member and the predicate")
    return sc.Spans([], [sc.span(member), sc.with_blank_lines(method, 1)])


PATCH = Patch(
    id="sglang.fp4-gemm-enum",
    check=check,
    target="sglang",
    title="Add flashinfer_b12x to SGLang's FP4 GEMM runner backends",
    why=(
        "FlashInfer's mm_fp4 has a b12x backend for SM120/SM121 from FlashInfer 0.6.9 (CUDA 13, "
        "12.9 for NVFP4 from FlashInfer 0.7; the 128x4 scale layout), but SGLang's "
        "Fp4GemmRunnerBackend has no member for it, so neither --fp4-gemm-backend nor auto "
        "can reach it. The patch adds FLASHINFER_B12X = "
        '"flashinfer_b12x" and is_flashinfer_b12x(), as '
        "https://github.com/sgl-project/sglang/pull/38170 does; "
        'get_flashinfer_backend() already maps it to FlashInfer\'s "b12x" by stripping the '
        "flashinfer_ prefix. The weights are prepared as for flashinfer_cutlass (the 128x4 "
        "swizzled scales both use)."
    ),
    marker=f"class {CLASS}",
    facts=FACTS,
    upstream="https://github.com/sgl-project/sglang/pull/38170",
    transform=transform,
)
