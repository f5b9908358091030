"""Before/after tests of the declared operations (sm120patch.patchkit.operations), in the style of
libcst's CodemodTest: source in, expected source (or outcome) out, one case per shape."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import libcst as cst
import pytest

from sm120patch.patchkit import operations as op
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.model import (
    Import,
    NotApplicable,
    Patch,
    Refuse,
    Result,
    Status,
    already_applied,
    applied,
    refused,
    upstream,
)
from sm120patch.patchkit.runner import run_transform, transform_text


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def assert_codemod(result: Result, after: str | None, status: Status = Status.APPLIED) -> None:
    assert result.status is status, result.reason
    if after is not None:
        assert result.module.code == src(after)


# ---- extend_keyword_list ----------------------------------------------------------------------

KW = dict(function="gen", keyword="supported_major_versions", add=12)


@pytest.mark.parametrize(
    ("before", "expect", "after"),
    [
        ("f(supported_major_versions=[9, 10])", [9, 10], "f(supported_major_versions=[9, 10, 12])"),
        # the bug: one element used to give `[10,12]`
        ("f(supported_major_versions=[10])", [10], "f(supported_major_versions=[10, 12])"),
        ("f(supported_major_versions=[9,10])", [9, 10], "f(supported_major_versions=[9,10,12])"),
        ("f(supported_major_versions=[10,])", [10], "f(supported_major_versions=[10, 12,])"),
        (
            "f(\n        supported_major_versions=[\n            9,\n            10,\n        ]\n    )",
            [9, 10],
            "f(\n        supported_major_versions=[\n            9,\n            10,\n"
            "            12,\n        ]\n    )",
        ),
    ],
    ids=["two", "one", "tight", "one-trailing-comma", "one-per-line"],
)
def test_extend_keyword_list(before: str, expect: list[int], after: str) -> None:
    module = cst.parse_module(f"def gen():\n    return {before}\n")
    res = op.extend_keyword_list(module, expect=expect, **KW)
    assert_codemod(res, f"def gen():\n    return {after}\n")
    again = op.extend_keyword_list(res.module, expect=expect, **KW)
    assert again.status is Status.ALREADY_APPLIED


def test_extend_keyword_list_only_in_the_named_function() -> None:
    code = "def other():\n    f(supported_major_versions=[9, 10])\n"
    res = run_transform(
        lambda m: op.extend_keyword_list(m, expect=[9, 10], **KW), cst.parse_module(code)
    )
    assert res.status is Status.NOT_APPLICABLE


@pytest.mark.parametrize(
    ("body", "found"),
    [
        ("f(supported_major_versions=[8, 9])", "supported_major_versions=[8, 9]"),
        ("f(supported_major_versions=majors)", "supported_major_versions=majors"),
        ("f(supported_major_versions=[9, 10])\n    g(supported_major_versions=[9])", "2 such"),
        ("f()", "0 such"),
    ],
)
def test_extend_keyword_list_refuses(body: str, found: str) -> None:
    res = op.extend_keyword_list(cst.parse_module(f"def gen():\n    {body}\n"), expect=[9, 10], **KW)
    assert res.status is Status.REFUSED and found in res.reason


# ---- widen_arch_or ----------------------------------------------------------------------------


def widen(code: str, **kw: object) -> Result:
    module = cst.parse_module(code)
    group = module.body[0].body[0].value  # type: ignore[attr-defined]
    return op.widen_arch_or(module, group, module, site="s", expected="sm90 or sm100", **kw)


@pytest.mark.parametrize(
    ("before", "after", "forms"),
    [
        (
            "x = (is_sm90_supported() or is_sm100_supported())\n",
            "x = (is_sm90_supported() or is_sm100_supported() or is_sm120_supported())\n",
            ("call",),
        ),
        (
            "x = (get_platform().is_sm100 or get_platform().is_sm90)\n",
            "x = (get_platform().is_sm100 or get_platform().is_sm90 or get_platform().is_sm120)\n",
            ("platform",),
        ),
        (
            "x = (_is_sm90_supported or _is_sm100_supported)\n",
            "x = (_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)\n",
            ("flag",),
        ),
        (
            "x = (\n    is_sm90_supported()  # hopper\n    or is_sm100_supported()\n)\n",
            "x = (\n    is_sm90_supported()  # hopper\n    or is_sm100_supported()\n"
            "    or is_sm120_supported()\n)\n",
            ("call",),
        ),
    ],
    ids=["call", "platform", "flag", "multiline"],
)
def test_widen_arch_or_in_the_release_spelling(before: str, after: str, forms: tuple) -> None:
    res = widen(before, forms=forms)
    assert_codemod(res, after)
    assert widen(res.module.code, forms=forms).status is Status.ALREADY_APPLIED


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("x = (is_sm90_supported() or is_blackwell_supported())\n", Status.UPSTREAM),
        ("x = (is_sm90_supported() or get_platform().is_sm100)\n", Status.REFUSED),  # mixed
        ("x = (_is_sm90_supported or _is_sm100_supported)\n", Status.REFUSED),  # flag not allowed
        ("x = (is_sm90_supported() or is_cuda())\n", Status.REFUSED),
        ("x = (is_sm90_supported() or is_sm100_supported() or is_sm103_supported())\n",
         Status.REFUSED),
    ],
)
def test_widen_arch_or_outcomes(code: str, status: Status) -> None:
    res = widen(code)
    assert res.status is status, res.reason
    assert res.module is None


def test_widen_arch_or_strict_sm120_neighbours() -> None:
    code = "x = (_is_sm103_supported or _is_sm120_supported)\n"
    assert widen(code, forms=("flag",)).status is Status.ALREADY_APPLIED
    assert widen(code, forms=("flag",), others_ok=False).status is Status.REFUSED


# ---- add_module_flag --------------------------------------------------------------------------

FLAGS = "_is_cuda = is_cuda()\n_is_sm100_supported = _is_cuda and f()\nrest = 1\n"


def test_add_module_flag_after_its_sibling() -> None:
    res = op.add_module_flag(
        cst.parse_module(FLAGS), name="_is_sm120_supported", sibling="_is_sm100_supported",
        value="_is_cuda and g()", same=False,
    )
    assert_codemod(
        res,
        "_is_cuda = is_cuda()\n_is_sm100_supported = _is_cuda and f()\n"
        "_is_sm120_supported = _is_cuda and g()\nrest = 1\n",
    )


def test_add_module_flag_crlf() -> None:
    module = cst.parse_module(FLAGS.replace("\n", "\r\n"))
    res = op.add_module_flag(module, name="N", sibling="_is_sm100_supported", value="1", same=False)
    assert "_is_sm100_supported = _is_cuda and f()\r\nN = 1\r\nrest = 1\r\n" in res.module.code


@pytest.mark.parametrize(
    ("code", "same", "status"),
    [
        (FLAGS + "N = 1\n", True, Status.ALREADY_APPLIED),
        (FLAGS + "N = 2\n", False, Status.REFUSED),
        (FLAGS + "N = 1\nN = 1\n", True, Status.REFUSED),
        ("x = 1\n", False, Status.REFUSED),
        (FLAGS + "_is_sm100_supported = 0\n", False, Status.REFUSED),
    ],
    ids=["present", "different", "twice", "no-sibling", "sibling-twice"],
)
def test_add_module_flag_outcomes(code: str, same: bool, status: Status) -> None:
    res = op.add_module_flag(
        cst.parse_module(code), name="N", sibling="_is_sm100_supported", value="1", same=same
    )
    assert res.status is status, res.reason


# ---- requested imports (Result.needing, placed by the runner) ---------------------------------


def requesting(*imports: Import | None, var: str = "x") -> Patch:
    """A patch whose transform rewrites `x = 0` to `x = 1` (or finds `x = 1` there already)
    and requests `imports`: the runner places them."""
    edit = f"{var} = 1"

    def transform(module: cst.Module) -> Result:
        [line] = [s for s in module.body if h.code(s) in (f"{var} = 0", edit)]
        if h.code(line) == edit:
            return already_applied(var, edit).needing(*imports)
        new = module.deep_replace(line, cst.parse_statement(edit + "\n"))
        return applied(var, new, edit).needing(*imports)  # type: ignore[arg-type]

    return Patch(id=f"t.{var}", target="sglang", title="t", why="w", files=("f.py",),
                 marker=var, transform=transform)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("from m import a, b\n", "from m import a, c, b\n"),
        ("from m import (\n    a,\n    b,\n)\n", "from m import (\n    a,\n    c,\n    b,\n)\n"),
        ("from m import (\n    b,\n    a,\n)\n", "from m import (\n    b,\n    a,\n    c,\n)\n"),
        ("from m import a\n", "from m import a, c\n"),
    ],
    ids=["flat", "one-per-line", "last", "alone"],
)
def test_requested_import_goes_next_to_its_sibling(before: str, after: str) -> None:
    res = transform_text([requesting(Import("c", next_to="a"))], "f.py", before + "x = 0\n")
    [outcome] = res.outcomes
    assert outcome.status is Status.APPLIED, outcome.reason
    assert res.after == after + "x = 1\n"
    assert outcome.shape == "x = 1; c imported" and outcome.reason == "patched (x = 1; c imported)"
    [again] = transform_text([requesting(Import("c", next_to="a"))], "f.py", res.after).outcomes
    assert again.status is Status.ALREADY_APPLIED


def test_requested_import_already_there_is_left_alone() -> None:
    code = "from n import c as c\nfrom m import a\nx = 0\n"
    res = transform_text([requesting(Import("c", next_to="a"))], "f.py", code)
    assert res.after == code.replace("x = 0", "x = 1")
    assert res.outcomes[0].shape == "x = 1"


def test_requested_import_from_a_named_module() -> None:
    code = "from n import a\nfrom m import a as a2, b\nx = 0\n"
    res = transform_text([requesting(Import("c", next_to="b", module="m"))], "f.py", code)
    assert res.after == "from n import a\nfrom m import a as a2, b, c\nx = 1\n"
    wrong = transform_text([requesting(Import("c", next_to="a", module="m"))], "f.py", code)
    [outcome] = wrong.outcomes
    assert outcome.status is Status.REFUSED and not wrong.changed
    assert outcome.reason == (
        "expected one module-level `from m import` naming a, to add c; found 0 such imports"
    )


@pytest.mark.parametrize(
    ("code", "found"),
    [("from m import a\nfrom n import a\n", "2 such imports"), ("import a\n", "0 such imports")],
)
def test_requested_import_refuses_without_one_sibling_import(code: str, found: str) -> None:
    res = transform_text([requesting(Import("c", next_to="a"))], "f.py", code + "x = 0\n")
    [outcome] = res.outcomes
    assert outcome.status is Status.REFUSED and outcome.reason.endswith(found)
    assert not res.changed


def test_requested_import_missing_beside_a_change_already_made_refuses() -> None:
    res = transform_text([requesting(Import("c", next_to="a"))], "f.py", "from m import a\nx = 1\n")
    [outcome] = res.outcomes
    assert outcome.status is Status.REFUSED
    assert outcome.reason == "expected `c` imported where it is used; found no such import"


def test_two_patches_requesting_one_name_import_it_once() -> None:
    first = requesting(Import("c", next_to="a"))
    second = requesting(Import("c", next_to="a"), Import("c", next_to="a"), var="y")
    res = transform_text([first, second], "f.py", "from m import a\nx = 0\ny = 0\n")
    assert [o.status for o in res.outcomes] == [Status.APPLIED, Status.APPLIED]
    assert res.after == "from m import a, c\nx = 1\ny = 1\n"
    # The step the engine commits for the first patch already holds the import it needs.
    assert res.step_texts()[0][1] == "from m import a, c\nx = 1\ny = 0\n"
    assert res.outcomes[1].shape == "y = 1"


def test_refusals_and_skips_request_nothing() -> None:
    res = refused("s", "a", "b").needing(Import("c", next_to="a"))
    assert res.imports == ()
    assert upstream("s", "r").needing(Import("c", next_to="a")).imports == ()
    assert already_applied("s", "x").needing(None).imports == ()


def test_widen_arch_or_requests_the_import_of_the_call_form() -> None:
    res = widen("x = (is_sm90_supported() or is_sm100_supported())\n", forms=("call",))
    assert res.imports == (Import("is_sm120_supported", next_to="is_sm100_supported"),)
    done = widen("x = (is_sm90_supported() or is_sm120_supported())\n", forms=("call",))
    assert done.status is Status.ALREADY_APPLIED and done.imports == res.imports
    flag = widen("x = (_is_sm90_supported or _is_sm100_supported)\n", forms=("flag",))
    assert flag.imports == ()


# ---- add_elif ---------------------------------------------------------------------------------

CHAIN = src(
    """
    def f():
        if a():
            x = 1
        elif b():
            x = 2
        else:
            x = 3
    """
)


def test_add_elif_after_a_branch_found_by_its_test() -> None:
    module = cst.parse_module(CHAIN)
    func = module.body[0]
    [anchor] = [b for b in op.branches_in(func.body) if h.key(b.test) == "a()"]
    body = cst.parse_statement("if c():\n    x = 9\n").body  # type: ignore[attr-defined]
    branch = op.new_elif(anchor, cst.parse_expression("c()"), body)
    res = op.add_elif(module, anchor, branch, site="f", shape="elif c()")
    assert_codemod(
        res,
        """
        def f():
            if a():
                x = 1
            elif c():
                x = 9
            elif b():
                x = 2
            else:
                x = 3
        """,
    )
    assert [h.key(b.test) for b in op.branches_in(res.module.body[0].body)] == ["a()", "c()", "b()"]


# ---- one_def ----------------------------------------------------------------------------------


def test_one_def() -> None:
    with pytest.raises(NotApplicable) as gone:
        op.one_def(cst.parse_module("x = 1\n"), "f", "gone")
    assert gone.value.result.status is Status.NOT_APPLICABLE and gone.value.result.reason == "gone"
    with pytest.raises(Refuse) as two:
        op.one_def(cst.parse_module("def f(): pass\nclass C:\n    def f(self): pass\n"), "f")
    assert two.value.result.status is Status.REFUSED and "2 definitions" in two.value.result.reason
    assert isinstance(op.one_def(cst.parse_module("def f(): pass\n"), "f"), cst.FunctionDef)


def found_by(finder: Callable[[cst.Module], object], code: str) -> Result:
    """What the runner records where `finder` stops on `code` (it must stop: a finder that
    returns a node here fails the test)."""

    def transform(module: cst.Module) -> Result:
        raise AssertionError(f"found {finder(module)!r}")

    return run_transform(transform, cst.parse_module(code))


# ---- one_of_defs ------------------------------------------------------------------------------

RENAMED = ("new_name", "old_name")
METHOD = ("Cls", "meth")


@pytest.mark.parametrize(
    ("code", "site"),
    [
        ("def old_name(): pass\n", "old_name"),
        ("def new_name(): pass\nclass Cls:\n    def meth(self): pass\n", "new_name"),
        ("class Cls:\n    def meth(self): pass\n", "Cls.meth"),
    ],
    ids=["old-name", "a-name-before-the-method", "method"],
)
def test_one_of_defs_finds_the_site(code: str, site: str) -> None:
    found = op.one_of_defs(cst.parse_module(code), RENAMED, fallback=METHOD)
    assert found[0] == site and found[1].name.value == site.split(".")[-1]


@pytest.mark.parametrize(
    ("code", "status", "site", "reason"),
    [
        ("x = 1\n", Status.NOT_APPLICABLE, "Cls.meth",
         "no def new_name nor def old_name nor Cls.meth in this file"),
        ("def new_name(): pass\ndef old_name(): pass\n", Status.REFUSED, "new_name / old_name",
         "expected one of def new_name, def old_name, Cls.meth; found 2 definitions of "
         "new_name, old_name"),
        ("class Cls:\n    def meth(self): pass\nclass Cls:\n    def meth(self): pass\n",
         Status.REFUSED, "Cls.meth", "found 2 definitions of Cls.meth"),
    ],
    ids=["none", "two-names", "method-twice"],
)
def test_one_of_defs_outcomes(code: str, status: Status, site: str, reason: str) -> None:
    res = found_by(lambda m: op.one_of_defs(m, RENAMED, fallback=METHOD), code)
    assert res.status is status and res.site == site
    assert reason in res.reason


def test_one_of_defs_required_or_with_its_reason() -> None:
    gone = found_by(lambda m: op.one_of_defs(m, RENAMED, "renamed in 2.0"), "x = 1\n")
    assert gone.status is Status.NOT_APPLICABLE
    assert gone.reason == "renamed in 2.0" and gone.site == "new_name / old_name"
    needed = found_by(lambda m: op.one_of_defs(m, RENAMED, fallback=METHOD, required=True),
                      "x = 1\n")
    assert needed.status is Status.REFUSED
    assert needed.reason == (
        "expected one of def new_name, def old_name, Cls.meth; found none of them"
    )
    assert op.one_of_defs(cst.parse_module("def f(): pass\n"), ("f",))[0] == "f"
    twice = found_by(lambda m: op.one_of_defs(m, ("f",)), "def f(): pass\ndef f(): pass\n")
    assert "expected one `def f`" in twice.reason
