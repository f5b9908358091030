"""The release cache and `matrix` are maintainer tooling: the commands a production box runs
never import them; only `matrix` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fakeindex import closed_port_url, pip_env
from trees import make_tree

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# Runs CLI commands in one fresh interpreter and prints which maintainer modules got imported.
PROBE = """
import json, sys
from sm120patch.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv, standalone_mode=False)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code or 0)
names = ("sm120patch.maintain", "sm120patch.maintain.releases", "sm120patch.matrix")
print(json.dumps([codes, sorted(m for m in sys.modules if m.startswith(names))]))
"""


def imported(commands: list[list[str]], env: dict[str, str]) -> tuple[list[int], list[str]]:
    """(exit code of each command, the maintainer modules imported once they all ran)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    codes, modules = json.loads(proc.stdout.splitlines()[-1])
    return codes, modules


def test_runtime_commands_never_import_maintainer_tooling(tmp_path: Path) -> None:
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    env = pip_env(closed_port_url(), tmp_path / "cache")
    env["SM120PATCH_STATE_DIR"] = str(tmp_path / "state")
    targets = ["--sglang", str(sg), "--flashinfer", str(fi)]
    commands = [
        ["--help"],
        ["list"],
        ["status", *targets, "--json"],
        ["apply", "all", *targets, "--no-gpu-check", "--dry-run"],
        ["apply", "all", *targets, "--no-gpu-check"],
        ["status", *targets],
        ["revert", "--all", *targets],
        ["scan", *targets, "--json"],
        ["matrix", "--help"],
    ]
    codes, modules = imported(commands, env)
    assert codes == [0] * len(commands)
    assert modules == []
    # The probe sees them when they are imported: `matrix` itself (offline here, so it stops
    # at the index with exit 1, after the import).
    codes, modules = imported([["matrix", "--sglang", "==0.5.8"]], env)
    assert codes == [1] and "sm120patch.maintain.releases" in modules


def test_the_test_extra_installs_the_maintain_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "sm120patch[maintain]" in project["optional-dependencies"]["test"]
    assert "maintain" in project["optional-dependencies"]
