"""A non-editable install must carry the patch library: build the wheel and look inside."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_every_patch_and_the_data_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        if "setuptools" in proc.stderr and ("connection" in proc.stderr.lower()
                                            or "No matching distribution" in proc.stderr):
            pytest.skip("building the wheel needs setuptools from PyPI, which is unreachable")
        pytest.fail(proc.stderr)
    wheel = next(tmp_path.glob("sm120patch-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"sm120patch/patches/{p.name}" for p in (ROOT / "patches").iterdir()
                if p.suffix in (".py", ".toml")}
    assert expected <= names, sorted(expected - names)
    # Every module of the tool: a package missing from pyproject.toml's list would be left out.
    tool = {p.relative_to(ROOT).as_posix() for p in (ROOT / "sm120patch").rglob("*.py")}
    assert tool <= names, sorted(tool - names)
    assert "sm120patch/patches/profiles.toml" in names
    assert "sm120patch/patches/signatures.toml" in names
    # `scan`: its wing and the maintainers' table of kernel families.
    assert {"sm120patch/scan/gates.py", "sm120patch/patches/kernels.toml"} <= names
    # `new-patch`: the templates it renders a patch module and its test from.
    templates = ROOT / "sm120patch" / "patchkit" / "templates"
    assert {f"sm120patch/patchkit/templates/{p.name}" for p in templates.glob("*.tmpl")} <= names
    # Never a top-level `patches` package in site-packages.
    assert not any(n.startswith("patches/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sm120patch = sm120patch.cli:run" in zipfile.ZipFile(wheel).read(entry_points).decode()
