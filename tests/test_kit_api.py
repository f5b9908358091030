"""The authoring API in libcst codemod's manner: a transform or a finder raises `Refuse` or
`NotApplicable` where it stops (as a codemod raises `SkipFile`), and the runner records the
same outcome a returned `refused(...)` / `not_applicable(...)` gave. Before/after pairs through
`runner.transform_text`, and the patch library read with `ast` for the old threading."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import libcst as cst
import pytest

from sm120patch.patchkit import model
from sm120patch.patchkit import operations as op
from sm120patch.patchkit import syntax as h
from sm120patch.patchkit.model import NotApplicable, Patch, Refuse, Result, Status
from sm120patch.patchkit.runner import FileResult, run_transform, transform_text

PATCHES = Path(__file__).resolve().parents[1] / "patches"
BEFORE = "def f():\n    x = 0\n"
AFTER = "def f():\n    x = 1\n"


def patch(transform: Callable[[cst.Module], Result], pid: str = "t.p") -> Patch:
    return Patch(id=pid, target="sglang", title="t", why="w", files=("f.py",), marker="def f",
                 transform=transform)


def run(transform: Callable[[cst.Module], Result], text: str = BEFORE) -> FileResult:
    return transform_text([patch(transform)], "f.py", text)


def set_x(module: cst.Module, *, stop_when_done: bool = False) -> Result:
    """`x = 0` -> `x = 1` inside the one `def f` (found with the kit's finder); where `x = 1`
    is there already, already-applied, or with `stop_when_done` a raised NotApplicable."""
    func = op.one_def(module, "f", "no `def f` here")
    assert isinstance(func.body, cst.IndentedBlock)
    [line] = func.body.body
    if h.code(line) == "x = 1":
        if stop_when_done:
            raise NotApplicable("f", "x is 1 already")
        return model.already_applied("f", "x = 1")
    new = h.replace(module, line, cst.parse_statement("x = 1\n"), scope=func)
    return model.applied("f", new, "x = 1")


# ---- a raised Refuse / NotApplicable is the outcome a returned one was ----------------------


@pytest.mark.parametrize(
    ("stop", "returned"),
    [
        (Refuse("site", "one `def f`", "2 definitions"),
         model.refused("site", "one `def f`", "2 definitions")),
        (NotApplicable("site", "no `def f` in this file"),
         model.not_applicable("site", "no `def f` in this file")),
    ],
    ids=["refuse", "not-applicable"],
)
def test_a_raised_stop_is_the_outcome_a_returned_result_was(
    stop: Exception, returned: Result
) -> None:
    def raising(module: cst.Module) -> Result:
        raise stop

    def returning(module: cst.Module) -> Result:
        return returned

    [got] = run(raising).outcomes
    [old] = run(returning).outcomes
    assert got == old
    assert (got.site, got.status, got.reason) == (returned.site, returned.status, returned.reason)


def test_refuse_from_a_finder_becomes_a_refusal_and_changes_nothing() -> None:
    text = "def f():\n    x = 0\nclass C:\n    def f(self):\n        x = 0\n"
    res = run(set_x, text)
    [outcome] = res.outcomes
    assert outcome.status is Status.REFUSED
    assert (outcome.site, outcome.reason) == ("f", "expected one `def f`; found 2 definitions")
    assert res.after == text and not res.steps


def test_not_applicable_from_a_finder_carries_its_reason() -> None:
    res = run(set_x, "y = 0\n")
    [outcome] = res.outcomes
    assert outcome.status is Status.NOT_APPLICABLE
    assert (outcome.site, outcome.reason) == ("f", "no `def f` here")
    assert res.after == "y = 0\n"


def test_the_transform_that_does_not_stop_applies() -> None:
    res = run(set_x)
    [outcome] = res.outcomes
    assert outcome.status is Status.APPLIED, outcome.reason
    assert res.after == AFTER
    [again] = run(set_x, AFTER).outcomes
    assert again.status is Status.ALREADY_APPLIED


def test_a_stop_in_one_patch_leaves_the_others_of_the_file_running() -> None:
    def refusing(module: cst.Module) -> Result:
        raise Refuse("g", "a `def g`", "none")

    res = transform_text([patch(refusing, "t.a"), patch(set_x, "t.b")], "f.py", BEFORE)
    assert [(o.patch, o.status) for o in res.outcomes] == [
        ("t.a", Status.REFUSED), ("t.b", Status.APPLIED)
    ]
    assert res.after == AFTER


def test_a_pack_transform_written_the_old_way_gives_the_same_outcomes() -> None:
    """A pack of 0.2.x threads the finder's result and returns its refusals: the check never
    holds now and the finder's raise reaches the runner, with the outcome it gave before."""

    def old_way(module: cst.Module) -> Result:
        found: object = op.one_def(module, "f", "no `def f` here")
        if isinstance(found, Result):
            return found
        return model.refused("f", "an `x = 0`", "a pack that never changes anything")

    [absent] = run(old_way, "y = 0\n").outcomes
    assert (absent.status, absent.reason) == (Status.NOT_APPLICABLE, "no `def f` here")
    [present] = run(old_way).outcomes
    assert present.status is Status.REFUSED
    assert present.reason == "expected an `x = 0`; found a pack that never changes anything"


# ---- a crash is still a refusal, worded as before -------------------------------------------


def test_a_crash_inside_a_transform_is_still_a_refusal() -> None:
    def crashing(module: cst.Module) -> Result:
        results: dict[str, Result] = {}
        return results["missing"]

    res = run(crashing)
    [outcome] = res.outcomes
    assert outcome.status is Status.REFUSED
    assert outcome.site == "<module>"
    assert outcome.reason == (
        "expected a shape this patch knows; found an error inside the patch "
        "(KeyError: 'missing')"
    )
    assert res.after == BEFORE


def test_run_transform_passes_a_crash_on_to_its_caller() -> None:
    def crashing(module: cst.Module) -> Result:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        run_transform(crashing, cst.parse_module(BEFORE))


def test_a_stop_on_the_second_run_undoes_the_first() -> None:
    """The verify step runs each applied patch again on its own result: `set_x` raising
    NotApplicable there is not a no-op, so nothing of the file applies."""
    res = run(lambda m: set_x(m, stop_when_done=True))
    [outcome] = res.outcomes
    assert outcome.status is Status.REFUSED
    assert outcome.reason == (
        "expected a second run to be a no-op; t.p said not-applicable (x is 1 already)"
    )
    assert res.after == BEFORE


# ---- the patch library threads no Result -----------------------------------------------------


def _patch_modules() -> list[Path]:
    return sorted(p for p in PATCHES.glob("*.py") if p.name != "__init__.py")


def test_no_patch_threads_a_result_from_a_finder() -> None:
    """`isinstance(x, Result)` was how a patch passed a finder's refusal on: finders raise now."""
    found = []
    for path in _patch_modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
                and "Result" in {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert _patch_modules() and not found, found


def test_patches_raise_their_stops() -> None:
    """A patch stops by raising `Refuse` / `NotApplicable`: none builds the old results."""
    found = [
        f"{path.name}:{node.lineno} {node.func.id}"
        for path in _patch_modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("refused", "not_applicable")
    ]
    assert not found, found
