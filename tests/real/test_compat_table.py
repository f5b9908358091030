"""benchmarks/compat_table.py renders the session's outcomes: a row per release, no refusal."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from realcache import RealReleases, SiteCase, release_set

from sm120patch import releases

pytestmark = pytest.mark.real

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compat_table.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compat_table", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_of_the_session(real: RealReleases) -> None:
    table = load_script()
    results = {
        kind: {
            v: {pid: real.site(SiteCase(pid, kind, v)).outcome.status for pid in table.chain(kind)}
            for v in release_set(kind)
        }
        for kind in releases.KINDS
    }
    text = table.render(results)
    rows = [line for line in text.splitlines() if line.startswith("| 0.")]
    assert len(rows) == sum(len(release_set(k)) for k in releases.KINDS)
    # A profile never refuses a release inside its pins (outside them it may: "would refuse").
    refusing = [line for line in rows if "**refuses**" in line]
    assert not refusing, "\n".join(refusing)
