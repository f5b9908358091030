"""One home per patch: its independent check lives in its module, beside its transform.

The real-release tier (tests/real/test_sites.py) runs `Patch.check` on every release a patch
applies to; these quick tests hold every library patch to declaring one, written with `ast`
and the kit's sitecheck helpers only (never libcst, the kit's operations or the patch's own
transform helpers, so the check does not repeat a mistake of what it checks), and show on a
small fixture that a check passes the patch's own output and fails a wrong one.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterable

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit import sitecheck
from sm120patch.patchkit.facts import Fact, Status
from sm120patch.patchkit.model import Patch, Result, not_applicable
from sm120patch.patchkit.runner import transform_text
from sm120patch.plan import catalog

# What a check may import inside its body: the standard library's tree tools.
STDLIB = {"ast", "copy", "enum", "typing"}


def missing_checks(patches: Iterable[Patch]) -> list[str]:
    """The patches that declare no check, or one defined outside their own module."""
    out = []
    for p in patches:
        if p.check is None:
            out.append(f"{p.id}: no check (Patch(check=...))")
        elif p.check.__module__ != p.transform.__module__:
            out.append(f"{p.id}: its check lives in {p.check.__module__}")
    return out


def test_every_library_patch_declares_its_check() -> None:
    assert missing_checks(catalog.load().patches.values()) == []


def _transform(module: object) -> Result:
    return not_applicable("site", "a fixture")


def test_a_patch_without_a_check_is_found() -> None:
    bare = Patch(id="x.bare", target="sglang", title="t", why="w", marker="m",
                 transform=_transform)
    assert missing_checks([bare]) == ["x.bare: no check (Patch(check=...))"]
    borrowed = Patch(id="x.borrowed", target="sglang", title="t", why="w", marker="m",
                     transform=_transform, check=sitecheck.widened_or)
    assert missing_checks([borrowed]) == [
        "x.borrowed: its check lives in sm120patch.patchkit.sitecheck"
    ]


def _check_def(patch: Patch) -> tuple[ast.Module, ast.FunctionDef]:
    module = sys.modules[patch.transform.__module__]
    tree = ast.parse(inspect.getsource(module))
    [found] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    return tree, found


def borrowed_names(tree: ast.Module, check: ast.FunctionDef) -> set[str]:
    """What a check uses that would tie it to the code it checks: the module's other functions
    (the transform and its helpers), libcst, the kit's operations, syntax or moe modules, and
    any import but the standard library's tree tools."""
    helpers = {n.name for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name != "check"}
    tied = helpers | {"cst", "libcst", "op", "operations", "syntax", "moe"}
    out = {n.id for n in ast.walk(check) if isinstance(n, ast.Name) and n.id in tied}
    for node in ast.walk(check):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name not in STDLIB}
        elif isinstance(node, ast.ImportFrom) and node.module not in STDLIB:
            # The check's own kit, imported where the check runs (every command loads the
            # patch module; only the real tier runs its check).
            if node.module == "sm120patch.patchkit" and [a.name for a in node.names] == [
                "sitecheck"
            ]:
                continue
            out.add(str(node.module))
    return out


@pytest.mark.parametrize("patch_id", sorted(catalog.load().patches))
def test_a_check_is_independent_of_its_transform(patch_id: str) -> None:
    tree, check = _check_def(load_patch(patch_id))
    assert borrowed_names(tree, check) == set()
    # and it sits where the template puts it: the last definition before PATCH
    names = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.Assign))]
    at = names.index(check)
    after = names[at + 1]
    assert isinstance(after, ast.Assign) and ast.unparse(after.targets[0]) == "PATCH"


def test_the_independence_rule_finds_a_borrowed_helper() -> None:
    tree = ast.parse(
        "def _helper(): ...\n"
        "def transform(m): ...\n"
        "def check(before, after, fact):\n"
        "    import libcst\n"
        "    from sm120patch.patchkit import operations\n"
        "    from sm120patch.patchkit import sitecheck as sc\n"
        "    return _helper(transform)\n"
    )
    check = tree.body[2]
    assert isinstance(check, ast.FunctionDef)
    assert borrowed_names(tree, check) == {
        "_helper", "transform", "libcst", "sm120patch.patchkit"
    }


# ----------------------------------------------------------------------------- a check can fail

COMM = "flashinfer/jit/comm.py"
RELEASE = '''\
def gen_trtllm_comm_module():
    return gen_jit_spec("trtllm_comm", supported_major_versions=[9, 10])


def gen_mixed_comm_module():
    return gen_jit_spec("mixed_comm", supported_major_versions=[9, 10])
'''
FACT = Fact(releases=">=0.4.0", status=Status.APPLIED, shape="fixture", file=COMM,
            function="gen_trtllm_comm_module", patch="flashinfer.comm-arch")


def _run_check(before: str, after: str) -> sitecheck.Spans:
    check = load_patch("flashinfer.comm-arch").check
    assert check is not None
    spans = check(ast.parse(before), ast.parse(after), FACT)
    sitecheck.only_in(before, after, spans)
    return spans


def test_the_check_passes_what_the_patch_writes() -> None:
    patched = transform_text([load_patch("flashinfer.comm-arch")], COMM, RELEASE).after
    assert patched != RELEASE
    assert _run_check(RELEASE, patched) == sitecheck.Spans([(2, 2)], [(2, 2)])


@pytest.mark.parametrize(
    ("wrong", "said"),
    [
        ("[9, 10, 13])", "after: [[9, 10, 13]]"),  # another arch
        ("[12, 9, 10])", "after: [[12, 9, 10]]"),  # not at the end
        ("[9, 10])  # 12", "after: [[9, 10]]"),  # in a comment only
    ],
)
def test_the_check_fails_a_wrong_change(wrong: str, said: str) -> None:
    after = RELEASE.replace("[9, 10])", wrong, 1)
    with pytest.raises(AssertionError, match=said.replace("[", r"\[").replace("]", r"\]")):
        _run_check(RELEASE, after)


def test_the_check_fails_a_change_in_another_function() -> None:
    after = RELEASE.replace("[9, 10])", "[9, 10, 12])")
    with pytest.raises(AssertionError, match="gen_mixed_comm_module's supported_major_versions"):
        _run_check(RELEASE, after)


def test_only_in_fails_a_line_outside_the_site() -> None:
    after = RELEASE.replace("[9, 10])", "[9, 10, 12])", 1) + "\nX = 1\n"
    with pytest.raises(AssertionError, match="added outside the site"):
        _run_check(RELEASE, after)
