"""A new patch is one file plus its test: `new-patch` writes both into a copy of the library,
the test it wrote passes as written, and the catalog loads the patch with every declaration
(facts, wiring, the explain reader) that the rest of the tool derives from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sm120patch.cli import main
from sm120patch.explain import explain
from sm120patch.plan import catalog

LIBRARY = Path(__file__).resolve().parents[1] / "patches"
PYPROJECT = LIBRARY.parent / "pyproject.toml"
KEYWORD_SITE = ["flashinfer.moe-arch", "--target", "flashinfer", "--file",
                "flashinfer/jit/fused_moe.py", "--function", "gen_fused_moe_sm100_module",
                "--pins", ">=0.6.1,<0.6.16", "--keyword", "supported_major_versions",
                "--expect", "9,10", "--add", "12"]
SKELETON = ["sglang.new-site", "--target", "sglang", "--file", "sglang/srt/x.py",
            "--function", "choose", "--pins", ">=0.5.8"]
VLLM_SKELETON = ["vllm.new-site", "--target", "vllm", "--file", "vllm/config/vllm.py",
                 "--function", "enable_allreduce_rms_fusion", "--pins", ">=0.30.0,<0.35"]


def copy_of_the_library(tmp_path: Path) -> Path:
    copy = tmp_path / "library"
    shutil.copytree(LIBRARY, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def new_patch(directory: Path, args: list[str]) -> None:
    result = CliRunner().invoke(main, ["new-patch", *args, "--dir", str(directory)])
    assert result.exit_code == 0, result.output
    # the module, its test, the profiles, and the registry's row where the directory has one
    rows = 1 if (directory / "registry.toml").is_file() else 0
    assert result.output.count("wrote ") == 3 + rows


def run_pytest(test: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(test)], capture_output=True, text=True, cwd=test.parent,
                          check=False)


@pytest.mark.parametrize(("args", "module"), [(KEYWORD_SITE, "flashinfer_moe_arch"),
                                              (SKELETON, "sglang_new_site"),
                                              (VLLM_SKELETON, "vllm_new_site")])
def test_a_new_patch_is_one_file_plus_its_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               args: list[str], module: str) -> None:
    library = copy_of_the_library(tmp_path)
    before = {p.name for p in library.iterdir()}
    new_patch(library, args)
    assert {p.name for p in library.iterdir()} - before == {f"{module}.py", f"test_{module}.py"}

    ran = run_pytest(library / f"test_{module}.py")
    assert ran.returncode == 0 and "5 passed" in ran.stdout, ran.stdout + ran.stderr

    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(PYPROJECT),
                           "--no-cache", str(library / f"{module}.py"),
                           str(library / f"test_{module}.py")],
                          capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr

    cat = catalog._combine([catalog._load_dir(str(library))])
    patch_id = args[0]
    patch = cat.patches[patch_id]
    assert set(cat.patches) == {*catalog.load().patches, patch_id}  # the library, and it
    assert list(cat.profile(patch_id.split(".")[-1]).patches) == [patch_id]
    assert patch.facts[0].releases == args[args.index("--pins") + 1]
    assert patch.explain is not None and patch.explain.problems() == []
    # explain runs its reader and shows its row, from the declaration alone.
    monkeypatch.setattr(catalog, "load", lambda: cat)
    sent = explain.reader_requests([patch.target])
    [mine] = [r for r in sent if r["patch"] == patch_id]
    assert mine["name"] == module and mine["functions"] == [args[args.index("--function") + 1]]
    assert (module, args[args.index("--function") + 1]) in explain.labels()


def test_the_generated_test_fails_when_the_patch_does_something_else(tmp_path: Path) -> None:
    """The test new-patch writes is a real test: a transform that adds another element fails
    it."""
    library = copy_of_the_library(tmp_path)
    new_patch(library, KEYWORD_SITE)
    module = library / "flashinfer_moe_arch.py"
    module.write_text(module.read_text().replace("ADD = 12", "ADD = 11"))
    ran = run_pytest(library / "test_flashinfer_moe_arch.py")
    assert ran.returncode == 1, ran.stdout
    assert "FAILED test_flashinfer_moe_arch.py::test_the_site_as_released" in ran.stdout


def test_the_templates_are_read_as_package_data() -> None:
    """new-patch reads its templates through importlib.resources (the wheel ships them:
    tests/test_packaging.py)."""
    from sm120patch.patchkit import newpatch

    for name in ("patch.py.tmpl", "test_patch.py.tmpl", "transform-keyword.py.tmpl",
                 "transform-todo.py.tmpl"):
        assert "${" in newpatch.template(name).template or name.startswith("transform")


@pytest.mark.parametrize("option, value", [
    ("--file", 'sglang/srt/x.py"\nimport os; os.system("id")\n"'),
    ("--file", "sglang/srt/x.py'"),
    ("--file", "../x.py"),
    ("--file", "flashinfer/x.py"),
    ("--keyword", 'k"]; import os; x = ["'),
    ("--profile", 'p]\n[profiles.evil'),
    ("--function", "f():\n    pass\nimport os\ndef g"),
])  # fmt: skip
def test_new_patch_refuses_a_name_that_is_not_one(tmp_path, option, value):
    """A name new-patch writes into code (a package-relative .py path, identifiers, a profile
    name) that is not one is a usage error, and nothing is written."""
    args = [*SKELETON, "--keyword", "supported", "--expect", "10", "--add", "12"]
    at = args.index(option) + 1 if option in args else None
    if at is None:
        args += [option, value]
    else:
        args[at] = value
    result = CliRunner().invoke(main, ["new-patch", *args, "--dir", str(tmp_path / "pack")])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "pack").exists() or not any((tmp_path / "pack").iterdir())


def test_new_patch_renders_every_value_escaped(tmp_path):
    """PEP 440's arbitrary equality (`===`) takes any text without spaces, quotes too: the
    pins land in the module and in profiles.toml as the very string given, never as code."""
    import ast

    import tomllib

    pins = '===1"+injected+"'  # packaging takes it; unescaped, `injected` is code
    args = [*SKELETON]
    args[args.index("--pins") + 1] = pins
    new_patch(tmp_path, args)
    tree = ast.parse((tmp_path / "sglang_new_site.py").read_text())
    releases = [k.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                for k in node.keywords if k.arg == "releases"]  # fmt: skip
    assert [r.value for r in releases if isinstance(r, ast.Constant)] == [pins]
    assert not any(isinstance(n, ast.Name) and n.id == "injected" for n in ast.walk(tree))
    doc = tomllib.loads((tmp_path / "profiles.toml").read_text())
    assert doc["profiles"]["new-site"]["pins"] == {"sglang": pins}
