"""`transform.spliced_code` (the patched text made by generating only the changed statements)
is byte for byte what generating the whole module gives: on the fixture trees for every patch,
and on generated modules where one statement deep in nested blocks is replaced or inserted."""

from __future__ import annotations

import libcst as cst
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import FLASHINFER_FILES, SGLANG_FILES

from sm120patch import catalog
from sm120patch.transform import spliced_code, transform_text


def test_every_patch_on_the_fixtures_splices_as_the_whole_module_generates():
    cat = catalog.load()
    checked = 0
    for files in (SGLANG_FILES, FLASHINFER_FILES):
        for rel, text in files.items():
            for patch in cat.patches.values():
                if rel not in patch.files:
                    continue
                result = transform_text([patch], rel, text)
                if result.steps:
                    assert result.after == result.steps[-1][1].code
                    checked += 1
    assert checked >= 4


class _Edit(cst.CSTTransformer):
    """Replace the n-th `x = <int>` by `x = <int> + 1`, or insert a statement after it."""

    def __init__(self, n: int, insert: bool) -> None:
        self.n, self.insert, self.seen = n, insert, 0

    def leave_SimpleStatementLine(self, original, updated):
        if not m_assign(updated):
            return updated
        self.seen += 1
        if self.seen - 1 != self.n:
            return updated
        if self.insert:
            return cst.FlattenSentinel([updated, cst.parse_statement("inserted = True\n")])
        return cst.parse_statement(cst.Module([updated]).code.rstrip("\n") + " + 1\n")


def m_assign(line: cst.SimpleStatementLine) -> bool:
    return len(line.body) == 1 and isinstance(line.body[0], cst.Assign)


def block(depth: int, draw) -> list[str]:
    lines = []
    for i in range(draw(st.integers(1, 3))):
        if depth and draw(st.booleans()):
            head = draw(st.sampled_from(["if x:", "def f():", "class C:", "for i in y:", "with a:"]))
            lines.append(head)
            lines += ["    " + line for line in block(depth - 1, draw)]
        else:
            lines.append(draw(st.sampled_from(["# note", ""])) or f"x = {i}")
            lines.append(f"x = {i}")
    return lines


@st.composite
def modules(draw):
    return "\n".join(block(3, draw)) + "\n"


@settings(max_examples=30, deadline=None)
@given(modules(), st.integers(0, 20), st.booleans())
def test_a_deep_edit_splices_as_the_whole_module_generates(source, n, insert):
    before = cst.parse_module(source)
    after = before.visit(_Edit(n, insert))
    assert spliced_code(before, source, after) == after.code
