"""vllm.allreduce-fusion-size: an SM120 row, world size 2 only, in vLLM's fusion size table.

vLLM sizes its FlashInfer allreduce(+RMSNorm) fusion workspace from
`FI_ALLREDUCE_FUSION_MAX_SIZE_MB` (vllm/compilation/passes/fusion/allreduce_rms_fusion.py), keyed
by `capability.to_int()`: 90, 100, 103, 107 in every pinned release.
`PassConfig.default_fi_allreduce_fusion_max_size_mb()` returns `{}` for a capability with no row,
so on SM120 (120) `flashinfer_max_size()` is None and `AllReduceFusionPass` turns itself off
("Flashinfer allreduce fusion is not supported for world size %s or max size is not provided"),
whatever the selector decided; the standalone `FlashInferAllReduce` reads the same table. This
patch adds `120: {2: <the SM90 row's world-size-2 value>}`: no public source gives SM120 sizes, so
the value is inferred (every row of every pinned release gives world size 2 the same 64 MB).
World sizes 4 and 8 are left out on purpose: the one public SM120 measurement with vLLM is at
TP2, and TP4 was reported to regress (SGLang, PCIe), so at TP4/TP8 the pass keeps switching
itself off as upstream. The table and row logic here serves the one-shot table too
(`vllm.allreduce-fusion-oneshot`, a second site in the same file), and so does the check, which
reads the table's name from the fact's `form`.
"""

from __future__ import annotations

import ast
import copy

import libcst as cst

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

FUSION = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"
TABLE = "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"
SM120 = 120  # `DeviceCapability.to_int()` of compute capability 12.0 (SM121 is 121: not added)
FROM_ROW = 90  # the row whose world-size-2 value is reused
WORLD = 2  # the one world size a public SM120 measurement with vLLM covers
PR_3903 = "https://github.com/flashinfer-ai/flashinfer/pull/3903"

# What vLLM logs about the fused pass (the same in 0.30.0 to 0.34.0): the workspace the pass
# needs came up (`get_fi_ar_workspace`, info_once), or the pass switched itself off or was never
# chosen. "allreduce-norm-quant fusion will be disabled" only drops the quant patterns: not a skip.
FUSION_WIRING = Wiring(
    ran=(r"Initialized FlashInfer Allreduce norm fusion workspace with backend=",),
    skipped=(
        r"Flashinfer allreduce fusion is not supported for world size",
        r"AllReduce fusion pass is disabled",
        r"Flashinfer allreduce-norm fusion will be disabled",
        r"Failed to initialize FlashInfer Allreduce norm fusion workspace with backend=",
        r"skipping allreduce fusion pass",
        r"Enabled custom fusions: (?!.*\ballreduce_rms\b)",
    ),
)

FACTS = (
    Fact(releases=">=0.30.0,<0.35", status=Status.APPLIED,
         shape=f"`{TABLE}: dict[int, dict[int, float]] = {{90: ..., 100: ..., 103: ..., "
         "107: ...}`, one row per line, no 120 row; world size 2 is 64 MB in every row",
         file=FUSION, form=TABLE, source="real files"),
)


# ----------------------------------------------------------------------------- shared with oneshot


def table_statement(module: cst.Module, table: str) -> tuple[cst.SimpleStatementLine, cst.Dict]:
    """The one module-level `table = {...}` or `table: T = {...}` and its dict literal."""
    found = []
    for stmt in module.body:
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
            continue
        small = stmt.body[0]
        if isinstance(small, cst.AnnAssign):
            target, value = small.target, small.value
        elif isinstance(small, cst.Assign) and len(small.targets) == 1:
            target, value = small.targets[0].target, small.value
        else:
            continue
        if isinstance(target, cst.Name) and target.value == table:
            found.append((stmt, value))
    if not found:
        raise NotApplicable(table, f"no module-level `{table} = {{...}}` in this file")
    if len(found) > 1:
        raise Refuse(table, f"one module-level `{table} = {{...}}`", f"{len(found)} assignments")
    stmt, value = found[0]
    if not isinstance(value, cst.Dict):
        raise Refuse(table, f"`{table}` a dict literal", f"`{_code(stmt)}`")
    return stmt, value


def _rows(table: str, value: cst.Dict) -> dict[int, cst.DictElement]:
    """The table's rows by capability int; refuses anything but `<int>: {<int>: <number>}`."""
    rows: dict[int, cst.DictElement] = {}
    for el in value.elements:
        if not (
            isinstance(el, cst.DictElement)
            and isinstance(el.key, cst.Integer)
            and isinstance(el.value, cst.Dict)
        ):
            raise Refuse(table, "rows `<capability int>: {<world size>: <MB>}`", f"`{_code(el)}`")
        rows[int(el.key.value)] = el
    return rows


def _literal(node: cst.CSTNode) -> object:
    """The value of a literal node, read from its own source text (comments and all)."""
    try:
        return ast.literal_eval(cst.Module(body=[]).code_for_node(node).strip())
    except (ValueError, SyntaxError):
        return None


def _code(node: cst.CSTNode) -> str:
    return h.code(node, 10_000)


def table_transform(module: cst.Module, table: str, comment: str) -> Result:
    """`table` gains the row `120: {2: <row 90's value at 2>}` after its last row, laid out as
    the rows above it, under the one comment line `comment`."""
    stmt, value = table_statement(module, table)
    rows = _rows(table, value)
    source = rows.get(FROM_ROW)
    source_map = _literal(source.value) if source is not None else None
    if not isinstance(source_map, dict) or WORLD not in source_map:
        found = f"`{_code(source)}`" if source is not None else f"no {FROM_ROW} row"
        raise Refuse(table, f"a {FROM_ROW} row with a world-size-{WORLD} entry to reuse", found)
    want = {WORLD: source_map[WORLD]}
    shape = f"`{table}[{SM120}] = {want}` (the SM90 row's world-size-{WORLD} entry)"
    if SM120 in rows:
        own = _literal(rows[SM120].value)
        if own == want:
            return already_applied(table, shape)
        return upstream(table, f"the release has its own SM120 row: `{SM120}: {own}`")
    assert source is not None and isinstance(source.value, cst.Dict)  # read above
    inner = source.value
    entry = next(
        e for e in inner.elements if isinstance(e, cst.DictElement) and _literal(e.key) == WORLD
    )
    last = value.elements[-1]
    between = value.elements[0].comma
    after_entry = entry.comma
    closing = inner.rbrace.whitespace_before
    laid_out = (
        len(value.elements) > 1
        and isinstance(last, cst.DictElement)
        and isinstance(last.comma, cst.Comma)
        and isinstance(between, cst.Comma)
        and isinstance(between.whitespace_after, cst.ParenthesizedWhitespace)
        and isinstance(after_entry, cst.Comma)
        and isinstance(after_entry.whitespace_after, cst.ParenthesizedWhitespace)
        and isinstance(closing, cst.ParenthesizedWhitespace)
    )
    if not laid_out:
        raise Refuse(
            table,
            f"`{table}` laid out one row and one entry per line, as released",
            f"`{_code(stmt)[:200]}`",
        )
    assert isinstance(between, cst.Comma) and isinstance(after_entry, cst.Comma)
    assert isinstance(between.whitespace_after, cst.ParenthesizedWhitespace)
    assert isinstance(after_entry.whitespace_after, cst.ParenthesizedWhitespace)
    assert isinstance(closing, cst.ParenthesizedWhitespace) and isinstance(last, cst.DictElement)
    # The entry's own comment (`# 64MB`) rides on its comma; as the row's only entry it moves
    # to the line before the closing brace, where the last entry's comment lives.
    new_inner = inner.with_changes(
        elements=[entry.with_changes(comma=cst.Comma())],
        rbrace=inner.rbrace.with_changes(whitespace_before=closing.with_changes(
            first_line=after_entry.whitespace_after.first_line, empty_lines=[],
        )),
    )
    gap = between.whitespace_after
    note = cst.EmptyLine(indent=True, whitespace=gap.last_line, comment=cst.Comment(comment))
    assert isinstance(last.comma, cst.Comma)  # `laid_out` above
    new_last = last.with_changes(
        comma=last.comma.with_changes(whitespace_after=gap.with_changes(empty_lines=[note]))
    )
    row = last.with_changes(key=cst.Integer(str(SM120)), value=new_inner)
    new_value = value.with_changes(elements=[*value.elements[:-1], new_last, row])
    # a module-level simple statement: the module's body is rebuilt around it (as the kit's
    # append_to_list does), `h.replace` walks compound statements only
    small = stmt.body[0]
    new_stmt = stmt.with_changes(body=[small.with_changes(value=new_value)])
    body = [new_stmt if s is stmt else s for s in module.body]
    return applied(table, module.with_changes(body=body), shape)


# ----------------------------------------------------------------------------- this site

COMMENT = f"# sm120patch vllm.allreduce-fusion-size: SM120, TP{WORLD} only (SM90's value, inferred)"


def transform(module: cst.Module) -> Result:
    return table_transform(module, TABLE, COMMENT)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """The fact's table (`fact.form`: FI_ALLREDUCE_FUSION_MAX_SIZE_MB here,
    _FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB for vllm.allreduce-fusion-oneshot, which runs this same
    check) is the release's table plus `120: {2: <row 90's value at 2>}` as its last row; with
    that row taken out, the file is the release's."""

    table = fact.form

    def the_dict(tree: ast.Module) -> ast.Dict:
        found = [
            n.value
            for n in tree.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            and n.value is not None
            and [ast.unparse(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
            == [table]
        ]
        value = sc.one(found, f"module-level {table}")
        assert isinstance(value, ast.Dict), f"{table} is not a dict literal"
        return value

    old, new = the_dict(before), the_dict(after)
    released = ast.literal_eval(old)
    assert SM120 not in released, f"the release already has a {SM120} row"
    assert [ast.literal_eval(k) for k in new.keys[:-1] if k is not None] == list(released)
    last_key, last_value = new.keys[-1], new.values[-1]
    assert last_key is not None and ast.literal_eval(last_key) == SM120, "the last row is not 120"
    assert ast.literal_eval(last_value) == {WORLD: released[FROM_ROW][WORLD]}, (
        f"row 120 is {ast.unparse(last_value)}"
    )
    restored = copy.deepcopy(after)
    rest = the_dict(restored)
    del rest.keys[-1], rest.values[-1]
    sc.same_but(before, restored, f"the {table} row")
    # the comment line above the row and the row; the row before it ends in the same `},` the
    # new row does, which a line diff may count as added instead
    return sc.Spans([], [(last_key.lineno - 2, last_value.end_lineno or last_value.lineno)])


PATCH = Patch(
    id="vllm.allreduce-fusion-size",
    check=check,
    target="vllm",
    title="An SM120 row (TP2 only) in vLLM's FlashInfer allreduce-fusion size table",
    why=(
        "vLLM keys FI_ALLREDUCE_FUSION_MAX_SIZE_MB by capability (90, 100, 103, 107) and returns "
        "no size for a capability without a row, so on SM120 AllReduceFusionPass switches "
        "itself off ('Flashinfer allreduce fusion is not supported for world size %s or max "
        "size is not provided') even where the selector chose it. The patch adds "
        "`120: {2: 64}`, the SM90 row's world-size-2 value. That value is inferred, not "
        "measured on SM120: no public source gives SM120 sizes, and every row of every pinned "
        "release gives world size 2 the same 64 MB "
        "(https://github.com/vllm-project/vllm/pull/49647 filled SM107's rows the same way, "
        "reusing 10.3's). TP4 and TP8 are left without a row on purpose, so the pass stays "
        "off there as upstream: the one public SM120 measurement with vLLM is TP2 ("
        f"{PR_3903}, comment of 2026-07-14) and TP4 was reported to regress "
        "(https://github.com/sgl-project/sglang/pull/32330, SGLang). A user who wants to try "
        "TP4 can pass --compilation-config "
        "'{\"pass_config\": {\"fi_allreduce_fusion_max_size_mb\": N}}' instead."
    ),
    marker=TABLE,
    transform=transform,
    facts=FACTS,
    upstream="https://github.com/vllm-project/vllm/pull/49647 (the same kind of row, for SM107)",
    sought=Sought(TABLE, (TABLE,)),
    wiring=FUSION_WIRING,
)
