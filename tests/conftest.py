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


@pytest.fixture(autouse=True)
def _no_serving_engine_beside_the_tests(monkeypatch):
    """The suite does not depend on what else is installed beside it: the README's quick start
    installs SGLang and FlashInfer into the venv the tests then run in, where a command given
    no --sglang/--flashinfer would find them. An SGLang or FlashInfer in the test interpreter's
    own site-packages is not found by default (`finding.find(kind, None)`); a test that wants
    one puts its own tree on sys.path, which is still found."""
    import importlib.util
    import sysconfig
    from pathlib import Path

    real = importlib.util.find_spec
    own = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}

    def find_spec(name, package=None):
        spec = real(name, package)
        if name in ("sglang", "flashinfer") and spec is not None:
            places = list(spec.submodule_search_locations or [])
            if any(Path(p).resolve().parent in own for p in places):
                return None
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
