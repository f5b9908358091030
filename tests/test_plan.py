"""The planner: what one patch cannot see from its own file."""

from __future__ import annotations

from trees import make_tree

from sm120patch.patchkit.model import Status
from sm120patch.plan import planner


def test_an_import_the_release_lacks_refuses_the_file(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    common = sg / "sglang/srt/utils/common.py"
    common.write_text(common.read_text().replace("def is_sm120_supported(): ...\n", ""))
    p = planner.plan("fusion", {"sglang": sg, "flashinfer": fi})
    by_patch = {o.patch: o for o in p.outcomes}
    flag = by_patch["sglang.sm120-flag"]
    assert flag.status is Status.REFUSED
    assert "sglang.srt.utils.is_sm120_supported" in flag.reason
    # The whole file is left alone, not half patched; other files are unaffected.
    assert by_patch["sglang.fusion-gate"].status is Status.REFUSED
    assert by_patch["flashinfer.comm-arch"].status is Status.APPLIED
    assert all(not f.changed for tp in p.targets for f in tp.files if f.file.endswith("communicator.py"))


def test_imports_resolve_through_star_imports(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    p = planner.plan("fusion", {"sglang": sg, "flashinfer": fi})
    assert not p.refused
    assert "+    is_sm120_supported,\n" in p.diff()


class _At:
    """What `_defines` reads of a target: the directory its package lives in, held open."""

    def __init__(self, parent):
        from sm120patch.handle import TreeHandle

        self.parent = parent
        self.handle = TreeHandle(parent)

    def rel(self, file):
        return file  # the package's parent is the tree's root here


def test_defines_fast_path_agrees_with_the_tree(tmp_path):
    """The regex fast path (a top-level def, class or assignment) says yes only where the
    syntax tree does; a binding it cannot see (inside a docstring, indented, a comparison)
    goes to the tree, which says no."""
    cases = {
        "def name(x):\n    pass\n": True,
        "async def name():\n    pass\n": True,
        "class name:\n    pass\n": True,
        "name = lru_cache(maxsize=1)(lambda: True)\n": True,
        "name: bool = True\n": True,
        "from os import path as name\n": True,
        '"""A docstring.\n\nname = 1\ndef name(): ...\n"""\n': False,
        "if True:\n    name = 1\n": False,
        "name == 1\n": False,
        "name_other = 1\nclass name_other2: ...\n": False,
        "name: int\n": False,
    }
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for i, (source, binds) in enumerate(cases.items()):
        (pkg / f"m{i}.py").write_text(source)
        assert planner._defines(_At(tmp_path), f"pkg.m{i}", "name", depth=0) is binds, source


def test_patches_with_no_file_each_name_their_own_files(tmp_path):
    """Two patches whose files are all absent share one result, and each says which of its own
    files it looked for (not the first patch's)."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    p = planner.plan("all", {"sglang": sg, "flashinfer": fi})
    by_patch = {o.patch: o for o in p.outcomes}
    preflight, minimax = by_patch["sglang.fusion-preflight"], by_patch["sglang.moe-backend-minimax"]
    assert preflight.status is minimax.status is Status.NOT_APPLICABLE
    assert "flashinfer_comm_fusion.py" in preflight.reason
    assert "minimax_m2.py" in minimax.reason and "flashinfer_comm_fusion" not in minimax.reason


def test_a_targets_kind_is_the_kind_enum_and_prints_as_its_word(tmp_path):
    import json

    from sm120patch import targets
    from sm120patch.patchkit.model import Kind
    from sm120patch.targets import finding

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    target = finding.find("sglang", sg)
    assert target.kind is Kind.SGLANG
    assert f"{target.kind}" == "sglang" and json.dumps({target.kind: target.kind}) == (
        '{"sglang": "sglang"}'
    )
    assert targets.KINDS == (Kind.SGLANG, Kind.FLASHINFER, Kind.VLLM) == ("sglang", "flashinfer", "vllm")


def test_a_plan_keeps_texts_and_no_tree(tmp_path):
    """Once planned, no syntax tree is held (neither by the plan nor by the parse cache): the
    cyclic collector would walk each for the rest of the process. The texts stay."""
    import gc

    import libcst

    from sm120patch.patchkit import runner

    def trees() -> set[int]:
        gc.collect()  # what is left unreferenced in a cycle is no tree anyone holds
        return {id(o) for o in gc.get_objects() if isinstance(o, libcst.Module)}

    held = trees()  # what earlier tests of the same process may still hold
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    p = planner.plan("all", {"sglang": sg, "flashinfer": fi})
    changed = [f for tp in p.targets for f in tp.changed]
    assert changed and all(f.step_texts() and f.tree is None and not f.steps for f in changed)
    assert runner._parsed.cache_info().currsize == 0
    assert not trees() - held
