"""The console entry point (`sm120patch.cli:run`, `python -m sm120patch`): what it prints and
the status it exits with are `main`'s."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from sm120patch import cli


def process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sm120patch", *args], capture_output=True,
                          text=True)  # fmt: skip


@pytest.mark.parametrize("args", [["list"], ["show", "all"], ["show", "no-such-profile"],
                                  ["apply", "--no-such-option"]])  # fmt: skip
def test_output_and_status_are_mains(args):
    inside = CliRunner().invoke(cli.main, args, prog_name="python -m sm120patch")
    outside = process(*args)
    assert outside.returncode == inside.exit_code
    assert outside.stdout == inside.stdout
    assert outside.stderr == inside.stderr


def test_a_large_output_through_a_pipe_arrives_whole(tmp_path):
    """Nothing is lost in a buffer on the way out."""
    inside = CliRunner().invoke(cli.main, ["list", "--json"])
    outside = process("list", "--json")
    assert outside.returncode == 0 and len(outside.stdout) > 1000
    assert outside.stdout == inside.stdout


@pytest.mark.parametrize(("raised", "status"), [(None, 0), (3, 3), ("a message", 1)])
def test_run_exits_with_what_sys_exit_would(mocker, capsys, raised, status):
    mocker.patch.object(cli, "main", side_effect=SystemExit(raised))
    with pytest.raises(SystemExit) as exited:
        cli.run()
    assert exited.value.code == status
    if isinstance(raised, str):
        assert capsys.readouterr().err == "a message\n"
