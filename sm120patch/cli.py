"""The command line: parse, call the library, render. Nothing else lives here.

Exit codes (README): 0 success, 1 refused or precondition failed (nothing changed), 2 usage,
3 a trial crashed and was reverted, 4 internal error; `trial --measure` also 5 (reverted: not
faster beyond the spread) and 6 (reverted: wrong output); 75 a run left its journal
(`recover`), 130 interrupted.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from sm120patch import __version__
from sm120patch.errors import Sm120Error

F = TypeVar("F", bound=Callable[..., Any])

target_options = [
    click.option(
        "--sglang",
        "sglang",
        metavar="PATH",
        default=None,
        help="SGLang checkout root, package parent or site-packages "
        "(default: the one installed in this Python).",
    ),
    click.option(
        "--flashinfer",
        "flashinfer",
        metavar="PATH",
        default=None,
        help="FlashInfer checkout root, package parent or site-packages "
        "(default: the one installed in this Python).",
    ),
]


def with_targets(fn: F) -> F:
    for option in reversed(target_options):
        fn = option(fn)
    return fn


JSON_META = "sm120patch.json"


def _remember_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    # ctx.meta is shared by every context of one invocation: the group's error rendering
    # reads it to answer in JSON when the command was asked for JSON.
    if value:
        ctx.meta[JSON_META] = True
    return value


json_option = click.option(
    "--json", "as_json", is_flag=True, callback=_remember_json, help="Print JSON for scripts."
)


def fail(error: Sm120Error, as_json: bool) -> None:
    click.echo(f"sm120patch: {error.message}", err=True)
    if error.hint:
        click.echo(f"  next: {error.hint}", err=True)
    if as_json:
        emit_json(
            {
                "error": error.message,
                "next": error.hint or None,
                "exit_code": error.exit_code,
                **error.details,
            }
        )
    sys.exit(error.exit_code)


class Group(click.Group):
    """Renders every command's errors: a typed error is one line plus what to do (and JSON on
    stdout with --json); anything else is a bug (exit 4)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Sm120Error as exc:
            fail(exc, bool(ctx.meta.get(JSON_META)))
        except KeyboardInterrupt:
            click.echo("sm120patch: interrupted", err=True)
            click.echo("  next: `sm120patch status` says if `recover` is needed", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # `sm120patch status | head -1`: the reader left. Point stdout at /dev/null so the
            # interpreter's last flush does not fail a second time.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            click.echo("sm120patch: standard output was closed before all was written", err=True)
            sys.exit(1)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except Exception as exc:
            if os.environ.get("SM120PATCH_DEBUG"):
                raise
            click.echo(f"sm120patch: internal error: {type(exc).__name__}: {exc}", err=True)
            click.echo(
                "  next: rerun with SM120PATCH_DEBUG=1 for the traceback and report it; "
                "`sm120patch status` shows the state of your trees",
                err=True,
            )
            sys.exit(4)


# ---- signals (issue 9, item 4) ------------------------------------------------------------
# During an apply, revert or recover the engine defers SIGINT/SIGTERM/SIGHUP (interrupts.py)
# and ends as Interrupted (exit 130) or Unfinished (exit 75), both rendered by `handled`.
# This only acknowledges each signal at once, so that a user does not press Ctrl-C again and
# again; it runs inside the signal handler, hence os.write and no click.echo.
def _interrupt_notice(signum: int, count: int) -> None:
    import signal

    name = signal.Signals(signum).name
    text = (
        f"\nsm120patch: {name}: finishing this step safely, then stopping\n"
        if count == 1
        else f"sm120patch: {name} again: still finishing safely (nothing is cut short)\n"
    )
    os.write(2, text.encode())


def _install_interrupt_notice() -> None:
    from sm120patch import interrupts

    interrupts.notice = _interrupt_notice


_install_interrupt_notice()
# ---- end of signals ------------------------------------------------------------------------


def run() -> None:
    """The console entry point (and `python -m sm120patch`): `main`, then an exit without the
    interpreter's teardown. A plan leaves a few libcst trees of a million objects each, and
    freeing them one by one at exit took 80 ms, more than a tenth of a cold plan; the kernel
    frees the memory at once. (mypy exits the same way for the same reason.) Every file this
    tool writes is closed before its command returns; standard output and error are flushed
    here, and the exit status is the one `sys.exit` would give."""
    code: Any = 1
    try:
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            click.echo(str(code), err=True)  # sys.exit("message"): printed, status 1
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a reader that left, a closed stream
                code = code or 1
    except KeyboardInterrupt:
        # A Ctrl-C outside every command's own handling: while click parses the arguments, or
        # once the command has ended. Nothing of a run is cut short here.
        os.write(2, b"sm120patch: interrupted\n")
        code = 130
    os._exit(code)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sm120patch")
@click.option(
    "--patches",
    "pack_dirs",
    multiple=True,
    metavar="DIR",
    help="Also load the patch pack in DIR (patch modules + profiles.toml; repeatable; "
    "SM120PATCH_PATCHES adds more).",
)
def main(pack_dirs: tuple[str, ...]) -> None:
    """Apply, review and revert the patches that enable SGLang and FlashInfer fast paths on
    NVIDIA SM120 GPUs (RTX PRO 6000, RTX 5090)."""
    from sm120patch import catalog

    catalog.use_packs(pack_dirs)  # also when empty: one process may run several commands


@main.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the profiles and the patches they apply."""
    from sm120patch import catalog

    cat = catalog.load()
    if as_json:
        emit_json(
            {
                "profiles": [
                    {
                        "name": p.name,
                        "title": p.title,
                        "status": p.status,
                        "patches": list(p.patches),
                        "pins": {k: str(v) for k, v in p.pins.items()},
                        "source": cat.profile_sources[p.name].name,
                    }
                    for p in cat.profiles.values()
                ],
                "patches": [
                    {
                        "id": p.id,
                        "target": p.target,
                        "title": p.title,
                        "source": cat.source(p.id).name,
                    }
                    for p in cat.patches.values()
                ],
            }
        )
        return
    for p in cat.profiles.values():
        pins = ", ".join(f"{k} {v}" for k, v in p.pins.items())
        origin = cat.profile_sources[p.name]
        click.echo(f"{p.name:8} [{p.status}] {p.title}" + ("" if origin.built_in else
                                                            f" (from {origin.name})"))
        click.echo(f"{'':8} pins: {pins}")
        for pid in p.patches:
            source = cat.source(pid)
            where = "" if source.built_in else f" (from {source.name})"
            click.echo(f"{'':8}   {pid:26} {cat.patches[pid].title}{where}")


@main.command("show")
@click.argument("profile")
def show_cmd(profile: str) -> None:
    """Show a profile: its patches, why each exists, the shapes each knows, its pins."""
    from sm120patch import catalog

    cat = catalog.load()
    prof = cat.profile(profile)
    click.echo(f"{prof.name} [{prof.status}]: {prof.title}")
    for k, v in prof.pins.items():
        click.echo(f"  pinned on {k} {v}")
    if prof.known:
        click.echo("  known: " + " ".join(prof.known.split()))
    for patch in cat.patches_of(prof):
        click.echo(f"\n{patch.id} ({patch.target}, {cat.source(patch.id).name}): {patch.title}")
        click.echo("  why: " + patch.why)
        if patch.upstream:
            click.echo(f"  upstream: {patch.upstream}")
        for shape in patch.shapes:
            click.echo(f"  - {shape}")


def render_outcomes(outcomes: list[Any]) -> None:
    for o in outcomes:
        where = f"{o.file}::{o.site}" if o.file else o.site
        click.echo(f"  {o.status.value:16} {o.patch:26} {where}", err=True)
        if o.status.value in ("refused", "upstream", "not-applicable"):
            click.echo(f"  {'':16} {o.reason}", err=True)
        if getattr(o, "note", ""):
            click.echo(f"  {'':16} note: {o.note}", err=True)


def _lock_for(
    profile: str | None, locked: str | None
) -> tuple[str, Any, Any]:
    """(profile, lock, plan check) from PROFILE and/or --locked."""
    from pathlib import Path

    from sm120patch.errors import UsageError

    if not locked:
        if not profile:
            raise UsageError("give a PROFILE (see `sm120patch list`) or --locked LOCKFILE")
        return profile, None, None
    from sm120patch import lockfile

    lock = lockfile.read(Path(locked))
    if profile and profile != lock.profile:
        raise UsageError(f"{locked} locks profile {lock.profile}, not {profile}")
    return lock.profile, lock, lockfile.check(lock, Path(locked))


def render_report(report: Any) -> None:
    render_outcomes(report.outcomes)
    for note in report.notes:
        click.echo(note)
    for t in report.targets:
        if not t.files:
            continue
        where = f"on branch {t.branch}" if t.branch else "(pristine copies kept for revert)"
        click.echo(
            f"{t.target.name} {t.target.version} at {t.target.root}: "
            f"{len(t.files)} file(s) patched {where}"
        )


locked_option = click.option(
    "--locked",
    "locked",
    metavar="LOCKFILE",
    type=click.Path(dir_okay=False),
    help="Exactly what this lock file (from `pin`) records, or refuse.",
)


@main.command("apply")
@click.argument("profile", required=False)
@with_targets
@click.option("--dry-run", is_flag=True, help="Print the unified diff and change nothing.")
@locked_option
@click.option("--force", is_flag=True, help="Apply outside the profile's pinned versions.")
@click.option(
    "--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition (image builds, CI)."
)
@json_option
def apply_cmd(
    profile: str | None,
    sglang: str | None,
    flashinfer: str | None,
    dry_run: bool,
    locked: str | None,
    force: bool,
    no_gpu_check: bool,
    as_json: bool,
) -> None:
    """Apply PROFILE (moe, fusion, all) to SGLang and FlashInfer."""
    from sm120patch import engine, gpu

    paths = {"sglang": sglang, "flashinfer": flashinfer}
    profile, lock, check_plan = _lock_for(profile, locked)
    # One NVML reading for the known outcomes and the GPU check (starting NVML is most of a
    # tenth of a second on a GPU box).
    probe = functools.cache(gpu.probe)
    print_known(profile, paths, err=dry_run, quiet=as_json, probe=probe)  # issue 11
    if dry_run:
        # The apply minus the writes: the same preflight refuses the same way.
        prep = engine.dry_run(profile, paths, force=force, check_plan=check_plan, lock=lock)
        gpu_doc = None
        if not no_gpu_check:
            found = probe()
            gpu_doc = {"has_sm120": found.has_sm120, "summary": found.summary()}
            if not found.has_sm120:
                click.echo(
                    f"warning: no SM120 GPU here ({found.summary()}); a real apply "
                    "will refuse without --no-gpu-check",
                    err=True,
                )
        plan = prep.plan
        assert plan is not None
        if as_json:
            emit_json({**plan.to_dict(), "nothing_to_do": prep.nothing_to_do,
                       "notes": prep.notes, "gpu": gpu_doc, "error": None})  # fmt: skip
            return
        for tp in plan.targets:
            t = tp.target
            click.echo(f"# {t.name} {t.version} ({t.layout}) at {t.root}", err=True)
        render_outcomes(plan.outcomes)
        for note in prep.notes:
            click.echo(note, err=True)
        if not prep.nothing_to_do:
            click.echo(plan.diff(), nl=False)
        return
    report = engine.apply(
        profile,
        paths,
        force=force,
        preconditions=None if no_gpu_check else lambda: gpu.require_sm120(probe()),
        check_plan=check_plan,
        lock=lock,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    render_report(report)
    if report.action == "applied":
        click.echo(
            f"applied {profile}; restart the server to use it. "
            f"Undo with `sm120patch revert {profile}`."
        )
    elif lock is not None:
        click.echo(f"already exactly as {locked} says; nothing was changed")


@main.command("ensure")
@click.argument("profile", required=False)
@with_targets
@locked_option
@click.option("--force", is_flag=True, help="Allow versions outside the profile's pins.")
@click.option("--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition.")
@click.option(
    "--no-apply",
    is_flag=True,
    help="Only verify: exit 1 unless already exactly as wanted (never writes).",
)
@json_option
def ensure_cmd(
    profile: str | None,
    sglang: str | None,
    flashinfer: str | None,
    locked: str | None,
    force: bool,
    no_gpu_check: bool,
    no_apply: bool,
    as_json: bool,
) -> None:
    """For service start-up: exit 0 when the trees are exactly as wanted (applying first if
    they are pristine or the patch is gone), exit 1 changing nothing otherwise."""
    from sm120patch import engine, gpu

    profile, lock, check_plan = _lock_for(profile, locked)
    report = engine.ensure(
        profile,
        {"sglang": sglang, "flashinfer": flashinfer},
        force=force,
        preconditions=None if no_gpu_check else gpu.require_sm120,
        check_plan=check_plan,
        lock=lock,
        apply_if_needed=not no_apply,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    render_report(report)
    what = f"{locked}" if locked else f"profile {profile}"
    if report.action == "applied":
        click.echo(f"ensured {what}: applied now; the trees are as wanted")
    else:
        click.echo(f"ensured {what}: already as wanted; nothing was changed")


@main.command("revert")
@click.argument("profile", required=False)
@click.option("--all", "all_", is_flag=True, help="Revert whatever sm120patch applied.")
@with_targets
@click.option("--force", is_flag=True, help="Discard your edits to patched files.")
@click.option("--keep-branch", is_flag=True, help="Keep the sm120patch/<profile> branch.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Refuse as the revert would, or print the diff of what it would write back; "
    "change nothing.",
)
@json_option
def revert_cmd(
    profile: str | None,
    all_: bool,
    sglang: str | None,
    flashinfer: str | None,
    force: bool,
    keep_branch: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Revert PROFILE, or --all: every touched file back byte for byte."""
    from sm120patch import engine
    from sm120patch.errors import UsageError

    if bool(profile) == all_:
        raise UsageError("give exactly one of PROFILE or --all")
    if dry_run:
        paths = {"sglang": sglang, "flashinfer": flashinfer}
        report = engine.revert_dry_run(None if all_ else profile, paths, force=force)
        if as_json:
            emit_json(report.to_dict())
            return
        # As apply's dry run: stdout is the diff, what it says about it goes to stderr.
        for note in report.notes:
            click.echo(note, err=True)
        for t in report.targets:
            if report.action == "reverted" and t.files:
                click.echo(f"{t.target.name} at {t.target.root}: the revert would restore "
                           f"{len(t.files)} file(s)", err=True)  # fmt: skip
        click.echo(report.restores, nl=False)
        return
    report = engine.revert(
        None if all_ else profile,
        {"sglang": sglang, "flashinfer": flashinfer},
        force=force,
        keep_branch=keep_branch,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    for note in report.notes:
        click.echo(note)
    for t in report.targets:
        if report.action == "reverted" and t.files:
            kept = f"; branch {t.branch} kept" if t.branch else ""
            click.echo(
                f"{t.target.name} at {t.target.root}: {len(t.files)} file(s) restored{kept}"
            )


def _file_line(f: dict[str, Any]) -> str:
    extra = ""
    if f["as_installed"] is True and f["state"] != "pristine":
        extra = " (matches the installed RECORD)"
    elif f["as_installed"] is False and f["state"] == "drifted":
        extra = " (matches neither what sm120patch wrote nor the installed RECORD)"
    elif f["as_installed"] is False and f["state"] == "pristine":
        extra = " (differs from the installed RECORD)"
    return f"    {f['state']:9} {f['path']}{extra}"


@main.command("status")
@with_targets
@json_option
def status_cmd(sglang: str | None, flashinfer: str | None, as_json: bool) -> None:
    """The state of each target, decided from the bytes on disk, and of every touched file."""
    from sm120patch import assess

    found = assess.status({"sglang": sglang, "flashinfer": flashinfer})
    if as_json:
        emit_json({"targets": [s.to_dict() for s in found]})
        return
    if not found:
        click.echo("no SGLang or FlashInfer found; pass --sglang / --flashinfer")
    for s in found:
        t = s.target
        click.echo(f"{t.name} {t.version} ({t.layout}) at {t.root}: {s.state}")
        if s.state != "pristine":
            click.echo(f"  {s.assessment.message}")
        for trial in s.trials[-5:]:
            click.echo("  " + trial_line(trial))
        if s.profile is None:
            continue
        branch = f" on branch {s.branch} (base {s.base[:12]})" if s.branch and s.base else ""
        click.echo(f"  profile {s.profile}{branch}")
        for f in s.files:
            click.echo(_file_line(f))


@main.command("recover")
@with_targets
@json_option
def recover_cmd(sglang: str | None, flashinfer: str | None, as_json: bool) -> None:
    """Finish an interrupted apply (roll back) or revert (roll forward)."""
    from sm120patch import engine

    report = engine.recover({"sglang": sglang, "flashinfer": flashinfer})
    if as_json:
        emit_json(report.to_dict())
        return
    for note in report.notes:
        click.echo(note)


# ---- trial: run, measure, show (issue 11) ---------------------------------------------------


class _TrialGroup(click.Group):
    """`trial PROFILE ...` runs a trial (the `run` subcommand by default); `trial show [ID]`
    shows recorded ones. No profile is called `show` or `run`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@main.group("trial", cls=_TrialGroup)
def trial_group() -> None:
    """Apply a profile, run a server under it, judge it, keep or revert: `trial PROFILE -- CMD`
    (see `trial run --help`); `trial show [ID]` for recorded trials."""


def print_known(
    profile: str | None,
    paths: dict[str, str | None],
    command: list[str] | None = None,
    *,
    err: bool = False,
    quiet: bool = False,
    probe: Callable[[], Any] | None = None,
) -> None:
    """One line per known outcome (patches/known.toml) and per trial measured here that match
    this box, before acting; `apply` and `trial` call it. On stdout by default: stderr stays
    the one clear error line when the command then fails; `err` where stdout is a diff."""
    from sm120patch import known

    if quiet:
        return
    for line in known.lines(profile, paths, command or [], probe):
        click.echo(line, err=err)


@trial_group.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("profile")
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
@click.option(
    "--measure", is_flag=True, help="Judge by measurement: baseline vs patched under load."
)
@click.option("--api", "api", metavar="URL", help="Server base URL (default: from --ready-url).")
@click.option("--requests", type=int, default=64, show_default=True, help="Measured requests.")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests in flight.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Tokens per request.")
@click.option("--warmup", type=int, default=None, help="Uncounted requests first [concurrency].")
@click.option("--repeat", type=int, default=1, show_default=True, help="ABAB rounds.")
@click.option(
    "--min-gain",
    type=float,
    default=2.0,
    show_default=True,
    help="Percent the figure must improve beyond the measured spread to keep the patch.",
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
@click.option("--model", default=None, help="Model name for the API (default: /v1/models).")
@click.option(
    "--bench-cmd",
    default=None,
    metavar="CMDLINE",
    help="Measure with this benchmark instead (JSON result at {output}).",
)
@click.option(
    "--export",
    "export_path",
    type=click.Path(dir_okay=False),
    help="Write this trial as a known.toml record.",
)
@json_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def trial_cmd(
    profile: str,
    sglang: str | None,
    flashinfer: str | None,
    ready_url: str | None,
    ready_pattern: str | None,
    timeout: float,
    leave_running: bool,
    sample_power: bool,
    log_path: str | None,
    force: bool,
    no_gpu_check: bool,
    measure: bool,
    api: str | None,
    requests: int,
    concurrency: int,
    max_tokens: int,
    warmup: int | None,
    repeat: int,
    min_gain: float,
    figure: str,
    min_similarity: float,
    model: str | None,
    bench_cmd: str | None,
    export_path: str | None,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Apply PROFILE, run COMMAND (after --), keep the patch if it gets ready, else revert.

    With --measure: baseline and patched runs of COMMAND under the same load, kept only when
    the figure improves by --min-gain beyond the spread and the answers are sane. Exit 0 kept,
    3 crashed, 5 reverted as not faster, 6 reverted as wrong output.
    """
    from pathlib import Path

    from sm120patch import gpu, trial
    from sm120patch.errors import TrialCrashed, UsageError

    paths = {"sglang": sglang, "flashinfer": flashinfer}
    if export_path and not measure:
        raise UsageError(
            "--export needs --measure",
            "or export a recorded trial: `sm120patch trial show ID --export FILE`",
        )
    probe = functools.cache(gpu.probe)  # one NVML start for the known outcomes and the check
    print_known(profile, paths, list(command), err=as_json, probe=probe)
    if measure:
        from sm120patch import measure as measuring

        opts = measuring.Options(
            api=api,
            ready_url=ready_url,
            ready_pattern=ready_pattern,
            timeout=timeout,
            requests=requests,
            concurrency=concurrency,
            max_tokens=max_tokens,
            warmup=warmup,
            repeat=repeat,
            min_gain=min_gain / 100,
            figure=figure,
            min_similarity=min_similarity,
            model=model,
            bench_cmd=bench_cmd,
        )
        measured = measuring.run(
            profile,
            paths,
            list(command),
            opts,
            force=force,
            preconditions=None if no_gpu_check else lambda: gpu.require_sm120(probe()),
            log_path=Path(log_path) if log_path else None,
            on_line=lambda line: click.echo(line, err=True),
            on_event=lambda line: click.echo(f"sm120patch: {line}", err=True),
        )
        doc = measured.to_dict()
        if export_path:
            write_export(doc, Path(export_path))
        if as_json:
            emit_json(doc)
        else:
            for line in measured_lines(doc):
                click.echo(line)
        if measured.exit_code:
            sys.exit(measured.exit_code)
        return
    try:
        result = trial.run(
            profile,
            paths,
            list(command),
            ready_url=ready_url,
            ready_pattern=ready_pattern,
            timeout=timeout,
            leave_running=leave_running,
            sample_power=sample_power,
            log_path=Path(log_path) if log_path else None,
            force=force,
            preconditions=None if no_gpu_check else lambda: gpu.require_sm120(probe()),
            on_line=lambda line: click.echo(line, err=as_json),
        )
    except TrialCrashed as exc:
        if as_json and exc.record is not None:
            emit_json({**exc.record, "error": exc.message, "next": exc.hint, "exit_code": 3})
            sys.exit(exc.exit_code)
        raise
    if as_json:
        emit_json(result.to_dict())
        return
    click.echo(
        f"trial of {profile}: {result.verdict}"
        + (f" in {result.time_to_ready_s:.1f}s" if result.time_to_ready_s else "")
        + f"; the profile stays applied (`sm120patch revert {profile}` to undo)"
    )
    for line in power_lines(result.power_samples):
        click.echo(line)


@trial_group.command("show")
@click.argument("trial_id", required=False)
@with_targets
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write a report.")
@click.option(
    "--export",
    "export_path",
    type=click.Path(dir_okay=False),
    help="Write the trial as a known.toml record.",
)
@json_option
def trial_show_cmd(
    trial_id: str | None,
    sglang: str | None,
    flashinfer: str | None,
    html_path: str | None,
    export_path: str | None,
    as_json: bool,
) -> None:
    """Show a recorded trial (the latest, or ID or a prefix of it); --html draws a report."""
    from pathlib import Path

    from sm120patch import known, report

    found = known.find_trial(known.history({"sglang": sglang, "flashinfer": flashinfer}), trial_id)
    if html_path:
        Path(html_path).write_text(report.html(found), encoding="utf-8")
    if export_path:
        write_export(found, Path(export_path))
    if as_json:
        emit_json(found)
        return
    lines = measured_lines(found) if found.get("kind") == "measured" else [trial_line(found)]
    for line in lines:
        click.echo(line)
    if html_path:
        click.echo(f"report: {html_path}")


def write_export(doc: dict[str, Any], path: Any) -> None:
    from sm120patch import known

    path.write_text(known.export_record(doc), encoding="utf-8")
    click.echo(f"wrote {path}: one known.toml record", err=True)


def trial_line(t: dict[str, Any]) -> str:
    """One line of a recorded trial, for `status` and `trial show`."""
    if t.get("kind") == "measured":
        return f"trial {t.get('id')} {t.get('profile')} measured: {t.get('message')}"
    head = f"trial {t['id']} " if t.get("id") else "trial "
    return (
        f"{head}{t.get('profile')}: {t.get('verdict')}, "
        f"exit {t.get('exit_code')}: {' '.join(t.get('command', []))}"
    )


def measured_lines(doc: dict[str, Any]) -> list[str]:
    """A measured trial in words: each run's figures and power, then the verdict."""
    from sm120patch import gpu

    lines = [f"trial {doc['id']} of {doc['profile']}: {' '.join(doc['command'])}"]
    if doc.get("versions") or doc.get("gpu_names"):
        versions = ", ".join(f"{k} {v}" for k, v in doc.get("versions", {}).items())
        lines.append(f"  {versions}; GPUs: {', '.join(doc.get('gpu_names') or ['none seen'])}")
    for run in doc["runs"]:
        head = f"  {run['side']:8} run {run['round'] + 1}: "
        f = run.get("figures")
        if run["outcome"] != "ok" or not f:
            lines.append(head + f"{run['outcome']} (exit {run.get('exit_code')})")
            continue
        lines.append(
            head + f"{f['output_tok_s']:.1f} tok/s, {f['req_s']:.2f} req/s, "
            f"TTFT p50/p99 {_ms(f.get('ttft_p50_ms'))}/{_ms(f.get('ttft_p99_ms'))} ms, "
            f"ITL p50/p99 {_ms(f.get('itl_p50_ms'))}/{_ms(f.get('itl_p99_ms'))} ms"
        )
        for g in run.get("gpus", []):
            lines.append("    " + gpu.GpuFigures(**g).describe())
        if run.get("nvml_problem"):
            lines.append(f"    no GPU figures: {run['nvml_problem']}")
    for reason in (doc.get("sanity") or {}).get("reasons", []):
        lines.append(f"  wrong output: {reason}")
    if doc.get("signature"):
        lines.append(f"  next: {doc['signature']['action']}")
    lines.append(f"verdict: {doc['verdict']}: {doc['message']}")
    return lines


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def power_lines(samples: list[dict[str, Any]]) -> list[str]:
    """Mean and peak draw per GPU against its limit."""
    per: dict[int, list[tuple[float, float | None]]] = {}
    for sample in samples:
        for g in sample["gpus"]:
            if g["power_w"] is not None:
                per.setdefault(g["index"], []).append((g["power_w"], g["limit_w"]))
    lines = []
    for index, values in sorted(per.items()):
        draws = [v[0] for v in values]
        limit = values[-1][1]
        mean = sum(draws) / len(draws)
        share = f" ({100 * mean / limit:.0f}% of its {limit:.0f} W limit)" if limit else ""
        lines.append(f"GPU {index}: mean {mean:.0f} W, peak {max(draws):.0f} W{share}")
    return lines


@main.command("doctor")
@with_targets
@json_option
def doctor_cmd(sglang: str | None, flashinfer: str | None, as_json: bool) -> None:
    """What this machine has (GPUs, SGLang, FlashInfer) and what each profile would do here."""
    from sm120patch import doctor

    found = doctor.examine({"sglang": sglang, "flashinfer": flashinfer})
    if as_json:
        emit_json(found.to_dict())
        return
    probe = found.probe
    if probe.problem or not probe.gpus:
        click.echo(f"GPUs: {probe.summary()}")
    else:
        click.echo(f"GPUs (driver {probe.driver}, CUDA {probe.cuda_driver}):")
        for g in probe.gpus:
            mark = "SM120" if g.is_sm120 else "not SM120"
            click.echo(f"  {g.describe()} ({mark})")
    for t in found.targets:
        click.echo(f"{t['kind']}: {t['version']} ({t['layout']}) at {t['root']}")
    for line in found.missing:
        click.echo(line)
    for p in found.profiles:
        pinned = {True: "inside its pins", False: "OUTSIDE its pins", None: "not checked"}
        click.echo(f"profile {p.name} [{p.status}]: {pinned[p.pinned]}")
        for problem in p.problems:
            click.echo(f"  {problem}")
        for o in p.outcomes:
            click.echo(f"  {o['status']:16} {o['patch']:26} {o['file'] or ''}::{o['site']}")
    for a in found.applied:
        if a.get("profile"):
            click.echo(f"applied now on {a['root']}: {a['profile']}")
    for line in found.known:
        click.echo(line)
    click.echo(found.recommendation)


@main.command("pin")
@click.argument("profile")
@with_targets
@click.option(
    "-o",
    "--output",
    default="sm120patch.lock",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the lock file.",
)
@click.option("--force", is_flag=True, help="Pin outside the profile's pinned versions.")
def pin_cmd(
    profile: str, sglang: str | None, flashinfer: str | None, output: str, force: bool
) -> None:
    """Write a lock file freezing versions, patch digests and file hashes of PROFILE here."""
    from pathlib import Path

    from sm120patch import lockfile

    lock = lockfile.make(profile, {"sglang": sglang, "flashinfer": flashinfer}, force=force)
    Path(output).write_text(lock.to_toml(), encoding="utf-8")
    versions = ", ".join(f"{k} {v}" for k, v in lock.versions.items())
    click.echo(f"wrote {output}: {profile} on {versions}, {len(lock.files)} file(s)")


@main.command("export")
@click.argument("profile")
@with_targets
@click.option(
    "-o",
    "--output",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory for the patches (one subdirectory per target).",
)
@click.option("--force", is_flag=True, help="Export outside the profile's pinned versions.")
@click.option("--overwrite", is_flag=True, help="Replace the patches already in DIR.")
def export_cmd(
    profile: str,
    sglang: str | None,
    flashinfer: str | None,
    out_dir: str,
    force: bool,
    overwrite: bool,
) -> None:
    """Write one mail-format patch per applied patch per target (for git am / git apply)."""
    from pathlib import Path

    from sm120patch import export
    from sm120patch import plan as planner

    plan = planner.checked(profile, {"sglang": sglang, "flashinfer": flashinfer}, force=force)
    for item in export.write(plan, Path(out_dir), overwrite=overwrite):
        click.echo(f"{item.target}: {item.path}")


# ---- patch packs (issue 12): new-patch -------------------------------------------------------


@main.command("new-patch")
@click.argument("patch_id")
@click.option("--target", type=click.Choice(["sglang", "flashinfer"]), required=True)
@click.option("--file", "rel", required=True, metavar="PATH",
              help="The file holding the site, relative to the package's parent.")
@click.option("--function", required=True, help="The function holding the site.")
@click.option("--pins", required=True, metavar="SPEC", help="Releases the profile pins.")
@click.option("--keyword", default=None, help="A list keyword to extend (with --expect, --add).")
@click.option("--expect", default=None, metavar="N,N", help="The list as released, e.g. 9,10.")
@click.option("--add", type=int, default=None, help="The element to add, e.g. 12.")
@click.option("--profile", default=None, help="Profile name (default: the id's last part).")
@click.option("--dir", "directory", default="sm120patch-pack", show_default=True,
              type=click.Path(file_okay=False), help="The pack directory to write into.")
@click.option("--force", is_flag=True, help="Overwrite files new-patch wrote before.")
def new_patch_cmd(
    patch_id: str, target: str, rel: str, function: str, pins: str, keyword: str | None,
    expect: str | None, add: int | None, profile: str | None, directory: str, force: bool,
) -> None:
    """Write a patch module, its facts table, a profile and a test into a pack directory."""
    from pathlib import Path

    from sm120patch import scaffold
    from sm120patch.errors import UsageError

    try:
        majors = tuple(int(x) for x in expect.split(",")) if expect else ()
    except ValueError:
        raise UsageError(
            f"--expect '{expect}' is not a list of integers", "e.g. --expect 9,10"
        ) from None
    spec = scaffold.NewPatch(
        patch_id, target, rel, function, pins, profile or "", keyword, majors, add
    )
    written = scaffold.write(spec, Path(directory), force=force)
    for path in (written.module, written.test, written.profiles):
        click.echo(f"wrote {path}")
    click.echo(f"next: fill in the TODOs, then `python -m pytest {written.test}` and "
               f"`sm120patch --patches {directory} apply {written.profile} --dry-run`")


@main.command("matrix")
@click.option(
    "--sglang",
    "sglang_spec",
    metavar="SPEC",
    help="SGLang releases to plan, a PEP 440 specifier (e.g. '>=0.5.8', '==0.5.10.post1').",
)
@click.option(
    "--flashinfer",
    "flashinfer_spec",
    metavar="SPEC",
    help="FlashInfer releases to plan, a PEP 440 specifier.",
)
@click.option("--profile", "profiles", multiple=True, help="Only these profiles (repeatable).")
@click.option(
    "-j",
    "--jobs",
    type=int,
    default=None,
    help="Releases planned in parallel (default: the CPU count).",
)
@json_option
@click.option("--markdown", "as_markdown", is_flag=True, help="Print Markdown tables (default).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr.")
@click.option(
    "--scan", "scan", is_flag=True, help="Scan each whole release too: its new candidate gates."
)
def matrix_cmd(
    sglang_spec: str | None,
    flashinfer_spec: str | None,
    profiles: tuple[str, ...],
    jobs: int | None,
    as_json: bool,
    as_markdown: bool,
    quiet: bool,
    scan: bool,
) -> None:
    """Plan every profile on every SGLang and FlashInfer release on pip's index: outcome per
    site. Releases come from pip's configured index (pip config, PIP_INDEX_URL) into the release
    cache; offline, the cached release list is used with a warning."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from sm120patch import catalog
    from sm120patch.errors import UsageError
    from sm120patch.maintain import matrix
    from sm120patch.maintain.progress import Progress

    if as_json and as_markdown:
        raise UsageError("give at most one of --json and --markdown")
    cat = catalog.load()
    for name in profiles:
        cat.profile(name)
    specs: dict[str, str | None] = {}
    if sglang_spec is not None or flashinfer_spec is None:
        specs["sglang"] = sglang_spec
    if flashinfer_spec is not None or sglang_spec is None:
        specs["flashinfer"] = flashinfer_spec
    for kind, spec in specs.items():
        try:
            SpecifierSet(spec or "")
        except InvalidSpecifier:
            raise UsageError(f"--{kind} {spec!r} is not a PEP 440 specifier") from None
    progress = Progress(quiet=quiet)
    with progress.phase("reading the release index", len(specs)):
        selection = matrix.releases_for(specs, progress=progress.advance)
    warning = selection.warning()
    if warning:
        click.echo(f"sm120patch: warning: {warning}", err=True)
    work = selection.work
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    with progress.phase("planning releases", len(work)):
        rows = matrix.run(
            work,
            jobs,
            progress=lambda row: progress.advance(f"{row.kind} {row.version}"),
            scan=scan,
        )
    chosen = list(profiles) or None
    if as_json:
        click.echo(matrix.to_json(rows, [warning] if warning else []))
    else:
        click.echo(matrix.markdown(rows, chosen))
    if any(r.error for r in rows):
        sys.exit(1)


@main.command("scan")
@with_targets
@json_option
@click.option("--all", "all_", is_flag=True, help="List the upstream and kernel gates too.")
@click.option("--fail-on-candidate", is_flag=True, help="Exit 1 when a candidate is found.")
def scan_cmd(
    sglang: str | None, flashinfer: str | None, as_json: bool, all_: bool,
    fail_on_candidate: bool,
) -> None:  # fmt: skip
    """The GPU-arch gates of SGLang and FlashInfer that leave SM120 out, read from their sources
    (nothing is imported): candidates, gates a patch covers, upstream, kernel."""
    from sm120patch.scan import report, run

    found = run.scan({"sglang": sglang, "flashinfer": flashinfer})
    if as_json:
        emit_json(found.to_dict())
    else:
        click.echo(report.text(found, all_=all_), nl=False)
    if fail_on_candidate and found.counts()["candidate"]:
        sys.exit(1)


# ---------------------------------------------------------------------------- explain (issue 10)


@main.command("explain", context_settings={"ignore_unknown_options": True})
@with_targets
@click.option(
    "--python",
    "python",
    metavar="PATH",
    help="The interpreter SGLang runs in (default: the venv's python beside the target).",
)
@click.option(
    "--simulate",
    type=click.Choice(["sm120", "sm100", "sm90"]),
    help="Decide as on a GPU of this architecture instead of the real one.",
)
@json_option
@click.argument("launch", nargs=-1, type=click.UNPROCESSED)
def explain_cmd(
    sglang: str | None,
    flashinfer: str | None,
    python: str | None,
    simulate: str | None,
    as_json: bool,
    launch: tuple[str, ...],
) -> None:
    """What upstream's own code decides, pristine vs patched, for `-- SGLANG LAUNCH ARGS`.

    Runs SGLang's server-argument resolution, the allreduce-fusion gate, _resolve_backend and
    FlashInfer's comm module flags in the target's interpreter: no weights, no server.
    """
    from sm120patch import explain

    found = explain.explain(
        {"sglang": sglang, "flashinfer": flashinfer},
        python=python,
        simulate=simulate,
        launch=launch,
    )
    if as_json:
        emit_json(found.to_dict())
        return
    gpu = f"simulated {simulate.upper()}" if simulate else "this machine's GPU"
    click.echo(f"# {gpu}, {found.python}")
    for t in found.targets:
        click.echo(f"# {t['kind']} {t['version']} at {t['root']}")
    if found.launch:
        click.echo(f"# launch: {' '.join(found.launch)}")
    side = "patched (on disk)" if found.applied else "patched (planned)"

    def cell(text: str, most: int = 56) -> str:
        return text if len(text) <= most else text[: most - 3] + "..."

    rows = [("", "pristine", side), *((k, cell(a), cell(b)) for k, a, b in found.rows())]
    width = max(len(r[0]) for r in rows)
    left = max(len(r[1]) for r in rows)
    for label, before, after in rows:
        mark = "  " if before == after or not label else "->"
        click.echo(f"{label:{width}}  {before:{left}}  {mark} {after}")
    for note in found.notes:
        click.echo(f"note: {note}")
