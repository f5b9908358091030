"""The command line: click only. The group every command runs in (`main`, with --patches), the
console entry point (`run`), and the commands of each family, which `sm120patch/cmdline/` holds:
each parses its options, calls one function of the command layer (`sm120patch/commands/`, over
an `app.Session`) and prints what its family makes of the result (through render.py).

Exit codes (README): 0 success, 1 refused or precondition failed (nothing changed), 2 usage,
3 a trial crashed and was reverted, 4 internal error; `trial --measure` also 5 (reverted:
inconclusive, slower or inert), 6 (reverted: wrong output) and 8 (nothing answered at the
API); 75 a run left its journal (`recover`), 130 interrupted.
"""

from __future__ import annotations

import click

from sm120patch import __version__, _interrupted_at_start, app, render

# During an apply, revert or recover the engine defers SIGINT/SIGTERM/SIGHUP and ends as
# Interrupted (exit 130) or Unfinished (exit 75); each signal is acknowledged at once.
app.on_interrupt(render.interrupt_notice)


def run() -> None:
    """The console entry point (and `python -m sm120patch`): `render.run_tool`."""
    render.run_tool(main, _interrupted_at_start)


# Each command by name -> (its family's module in sm120patch/cmdline/, its attribute), in the
# order they were written; `--help` lists them in the order of the work (render.HELP). A
# family's module is imported only when one of its commands runs (or --help lists them all):
# `ensure` at every service start imports the tree family alone.
COMMANDS = {
    "list": ("profiles", "list_cmd"),
    "show": ("profiles", "show_cmd"),
    "apply": ("tree", "apply_cmd"),
    "ensure": ("tree", "ensure_cmd"),
    "revert": ("tree", "revert_cmd"),
    "status": ("tree", "status_cmd"),
    "recover": ("tree", "recover_cmd"),
    "trial": ("trial", "trial_group"),
    "doctor": ("survey", "doctor_cmd"),
    "pin": ("tree", "pin_cmd"),
    "export": ("tree", "export_cmd"),
    "new-patch": ("profiles", "new_patch_cmd"),
    "matrix": ("survey", "matrix_cmd"),
    "scan": ("survey", "scan_cmd"),
    "explain": ("survey", "explain_cmd"),
}


class Commands(render.Group):
    """The group with its commands loaded by name from COMMANDS (click's lazy subcommands)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        first = [n for n in self.order if n in COMMANDS]
        return first + [n for n in COMMANDS if n not in first]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            import importlib

            family, attribute = COMMANDS[cmd_name]
            module = importlib.import_module(f"sm120patch.cmdline.{family}")
            command: click.Command = getattr(module, attribute)
            render.describe_command(cmd_name, command)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sm120patch")
@click.option(
    "--patches",
    "pack_dirs",
    multiple=True,
    metavar="DIR",
    help="Also load the patch pack in DIR (patch modules + profiles.toml; repeatable; "
    "SM120PATCH_PATCHES adds more).",
)
@click.pass_context
def main(ctx: click.Context, pack_dirs: tuple[str, ...]) -> None:
    """Apply, review and revert the patches that enable SGLang, FlashInfer and vLLM (named
    with --vllm) fast paths on NVIDIA SM120 GPUs (RTX PRO 6000, RTX 5090)."""
    ctx.obj = render.Invocation(tuple(pack_dirs))


main.order = tuple(render.HELP)  # --help: the order of the work
