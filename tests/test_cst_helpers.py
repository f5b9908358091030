from __future__ import annotations

import libcst as cst

from sm120patch.patchkit import imports
from sm120patch.patchkit import syntax as h


def widen(src: str) -> str:
    module = cst.parse_module(src)
    node = module.body[0].body[0].value
    return module.deep_replace(node, h.widen_or(node, cst.Name("c"))).code


def test_widen_or_one_line():
    assert widen("x = (a or b)\n") == "x = (a or b or c)\n"


def test_widen_or_multiline_does_not_copy_comments():
    src = "x = (\n    a  # first\n    or b\n)\n"
    assert widen(src) == "x = (\n    a  # first\n    or b\n    or c\n)\n"


def test_or_keys_flatten_parentheses():
    node = cst.parse_expression("((a or b) or f().g)")
    assert [h.key(op) for op in h.or_operands(node) or []] == ["a", "b", "f().g"]


def test_key_rejects_calls_with_arguments():
    assert h.key(cst.parse_expression("f(1)")) is None


def test_add_import_after_in_parenthesised_import():
    src = "from m import (\n    a,\n    b,\n)\n"
    new = imports.add_import_after(cst.parse_module(src), "m", "c", after="a")
    assert new is not None
    assert new.code == "from m import (\n    a,\n    c,\n    b,\n)\n"


def test_add_import_after_last_name():
    src = "from m import (\n    a,\n    b,\n)\n"
    new = imports.add_import_after(cst.parse_module(src), "m", "c", after="b")
    assert new.code == "from m import (\n    a,\n    b,\n    c,\n)\n"


def test_add_import_after_one_line():
    new = imports.add_import_after(cst.parse_module("from m import a, b\n"), "m", "c", after="b")
    assert new.code == "from m import a, b, c\n"


def test_add_import_after_refuses_ambiguity():
    src = "from m import a\nfrom m import a\n"
    assert imports.add_import_after(cst.parse_module(src), "m", "c", after="a") is None
    assert imports.add_import_after(cst.parse_module("from n import a\n"), "m", "c", after="a") is None
