from __future__ import annotations

import signal
import textwrap

import pytest

from sm120patch.engine import interrupts
from sm120patch.patchkit.model import Patch
from sm120patch.patchkit.runner import FileResult, transform_text


def pytest_configure(config):
    # The kill, signal and trace hooks of the in-process runs (children: tests/killing.py).
    interrupts.TEST_HOOKS = True
    """Signals as a terminal gives them, whoever started the run. A shell's background job
    (`pytest &`, `nohup`) starts with SIGINT or SIGHUP ignored, every child inherits that,
    and sm120patch rightly leaves an ignored signal ignored: the signal tests would then
    test nothing. Handled signals are reset to their default at each child's exec."""
    for signum, handler in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGHUP, signal.SIG_DFL),
        (signal.SIGTERM, signal.SIG_DFL),
    ):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, handler)


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
