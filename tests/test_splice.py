"""`transform.spliced_code` (the patched text made by generating only the changed statements)
is byte for byte what generating the whole module gives: on the fixture trees for every patch,
and on generated modules where one statement deep in nested blocks is replaced or inserted."""

from __future__ import annotations

import libcst as cst
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import FLASHINFER_FILES, SGLANG_FILES

from sm120patch.patchkit.runner import _changed_statements, spliced_code, transform_text
from sm120patch.plan import catalog


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


def _assign_paths(node: cst.CSTNode, path: tuple) -> list[tuple]:
    """The path (ancestors, then the line) to every `x = ...` line, in order."""
    out = []
    for child in node.children:
        if isinstance(child, cst.SimpleStatementLine):
            if len(child.body) == 1 and isinstance(child.body[0], cst.Assign):
                out.append((*path, node, child))
        elif not isinstance(child, cst.BaseExpression):
            out += _assign_paths(child, (*path, node))
    return out


def _with_child(parent: cst.CSTNode, old: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    changes = {}
    for name in parent.__dataclass_fields__:
        value = getattr(parent, name)
        if value is old:
            changes[name] = new
        elif isinstance(value, (tuple, list)) and any(v is old for v in value):
            changes[name] = [new if v is old else v for v in value]
    return parent.with_changes(**changes)


def edit(module: cst.Module, n: int, insert: bool) -> cst.Module:
    """Replace the n-th `x = <int>` by `x = <int> + 1`, or add a statement to its line, the way
    the patches do it: only the path down to it is rebuilt, every other node is kept."""
    paths = _assign_paths(module, ())
    if not paths:
        return module
    *ancestors, old = paths[n % len(paths)]
    if insert:
        new = old.with_changes(body=[*old.body, cst.parse_statement("inserted = True").body[0]])
    else:
        new = cst.parse_statement(cst.Module([old]).code.rstrip("\n") + " + 1\n")
    for parent in reversed(ancestors):
        new, old = _with_child(parent, old, new), parent
    return new


def block(depth: int, draw) -> list[str]:
    lines = []
    for i in range(draw(st.integers(1, 3))):
        if depth and draw(st.booleans()):
            head = draw(st.sampled_from(["if x:", "def f():", "class C:", "for i in y:", "with a:"]))
            lines.append(head)
            lines += ["    " + line for line in block(depth - 1, draw)]
            if head == "if x:":  # elif chains and else branches: where SGLang's gates are
                for branch in draw(st.lists(st.sampled_from(["elif z:", "else:"]), max_size=3)):
                    lines.append(branch)
                    lines += ["    " + line for line in block(depth - 1, draw)]
                    if branch == "else:":
                        break
        else:
            lines.append(draw(st.sampled_from(["# note", ""])) or f"x = {i}")
            lines.append(f"x = {i}")
    return lines


@st.composite
def modules(draw):
    return "\n".join(block(3, draw)) + "\n"


@settings(max_examples=80, deadline=None)
@given(modules(), st.integers(0, 20), st.booleans())
def test_a_deep_edit_splices_as_the_whole_module_generates(source, n, insert):
    before = cst.parse_module(source)
    after = edit(before, n, insert)
    assert spliced_code(before, source, after) == after.code
    if after is not before and after.code != source:
        # The splice itself ran (not its fallback to the whole module), and on less than it.
        spans = _changed_statements(before, after)
        assert spans is not None and len(spans[0]) <= len(before.body)
