from __future__ import annotations

import textwrap

import pytest

from sm120patch.transform import FileResult, Patch, transform_text


def run(patch: Patch, source: str, file: str = "fixture.py") -> FileResult:
    """Run one patch on a dedented fixture source, as the planner does (one parse)."""
    return transform_text([patch], file, textwrap.dedent(source))


@pytest.fixture
def run_patch():
    return run


@pytest.fixture(autouse=True)
def isolated_state(tmp_path_factory, monkeypatch):
    """Installed targets keep state in the user's state dir: never the real one in tests."""
    monkeypatch.setenv("SM120PATCH_STATE_DIR", str(tmp_path_factory.mktemp("state")))
