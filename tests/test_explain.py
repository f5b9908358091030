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

from sm120patch import targets
from sm120patch.engine import apply
from sm120patch.explain import explain


def test_probe_imports_nothing_of_sm120patch_nor_upstream_at_top() -> None:
    """Run by path in another interpreter: stdlib only at module level."""
    tree = ast.parse(explain.PROBE.read_text(encoding="utf-8"))
    top = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not top & {"sm120patch", "torch", "sglang", "flashinfer"}, top
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
    target = targets.find("sglang", root)
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
    target = targets.find("sglang", root)
    before = {f: target.path_of(f).read_bytes() for f in explain.patched_texts(target)}
    # preconditions=None: no GPU check, as `--no-gpu-check` does.
    report = apply.apply("moe", {"sglang": str(root), "flashinfer": None}, force=True,
                          preconditions=None)
    assert report.action == "applied"
    target = targets.find("sglang", root)
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
