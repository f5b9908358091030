"""`sm120patch explain` without real releases: the probe as a script, the overlay, the
cannot-import exit, and the pristine/patched sides of a fixture target. The decisions of real
upstream code are tested in tests/behaviour."""

from __future__ import annotations

import ast
import os
import stat
import sys
from pathlib import Path

import pytest
from test_bad_input import assert_one_clear_line, invoke
from trees import make_tree

from sm120patch.engine import apply
from sm120patch.errors import UsageError
from sm120patch.explain import explain
from sm120patch.targets import finding


def test_probe_imports_nothing_of_sm120patch_nor_upstream_at_top() -> None:
    """Run by path in another interpreter: stdlib only at module level."""
    tree = ast.parse(explain.PROBE.read_text(encoding="utf-8"))
    top = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not top & {"sm120patch", "torch", "sglang", "flashinfer", "vllm"}, top
    assert all(name in sys.stdlib_module_names or name == "__future__" for name in top), top


def test_module_names() -> None:
    assert explain.module_name("sglang/srt/server_args.py") == "sglang.srt.server_args"
    assert explain.module_name("flashinfer/jit/__init__.py") == "flashinfer.jit"


def python_without_site(tmp_path: Path) -> Path:
    """An interpreter that cannot import torch (no site-packages), whatever is installed."""
    script = tmp_path / "python-no-site"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.skipif(os.name == "nt", reason="a /bin/sh wrapper stands for the interpreter")
def test_cannot_import_is_one_line_and_exit_7(tmp_path: Path) -> None:
    root = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    result = invoke(["explain", "--sglang", str(root), "--python",
                     str(python_without_site(tmp_path)), "--simulate", "sm120"])
    assert_one_clear_line(result, 7, "cannot import torch")
    assert "cannot import torch" in result.stderr


def test_unknown_interpreter_is_a_usage_error(tmp_path: Path) -> None:
    root = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    result = invoke(["explain", "--sglang", str(root), "--python", str(tmp_path / "nope")])
    assert_one_clear_line(result, 2, "no interpreter")


def test_sides_of_a_pristine_target_come_from_the_planner(tmp_path: Path) -> None:
    root = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    target = finding.find("sglang", root)
    sides = explain.sides(target, tmp_path / "overlay")
    assert not sides.applied and sides.pristine == {}
    planned = explain.patched_texts(target)
    assert planned, "the fixture tree has sites the planner patches"
    for file, text in planned.items():
        module = explain.module_name(file)
        assert Path(sides.patched[module]).read_text(encoding="utf-8") == text
        assert (root / file).read_text(encoding="utf-8") != text  # the user's file untouched


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_sides_of_an_applied_target_come_from_the_pristine_text(tmp_path: Path,
                                                                layout: str) -> None:
    root = make_tree(tmp_path, "sglang", "0.5.8", layout)
    target = finding.find("sglang", root)
    before = {f: target.path_of(f).read_bytes() for f in explain.patched_texts(target)}
    # preconditions=None: no GPU check, as `--no-gpu-check` does.
    report = apply.apply("moe", {"sglang": str(root), "flashinfer": None}, force=True,
                          preconditions=None)
    assert report.action == "applied"
    target = finding.find("sglang", root)
    sides = explain.sides(target, tmp_path / "overlay")
    assert sides.applied and sides.patched == {}
    moved = {f for f in before if target.path_of(f).read_bytes() != before[f]}
    assert moved
    for file in moved:
        overlay_file = Path(sides.pristine[explain.module_name(file)])
        assert overlay_file.read_bytes() == before[file]



@pytest.mark.parametrize(
    ("preflight", "row"),
    [
        (None, "not checked"),
        ({"error": "not in this release"}, "not in this release"),
        ({"driver": "simulated", "multicast": False, "proceeds": False,
          "log": ["FlashInfer workspace preflight probe failed (x). Skipping allreduce fusion."]},
         "skips allreduce fusion (simulated driver, no multicast): FlashInfer workspace "
         "preflight probe failed (x). Skipping allreduce fusion."),
        ({"driver": "simulated", "multicast": False, "proceeds": True, "sizes": [2097152]},
         "creates the workspace (simulated driver, no multicast)"),
        ({"driver": "real", "proceeds": False, "error": "RuntimeError: cuMulticast failed"},
         "skips allreduce fusion: RuntimeError: cuMulticast failed"),
        ({"driver": "real", "proceeds": True, "sizes": [2097152]}, "creates the workspace"),
    ],
)
def test_the_preflight_row_says_whether_fusion_goes_on(preflight, row) -> None:
    result = {} if preflight is None else {"preflight": preflight}
    assert explain.decision(result, None).preflight == row


# ---- the readers: declared by each patch, run by the probe from their text ------------------


def probe_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("sm120patch_probe_under_test", explain.PROBE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_reader_of_the_library_runs_from_its_text_alone() -> None:
    """What the probe gets: each reader compiles alone into a namespace of builtins, names
    the function it was sent under, and reads no name of its module."""
    probe = probe_module()
    sent = explain.reader_requests(("sglang", "flashinfer"))
    assert {r["name"] for r in sent} >= {"gate", "resolve_backend", "preflight", "fp4_gemm",
                                         "moe_runner", "comm_arch"}
    for reader in sent:
        assert callable(probe.load_reader(reader)), reader["patch"]
    for _, declared in explain.declared():
        assert declared.problems() == [], declared.name


SEP = "/"


def reads_its_module(site: object) -> dict[str, str]:
    return {"sep": SEP}


def test_a_reader_that_reads_its_module_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader using a module constant would fail only in the target's interpreter: explain
    refuses the patch first, naming it and the name."""
    from dataclasses import replace

    from sm120patch.patchkit import readers
    from sm120patch.plan import catalog

    assert readers.standalone_problems("def r(site):\n    return {'m': MODULE}\n", "r") == [
        "r reads MODULE from outside itself; import or define it inside the function (the "
        "probe runs its text alone)"]
    assert readers.standalone_problems(
        "def r(site: Site) -> Reading:\n    import os\n    x: Any = os.sep\n"
        "    return {'x': x, 'n': len(site.modules)}\n", "r") == []
    cat = catalog.load()
    gate = cat.patches["sglang.fusion-gate"]
    assert gate.explain is not None
    broken = replace(gate, explain=replace(gate.explain, read=reads_its_module))
    monkeypatch.setattr(catalog, "load",
                        lambda: replace(cat, patches={**cat.patches, gate.id: broken}))
    with pytest.raises(UsageError, match=r"patch sglang.fusion-gate \(.*\): explain: "
                                         r"reads_its_module reads SEP"):
        explain.declared()


def test_a_reader_name_is_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from sm120patch.plan import catalog

    cat = catalog.load()
    gate, backend = cat.patches["sglang.fusion-gate"], cat.patches["sglang.fusion-backend"]
    assert gate.explain is not None and backend.explain is not None
    twice = replace(backend, explain=replace(backend.explain, name="gate"))
    monkeypatch.setattr(catalog, "load",
                        lambda: replace(cat, patches={**cat.patches, backend.id: twice}))
    with pytest.raises(UsageError, match="explain: the name 'gate' is also sglang.fusion-"):
        explain.declared()
    own = replace(backend, explain=replace(backend.explain, name="launches"))
    monkeypatch.setattr(catalog, "load",
                        lambda: replace(cat, patches={**cat.patches, backend.id: own}))
    with pytest.raises(UsageError, match="the name 'launches' is the probe's own"):
        explain.declared()


def test_the_probe_answers_a_reader_that_raises_with_its_error_and_where() -> None:
    probe = probe_module()
    source = "def read(site):\n    return {'n': len(site.modules), 'x': 1 // 0}\n"
    readers = [
        {"patch": "p.one", "target": "sglang", "name": "one", "function": "read",
         "source": source, "modules": ["m"], "functions": []},
        {"patch": "p.two", "target": "sglang", "name": "two", "function": "read",
         "source": "def read(site):\n    return {'gpu': site.simulate, 'mc': site.multicast}\n",
         "modules": [], "functions": []},
        {"patch": "p.three", "target": "flashinfer", "name": "three", "function": "read",
         "source": source, "modules": [], "functions": []},
    ]
    out = probe.run_readers(readers, "sglang", "sm120", False)
    assert set(out) == {"one", "two"}  # the other target's reader waits for its target
    assert out["one"]["error"] == "ZeroDivisionError: integer division or modulo by zero"
    assert out["one"]["where"] and "line 2" in out["one"]["where"][-1]
    assert out["two"] == {"gpu": "sm120", "mc": False}


def test_patch_modules_import_upstream_only_inside_their_readers() -> None:
    """Runtime code never imports torch, SGLang or FlashInfer; a patch's explain reader does,
    and only the probe runs it."""
    from sm120patch.plan import catalog

    library = Path(explain.__file__).resolve().parents[2] / "patches"
    readers = {p.explain.read.__name__ for p in catalog.load().patches.values() if p.explain}
    for path in library.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef)
                  and f.name in readers for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in inside:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""]
                assert not {n.split(".")[0] for n in names} & {"torch", "sglang", "flashinfer", "vllm"}, (
                    path.name, ast.unparse(node))
