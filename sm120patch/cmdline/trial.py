"""`trial`: run a server under a profile and keep the patch only if it helps (`trial run`, the
default), and the trials recorded (`trial show`, `trial forget`): their options, the verbs they
call (`sm120patch/commands/trial.py`) and what each prints of its result."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from sm120patch import app
from sm120patch.cmdline.options import complete_profile, json_option, session, with_targets
from sm120patch.commands import trial as verbs
from sm120patch.render import Text, echo_err, echo_out, emit_json, paste, show

if TYPE_CHECKING:
    from sm120patch.commands.trial import Shown, Trialled
    from sm120patch.engine.trialrecord import TrialRecord

# ---- what each prints --------------------------------------------------------------------


def trial_line(t: TrialRecord) -> str:
    """One line of a recorded trial, for `status` and `trial show`."""
    from sm120patch.trial import report

    return report.trial_line(t)


def trial_lines(trials: list[TrialRecord], shown: int = 3) -> list[str]:
    """The last few trials of a target, and how many more there are."""
    lines = [trial_line(t) for t in trials[-shown:]]
    if len(trials) > shown:
        lines.append(
            f"... and {len(trials) - shown} earlier trial(s): `sm120patch trial show ID`, "
            "`sm120patch trial forget ID` (or --all)"
        )
    return lines


def measured_lines(trial: TrialRecord) -> list[str]:
    """A measured trial in words (trial.report): each run's figures, window and power, the
    paired gains, the wiring evidence and the quality checks, then the verdict."""
    from sm120patch.trial import report

    return report.measured_lines(trial)


def power_lines(samples: list[dict[str, Any]]) -> list[str]:
    """A plain trial's `--sample-power`: mean and max draw per GPU against its limit."""
    from sm120patch.trial import report

    return report.power_lines(samples)


def record_written(found: Trialled, path: str) -> Text:
    """What `trial --measure --export FILE` says of the export."""
    if found.record_written:
        return Text(err=[f"wrote {path}: one known.toml record"])
    verdict = found.measured.verdict if found.measured else "?"
    return Text(err=[f"sm120patch: nothing exported: {verdict} is not evidence"])


def forgotten(ids: list[str]) -> Text:
    return Text(out=[f"forgot {len(ids)} trial(s)" + (f": {', '.join(ids)}" if ids else "")])


def trialled(found: Trialled, profile: str) -> Text:
    text = Text()
    if found.measured is not None:
        text.out += measured_lines(found.measured.record())
        return text
    result = found.result
    assert result is not None
    text.out.append(
        f"trial of {profile}: {result.verdict}"
        + (f" in {result.time_to_ready_s:.1f}s" if result.time_to_ready_s else "")
        + f"; the profile stays applied (`sm120patch revert {profile}` to undo)"
    )
    text.out += power_lines(result.power_samples)
    return text


def shown(found: Shown) -> Text:
    t = found.trial
    text = Text(out=measured_lines(t) if t.is_measured else [trial_line(t)])
    if found.record_path:
        text.err.append(f"wrote {found.record_path}: one known.toml record")
    if found.html_path:
        text.out.append(f"report: {found.html_path}")
    return text


# ---- the commands ------------------------------------------------------------------------


class _TrialGroup(click.Group):
    """`trial PROFILE ...` runs a trial (the `run` subcommand by default); `trial show|forget`
    shows or removes recorded ones. No profile is called `show`, `run` or `forget`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        # `trial <TAB>`: a profile (the default subcommand's argument) or `show`.
        return [*complete_profile(ctx, self, incomplete), *super().shell_complete(ctx, incomplete)]


@click.group("trial", cls=_TrialGroup)
def trial_group() -> None:
    """Apply a profile, run a server under it, judge it, keep or revert: `trial PROFILE -- CMD`
    (see `trial run --help`); `trial show [ID]` for recorded trials, `trial forget ID` (or
    --all) to remove them."""


# The options of `trial --measure` only, in the names of trial.measured.Options.
MEASURE_OPTIONS = (
    "api",
    "requests",
    "concurrency",
    "max_tokens",
    "warmup",
    "repeat",
    "max_repeat",
    "min_gain",
    "figure",
    "min_similarity",
    "min_agreement",
    "eval_cmd",
    "eval_key",
    "eval_tolerance",
    "model",
    "bench_cmd",
)


@trial_group.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("profile", shell_complete=complete_profile)
@with_targets
@click.option("--ready-url", metavar="URL", help="Ready when this URL answers 2xx.")
@click.option("--ready-pattern", metavar="REGEX", help="Ready when an output line matches.")
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for readiness (or for the command to finish).",
)
@click.option("--leave-running", is_flag=True, help="Keep the command running once ready.")
@click.option("--sample-power", is_flag=True, help="Sample GPU power draw through NVML.")
@click.option("--log", "log_path", type=click.Path(dir_okay=False), help="Append output here.")
@click.option("--force", is_flag=True, help="Apply outside the profile's pinned versions.")
@click.option("--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition.")
@click.option("--measure", is_flag=True, help="Judge by measurement: baseline against patched.")
@click.option("--api", "api", metavar="URL", help="Server base URL (default: from --ready-url).")
@click.option("--requests", type=int, default=64, show_default=True, help="Measured requests.")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests in flight.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Tokens per request.")
@click.option("--warmup", type=int, default=None, help="Uncounted requests first [concurrency].")
@click.option(
    "--repeat",
    type=int,
    default=3,
    show_default=True,
    help="ABAB rounds: runs a side (a keep needs 2 at least).",
)
@click.option(
    "--max-repeat",
    type=int,
    default=6,
    show_default=True,
    help="Most runs a side while the figures lean but have not cleared the noise.",
)
@click.option(
    "--min-gain",
    type=float,
    default=2.0,
    show_default=True,
    help="Percent the figure must improve beyond the measured noise to keep the patch.",
)
@click.option(
    "--figure",
    default="output_tok_s",
    show_default=True,
    help="output_tok_s, req_s, ttft_p50_ms, ttft_p99_ms, itl_p50_ms or itl_p99_ms.",
)
@click.option(
    "--min-similarity",
    type=float,
    default=0.5,
    show_default=True,
    help="Least word similarity of the patched greedy answers to the baseline's.",
)
@click.option(
    "--min-agreement",
    type=float,
    default=0.9,
    show_default=True,
    help="Least top-1 token agreement with the baseline (where logprobs are served).",
)
@click.option(
    "--eval-cmd",
    default=None,
    metavar="CMDLINE",
    help="A quality command run on both sides ({api}, {model}, {output}); JSON score.",
)
@click.option("--eval-key", default="score", show_default=True, help="Dotted key of its score.")
@click.option(
    "--eval-tolerance",
    type=float,
    default=0.01,
    show_default=True,
    help="How far the patched score may fall below the baseline's.",
)
@click.option("--model", default=None, help="Model name for the API (default: /v1/models).")
@click.option(
    "--bench-cmd",
    default=None,
    metavar="CMDLINE",
    help="Measure with this benchmark instead (JSON result at {output}).",
)
@click.option(
    "--export",
    "record_path",
    type=click.Path(dir_okay=False),
    help="Write this trial as a known.toml record (when it is evidence).",
)
@json_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def trial_cmd(
    profile: str,
    targets: app.Named,
    measure: bool,
    no_gpu_check: bool,
    as_json: bool,
    command: tuple[str, ...],
    **options: Any,
) -> None:
    """Apply PROFILE, run COMMAND (after --), keep the patch if it gets ready, else revert.

    With --measure: baseline and patched under the same load, ABAB, kept only when the figure
    improves by --min-gain beyond the measured noise, the answers are sane and the patched path
    ran. Exit 0 kept, 3 crashed, 5 inconclusive, slower or inert, 6 wrong output, 8 no API.
    """
    from sm120patch.errors import TrialCrashed

    measured = {k: options.pop(k) for k in MEASURE_OPTIONS}
    request = verbs.TrialRequest(profile, command, gpu_check=not no_gpu_check, **options)
    measure_options = verbs.measure_options(request, **measured) if measure else None
    try:
        found = verbs.trial(
            session(targets),
            request,
            measure_options,
            on_known=echo_err if as_json else echo_out,
            on_line=echo_err if (measure or as_json) else echo_out,
            on_event=lambda line: echo_err(f"sm120patch: {line}"),
            on_progress=echo_err if sys.stderr.isatty() else None,
        )
    except TrialCrashed as exc:
        if as_json and exc.record is not None:
            emit_json(
                {
                    **exc.record,
                    "error": paste(exc.message),
                    "next": paste(exc.hint),
                    "exit_code": 3,
                }
            )
            sys.exit(exc.exit_code)
        raise
    if request.record_path:
        show(record_written(found, request.record_path))
    if as_json:
        doc = (found.measured or found.result).record().to_json()  # type: ignore[union-attr]  # one of the two is set
        emit_json(doc)
    else:
        show(trialled(found, profile))
    if found.measured is not None and found.measured.exit_code:
        sys.exit(found.measured.exit_code)


@trial_group.command("show")
@click.argument("trial_id", required=False)
@with_targets
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write a report.")
@click.option(
    "--export",
    "record_path",
    type=click.Path(dir_okay=False),
    help="Write the trial as a known.toml record.",
)
@json_option
def trial_show_cmd(
    trial_id: str | None,
    targets: app.Named,
    html_path: str | None,
    record_path: str | None,
    as_json: bool,
) -> None:
    """Show a recorded trial (the latest, or ID or a prefix of it); --html draws a report."""
    found = verbs.trial_show(session(targets), trial_id, html_path, record_path)
    if as_json:
        if record_path:
            echo_err(f"wrote {record_path}: one known.toml record")
        emit_json(found.trial.to_json())
        return
    show(shown(found))


@trial_group.command("forget")
@click.argument("trial_ids", nargs=-1, metavar="[ID]...")
@click.option("--all", "everything", is_flag=True, help="Forget every recorded trial.")
@with_targets
@json_option
def trial_forget_cmd(
    trial_ids: tuple[str, ...],
    everything: bool,
    targets: app.Named,
    as_json: bool,
) -> None:
    """Remove recorded trials (IDs or unique prefixes of them, or --all) from every target."""
    gone = verbs.trial_forget(session(targets), trial_ids, everything=everything)
    if as_json:
        emit_json({"forgotten": gone})
        return
    show(forgotten(gone))
