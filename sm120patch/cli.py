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
from sm120patch.cmdline import profiles, survey, tree, trial

# During an apply, revert or recover the engine defers SIGINT/SIGTERM/SIGHUP and ends as
# Interrupted (exit 130) or Unfinished (exit 75); each signal is acknowledged at once.
app.on_interrupt(render.interrupt_notice)


def run() -> None:
    """The console entry point (and `python -m sm120patch`): `render.run_tool`."""
    render.run_tool(main, _interrupted_at_start)


@click.group(cls=render.Group, context_settings={"help_option_names": ["-h", "--help"]})
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


# In the order they were written; `--help` lists them in the order of the work (render.HELP).
for command in (
    profiles.list_cmd,
    profiles.show_cmd,
    tree.apply_cmd,
    tree.ensure_cmd,
    tree.revert_cmd,
    tree.status_cmd,
    tree.recover_cmd,
    trial.trial_group,
    survey.doctor_cmd,
    tree.pin_cmd,
    tree.export_cmd,
    profiles.new_patch_cmd,
    survey.matrix_cmd,
    survey.scan_cmd,
    survey.explain_cmd,
):
    main.add_command(command)

render.describe(main)  # --help: the order of the work, a summary that fits, an example each
