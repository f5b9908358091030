"""The targets of a command as one mapping: every command on targets takes one `--KIND PATH`
and one `--KIND-version` per kind of the kinds table, and what they name reaches the command's
session as `paths` and `stated`, kind by kind, never through the click context's `meta`."""

from __future__ import annotations

import click
from click.testing import CliRunner

from sm120patch import render
from sm120patch.cli import main
from sm120patch.cmdline import options
from sm120patch.commands import tree
from sm120patch.patchkit.kinds import TARGETS


def _commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        found[f"{prefix}{name}"] = command
        if isinstance(command, click.Group):
            found |= _commands(command, f"{prefix}{name} ")
    return found


def test_every_command_on_targets_takes_one_path_and_one_version_per_kind():
    wanted = [f"--{k}" for k in TARGETS] + [f"--{k}-version" for k in TARGETS]
    on_targets = {}
    for name, command in _commands(main).items():
        opts = [o for p in command.params for o in p.opts if o.startswith("--")]
        if "--sglang-version" in opts:
            on_targets[name] = [o for o in opts if o in wanted]
    verbs = "apply ensure revert status recover doctor pin export scan explain".split()
    assert set(on_targets) >= {*verbs, "trial run", "trial show", "trial forget"}
    assert all(found == wanted for found in on_targets.values()), on_targets


def test_the_options_reach_the_command_as_one_mapping_by_kind():
    got = {}

    @click.command()
    @options.with_targets
    @click.option("--other", default="x")
    def command(targets, other):
        got.update(paths=dict(targets.paths), stated=dict(targets.stated), other=other)

    result = CliRunner().invoke(
        command, ["--vllm", "/v", "--flashinfer-version", "0.6.8", "--other", "y"]
    )
    assert result.exit_code == 0, result.output
    assert got == {
        "paths": {str(k): ("/v" if k == "vllm" else None) for k in TARGETS},
        "stated": {"flashinfer": "0.6.8"},
        "other": "y",
    }


def test_the_session_holds_the_targets_and_the_context_carries_none(monkeypatch, tmp_path):
    seen = {}

    def status(session):
        seen["paths"], seen["stated"] = dict(session.paths), dict(session.stated)
        seen["meta"] = set(click.get_current_context().find_root().meta)
        seen["held"] = render.invocation(click.get_current_context()).session is session
        return []

    monkeypatch.setattr(tree, "status", status)
    args = ["status", "--vllm", str(tmp_path), "--sglang", "s", "--vllm-version", "0.30.0"]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert seen["paths"] == {"sglang": "s", "flashinfer": None, "vllm": str(tmp_path)}
    assert seen["stated"] == {"vllm": "0.30.0"}
    assert seen["held"]  # what a hint pastes is the session's
    assert seen["meta"] <= {render.ARGV_META, render.JSON_META}, seen["meta"]
