"""How a result reaches the terminal, for every command: `Text` (the lines a command prints,
split into standard output, what a script would capture: a diff, a table, and standard error,
what is said about it), `show` and the echoes every line goes through, JSON documents
(`emit_json`), and errors: the click group every command runs in (`Group`) prints a typed error
as one line and what to do next (a hint that pastes: the command's own paths and packs), JSON
under --json, usage errors included. `--help`'s order, summaries and examples are `HELP`.

Each family's own text (what `apply` or `trial` prints of its result) is in
`sm120patch/cmdline/`, beside the family's commands."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from sm120patch.errors import Sm120Error
from sm120patch.terminal import colour_wanted as colour_wanted
from sm120patch.terminal import coloured as coloured
from sm120patch.terminal import error_doc as error_doc
from sm120patch.terminal import exhausted
from sm120patch.terminal import fallback_hint as fallback_hint
from sm120patch.terminal import hint_lines as hint_lines
from sm120patch.terminal import interrupt_notice as interrupt_notice
from sm120patch.terminal import json_asked as json_asked
from sm120patch.terminal import page_width as page_width
from sm120patch.terminal import pasteable as pasteable
from sm120patch.terminal import path_options as path_options
from sm120patch.terminal import printable as printable
from sm120patch.terminal import run_tool as run_tool
from sm120patch.terminal import waiting as waiting

if TYPE_CHECKING:
    from sm120patch.app import Session


@dataclass
class Text:
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    # stdout text printed as it is, without a newline added (a diff)
    raw: str = ""


# The patch-id column: the longest id in the library (vllm.allreduce-fusion-oneshot) and a space.
PATCH_WIDTH = 30

# ---- errors, as every command prints them ---------------------------------------------------


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


JSON_META = "sm120patch.json"


def remember_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    # ctx.meta is shared by every context of one invocation: the group's error rendering
    # reads it to answer in JSON when the command was asked for JSON.
    if value:
        ctx.meta[JSON_META] = True
    return value


@dataclass
class Invocation:
    """The object of one command line's root context (`ctx.obj`): the group's --patches and,
    once the command has made it, its session, whose targets and packs a hint pastes."""

    packs: tuple[str, ...] = ()
    session: Session | None = None


def invocation(ctx: click.Context) -> Invocation:
    """The command line's `Invocation` (an empty one outside the group: a bare command)."""
    root = ctx.find_root()
    if not isinstance(root.obj, Invocation):
        root.obj = Invocation()
    return root.obj


def paste(text: str) -> str:
    """`text` with each `sm120patch ...` in it completed with this command's paths (its
    session's), packs and kept flags."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return text
    root, held = ctx.find_root(), invocation(ctx)
    paths = held.session.paths if held.session is not None else {}
    argv = root.meta.get(ARGV_META, [])
    return pasteable(text, paths, held.packs, argv, path_options(root.command))


def fail(error: Sm120Error, as_json: bool, verb: str | None = None) -> None:
    """One line, then what to do (every refusal has one): `next:` lines that paste, the words
    on their own; the same as JSON with --json (`next`: the words, `commands`: what pastes)."""
    hint = paste(error.hint or fallback_hint(error.exit_code, verb))
    click.echo(printable(f"sm120patch: {paste(error.message)}"), err=True)
    lines = hint_lines(hint)
    for line in lines:
        click.echo(printable(line), err=True)
    if as_json:
        doc = error_doc(paste(error.message), hint, error.exit_code, error.details)
        doc["commands"] = [line[len("  next: ") :] for line in lines if line.startswith("  next: ")]
        emit_json(doc)
    sys.exit(error.exit_code)


ARGV_META = "sm120patch.argv"  # the command line as given, for `<again>` hints


def json_wanted(ctx: click.Context) -> bool:
    return json_asked(bool(ctx.meta.get(JSON_META)), ctx.meta.get(ARGV_META, []))


def usage_failed(ctx: click.Context, error: click.UsageError) -> None:
    """A command line click could not parse: its text on stderr and, under --json, a JSON
    document as for every other error, exit 2."""
    if not json_wanted(ctx):
        raise error
    error.show()
    verb = error.ctx.info_name if error.ctx is not None and error.ctx.parent else None
    hint = fallback_hint(error.exit_code, verb)
    emit_json(error_doc(error.format_message(), hint, error.exit_code))
    sys.exit(error.exit_code)


class Group(click.Group):
    """Renders every command's errors: a typed error is one line plus what to do (and JSON on
    stdout with --json); anything else is a bug (exit 4). Lists its commands in `order` (the
    order of the work), any others after them."""

    order: tuple[str, ...] = ()

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        first = [n for n in self.order if n in names]
        return first + [n for n in names if n not in first]

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta.setdefault(ARGV_META, list(args))
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            usage_failed(ctx, exc)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            usage_failed(ctx, exc)
            raise
        except Sm120Error as exc:
            fail(exc, json_wanted(ctx), ctx.invoked_subcommand)
        except KeyboardInterrupt:
            # Outside the engine's writes (those end as Interrupted or Unfinished, with their
            # own next step): nothing was cut short; the line says the state the last run of
            # this command left (applied, rolled back, or unfinished with its `recover`).
            from sm120patch.engine import interrupts

            error = interrupts.outside()
            if error.hint or json_wanted(ctx):
                fail(error, json_wanted(ctx), ctx.invoked_subcommand)
            click.echo(printable(f"sm120patch: {error.message}"), err=True)  # nothing to do
            sys.exit(error.exit_code)
        except BrokenPipeError:
            # `sm120patch status | head -1`: the reader left, having read what it wanted. As
            # git does, end quietly and successfully; stdout points at /dev/null so that the
            # last flush does not fail a second time.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(0)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except Exception as exc:
            if os.environ.get("SM120PATCH_DEBUG"):
                raise
            if isinstance(exc, (RecursionError, MemoryError)):  # an input built to exhaust Python
                fail(exhausted(exc), json_wanted(ctx), ctx.invoked_subcommand)
            line = f"sm120patch: internal error: {type(exc).__name__}: {exc}"
            click.echo(printable(line), err=True)
            hint = paste(
                "rerun with SM120PATCH_DEBUG=1 for the traceback and report it; "
                "`sm120patch status` shows the state of your trees"
            )
            for line in hint_lines(hint):
                click.echo(printable(line), err=True)
            sys.exit(4)


# In the order of the work, which is the order `sm120patch --help` lists them in
# (`Group.list_commands`).
HELP = {
    "doctor": ("What this box has and what each profile would do", "sm120patch doctor"),
    "apply": (
        "Apply a profile (--dry-run: the diff, nothing written)",
        "sm120patch apply moe --dry-run",
    ),
    "status": (
        "Each target's state, from the bytes on disk (--check)",
        "sm120patch status --check",
    ),
    "ensure": (
        "At service start: exactly as wanted, or exit 1",
        "sm120patch ensure --locked /etc/sm120patch.lock",
    ),
    "revert": ("Put every touched file back, byte for byte", "sm120patch revert moe"),
    "recover": ("Finish an interrupted apply or revert", "sm120patch recover"),
    "pin": (
        "Write a lock file of the profile as applied here",
        "sm120patch pin moe -o /etc/sm120patch.lock",
    ),
    "trial": (
        "Run a server under a profile; keep it only if it helps",
        "sm120patch trial moe --measure -- python -m sglang.launch_server ...",
    ),
    "explain": (
        "What SGLang or vLLM decides, pristine against patched",
        "sm120patch explain --simulate sm120 -- --model-path M --tp 4",
    ),
    "list": ("The profiles, their pins and patches", "sm120patch list"),
    "show": ("One profile in full, its known outcomes included", "sm120patch show moe --json"),
    "export": ("Write the patches as mail files (git am)", "sm120patch export moe -o patches/"),
    "scan": ("The arch gates that leave SM120 out", "sm120patch scan --json"),
    "matrix": (
        "Plan every profile on every release (maintainers)",
        "sm120patch matrix --sglang '>=0.5.23'",
    ),
    "new-patch": (
        "Start a patch in a pack of your own",
        "sm120patch new-patch my.site --target sglang --file F --function FN --pins P",
    ),
}


def describe_command(name: str, command: click.Command) -> None:
    """--help of one command: its summary and example (`HELP`)."""
    if name in HELP:
        summary, example = HELP[name]
        command.short_help = summary
        command.epilog = f"\b\nExample: {example}"  # \b: click keeps the line as it is


def show(text: Text) -> None:
    for line in text.err:
        echo_err(paste(line))
    for line in text.out:
        echo_out(paste(line))
    if text.raw:
        colour = colour_wanted()
        click.echo(coloured(text.raw) if colour else text.raw, nl=False, color=colour)


# Every line of text the CLI prints goes through these two: what it shows from outside (a trial
# record, a server's log line, a path) cannot drive the terminal (`printable`).
def echo_err(line: str) -> None:
    click.echo(printable(line), err=True)


def echo_out(line: str) -> None:
    click.echo(printable(line))


def quiet(line: str) -> None:  # --json keeps stdout one document
    pass


def pasted(echo: Callable[[str], None]) -> Callable[[str], None]:
    """`echo` of lines whose `sm120patch ...` commands paste (render.paste)."""
    return lambda line: echo(paste(line))
