"""The command line: click only. Each command parses its options, calls one function of the
command layer (app.py) and prints what render.py makes of the result.

Exit codes (README): 0 success, 1 refused or precondition failed (nothing changed), 2 usage,
3 a trial crashed and was reverted, 4 internal error; `trial --measure` also 5 (reverted:
inconclusive, slower or inert), 6 (reverted: wrong output) and 8 (nothing answered at the
API); 75 a run left its journal (`recover`), 130 interrupted.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from sm120patch import __version__, _interrupted_at_start, app, render
from sm120patch.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])

def _stated(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:  # --sglang-version / --flashinfer-version, for `session` (checked there)
        ctx.meta.setdefault("sm120patch.stated", {})[str(param.name)[: -len("_version")]] = value


VLLM_META = "sm120patch.vllm"


def _named_vllm(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Not a parameter of every command: `session` reads it, as it reads the stated versions.
    if value:
        ctx.find_root().meta[VLLM_META] = value


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
    click.option(
        "--vllm",
        metavar="PATH",
        expose_value=False,
        callback=_named_vllm,
        help="vLLM checkout root, package parent or site-packages (looked for only when given).",
    ),
    *(click.option(f"--{k}-version", metavar="VERSION", expose_value=False, callback=_stated,
                   help=f"The {n} release this tree is, where its packaging does not say.")
      for k, n in (("sglang", "SGLang"), ("flashinfer", "FlashInfer"),
                   ("vllm", "vLLM"))),  # fmt: skip
]


def with_targets(fn: F) -> F:
    for option in reversed(target_options):
        fn = option(fn)
    return fn


json_option = click.option(
    "--json", "as_json", is_flag=True, callback=render.remember_json, help="Print JSON for scripts."
)
paste, emit_json, show = render.paste, render.emit_json, render.show
echo_err, echo_out, quiet, pasted = render.echo_err, render.echo_out, render.quiet, render.pasted


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
    ctx.obj = tuple(pack_dirs)


def complete_profile(ctx: click.Context, param: object, incomplete: str) -> list[Any]:
    """Shell completion of PROFILE: the profile names, the packs' (--patches) included."""
    from click.shell_completion import CompletionItem

    packs = tuple(ctx.find_root().params.get("pack_dirs") or ())
    return [CompletionItem(n) for n in app.profile_names(packs) if n.startswith(incomplete)]


def session(
    sglang: str | None = None, flashinfer: str | None = None, *, verbose: bool = False
) -> app.Session:
    """The command's session: its targets and the group's --patches."""
    root = click.get_current_context().find_root()
    vllm = root.meta.get(VLLM_META)
    root.meta[render.PATHS_META] = {"sglang": sglang, "flashinfer": flashinfer,
                                    **({"vllm": vllm} if vllm else {})}  # hints use it; fmt: skip
    return app.Session(sglang, flashinfer, root.obj or (), root.meta.get("sm120patch.stated", {}),
                       verbose=verbose, vllm=vllm)  # fmt: skip


@main.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the profiles and the patches they apply."""
    cat = app.list_profiles(session())
    held = app.held_here(cat)
    if as_json:
        emit_json(render.profiles_doc(cat, held))
        return
    show(render.profiles(cat, held))


@main.command("show")
@click.argument("profile", shell_complete=complete_profile)
@json_option
def show_cmd(profile: str, as_json: bool) -> None:
    """Show a profile: its pins, what it refuses, its patches (why each exists, the shapes each
    knows) and every known outcome about it, in full."""
    s = session()
    prof = app.show(s, profile)
    entries = app.known_about(profile)
    if as_json:
        emit_json(render.profile_doc(s.catalog, prof, entries))
        return
    show(render.profile(s.catalog, prof, entries, render.page_width()))


locked_option = click.option(
    "--locked",
    "locked",
    metavar="LOCKFILE",
    type=click.Path(dir_okay=False),
    help="Exactly what this lock file (from `pin`) records, or refuse.",
)


verbose_option = click.option(
    "-v", "--verbose", is_flag=True, help="The known outcomes in full, not one line each."
)


@main.command("apply")
@click.argument("profile", required=False, shell_complete=complete_profile)
@with_targets
@click.option("--dry-run", is_flag=True, help="Print the unified diff and change nothing.")
@locked_option
@click.option("--force", is_flag=True, help="Apply outside the profile's pinned versions.")
@click.option(
    "--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition (image builds, CI)."
)
@verbose_option
@json_option
def apply_cmd(
    profile: str | None,
    sglang: str | None,
    flashinfer: str | None,
    dry_run: bool,
    locked: str | None,
    force: bool,
    no_gpu_check: bool,
    verbose: bool,
    as_json: bool,
) -> None:
    """Apply PROFILE (see `sm120patch list`) to SGLang and FlashInfer.

    The known outcomes that match this box come first, one line each (--verbose: in full).
    """
    s = session(sglang, flashinfer, verbose=verbose)
    want = app.locked(profile, locked)
    known = quiet if as_json else (pasted(echo_err) if dry_run else pasted(echo_out))
    if dry_run:
        found = app.apply_dry_run(s, want, force=force, gpu_check=not no_gpu_check,
                                  on_known=known)  # fmt: skip
        if as_json:
            show(render.Text(err=render.dry_run_warnings(found)))
            emit_json(render.dry_run_doc(found))
        else:
            show(render.dry_run(found))
        return
    report = app.apply(s, want, force=force, gpu_check=not no_gpu_check, on_known=known)
    if as_json:
        emit_json(report.to_dict())
        return
    show(render.applied(report, want.profile, want.lock_path))


@main.command("ensure")
@click.argument("profile", required=False, shell_complete=complete_profile)
@with_targets
@locked_option
@click.option("--force", is_flag=True, help="Allow versions outside the profile's pins.")
@click.option("--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition.")
@click.option("--no-apply", is_flag=True,
              help="Only verify: exit 1 unless already exactly as wanted (never writes).")
@click.option("--lock-wait", type=click.FloatRange(min=0), default=120.0, show_default=True,
              metavar="SECONDS", help="Wait this long for another run's lock (two services "
              "sharing a venv), then decide from the bytes; 0 refuses at once.")  # fmt: skip
@json_option
def ensure_cmd(
    profile: str | None,
    sglang: str | None,
    flashinfer: str | None,
    locked: str | None,
    force: bool,
    no_gpu_check: bool,
    no_apply: bool,
    lock_wait: float,
    as_json: bool,
) -> None:
    """For service start-up: exit 0 when the trees are exactly as wanted (applying first if
    they are pristine or the patch is gone), exit 1 changing nothing otherwise."""
    want = app.locked(profile, locked)
    report = app.ensure(session(sglang, flashinfer), want, force=force,
                        gpu_check=not no_gpu_check, apply_if_needed=not no_apply,
                        lock_wait=lock_wait, on_wait=render.waiting(lock_wait))  # fmt: skip
    if as_json:
        emit_json(report.to_dict())
        return
    show(render.ensured(report, f"{locked}" if locked else f"profile {want.profile}"))


@main.command("revert")
@click.argument("profile", required=False, shell_complete=complete_profile)
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
    report = app.revert(session(sglang, flashinfer), profile, every=all_, force=force,
                        keep_branch=keep_branch, dry_run=dry_run)  # fmt: skip
    if as_json:
        emit_json(report.to_dict())
        return
    show(render.reverted(report))


@main.command("status")
@with_targets
@click.option(
    "--check",
    is_flag=True,
    help="Exit 0 only when every target is as recorded (pristine or applied): 1 when one is "
    "drifted, gone, replaced or missing or none is found, 75 when one is unfinished.",
)
@json_option
def status_cmd(sglang: str | None, flashinfer: str | None, check: bool, as_json: bool) -> None:
    """The state of each target, decided from the bytes on disk, and of every touched file."""
    found = app.status(session(sglang, flashinfer))
    code = render.status_exit(found) if check else 0
    if as_json:
        emit_json({"targets": [s.to_dict() for s in found], "exit_code": code})
    else:
        show(render.status(found))
    if code:
        sys.exit(code)


@main.command("recover")
@with_targets
@json_option
def recover_cmd(sglang: str | None, flashinfer: str | None, as_json: bool) -> None:
    """Finish an interrupted apply (roll back) or revert (roll forward)."""
    report = app.recover(session(sglang, flashinfer))
    if as_json:
        emit_json(report.to_dict())
        return
    show(render.recovered(report))


# ---- trial: run, show, forget ---------------------------------------------------------------


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


@main.group("trial", cls=_TrialGroup)
def trial_group() -> None:
    """Apply a profile, run a server under it, judge it, keep or revert: `trial PROFILE -- CMD`
    (see `trial run --help`); `trial show [ID]` for recorded trials, `trial forget ID` (or
    --all) to remove them."""


# The options of `trial --measure` only, in the names of trial.measure.Options.
MEASURE_OPTIONS = (
    "api", "requests", "concurrency", "max_tokens", "warmup", "repeat", "max_repeat", "min_gain",
    "figure", "min_similarity", "min_agreement", "eval_cmd", "eval_key", "eval_tolerance",
    "model", "bench_cmd",
)  # fmt: skip


@trial_group.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("profile", shell_complete=complete_profile)
@with_targets
@click.option("--ready-url", metavar="URL", help="Ready when this URL answers 2xx.")
@click.option("--ready-pattern", metavar="REGEX", help="Ready when an output line matches.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for readiness (or for the command to finish).")
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
@click.option("--repeat", type=int, default=3, show_default=True,
              help="ABAB rounds: runs a side (a keep needs 2 at least).")
@click.option("--max-repeat", type=int, default=6, show_default=True,
              help="Most runs a side while the figures lean but have not cleared the noise.")
@click.option("--min-gain", type=float, default=2.0, show_default=True,
              help="Percent the figure must improve beyond the measured noise to keep the patch.")
@click.option("--figure", default="output_tok_s", show_default=True,
              help="output_tok_s, req_s, ttft_p50_ms, ttft_p99_ms, itl_p50_ms or itl_p99_ms.")
@click.option("--min-similarity", type=float, default=0.5, show_default=True,
              help="Least word similarity of the patched greedy answers to the baseline's.")
@click.option("--min-agreement", type=float, default=0.9, show_default=True,
              help="Least top-1 token agreement with the baseline (where logprobs are served).")
@click.option("--eval-cmd", default=None, metavar="CMDLINE",
              help="A quality command run on both sides ({api}, {model}, {output}); JSON score.")
@click.option("--eval-key", default="score", show_default=True, help="Dotted key of its score.")
@click.option("--eval-tolerance", type=float, default=0.01, show_default=True,
              help="How far the patched score may fall below the baseline's.")
@click.option("--model", default=None, help="Model name for the API (default: /v1/models).")
@click.option("--bench-cmd", default=None, metavar="CMDLINE",
              help="Measure with this benchmark instead (JSON result at {output}).")
@click.option("--export", "record_path", type=click.Path(dir_okay=False),
              help="Write this trial as a known.toml record (when it is evidence).")
@json_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def trial_cmd(
    profile: str,
    sglang: str | None,
    flashinfer: str | None,
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
    request = app.TrialRequest(profile, command, gpu_check=not no_gpu_check, **options)
    measure_options = app.measure_options(request, **measured) if measure else None
    try:
        found = app.trial(
            session(sglang, flashinfer),
            request,
            measure_options,
            on_known=echo_err if as_json else echo_out,
            on_line=echo_err if (measure or as_json) else echo_out,
            on_event=lambda line: echo_err(f"sm120patch: {line}"),
            on_progress=echo_err if sys.stderr.isatty() else None,
        )
    except TrialCrashed as exc:
        if as_json and exc.record is not None:
            emit_json({**exc.record, "error": paste(exc.message), "next": paste(exc.hint),
                       "exit_code": 3})  # fmt: skip
            sys.exit(exc.exit_code)
        raise
    if request.record_path:
        show(render.record_written(found, request.record_path))
    if as_json:
        doc = (found.measured or found.result).record().to_json()  # type: ignore[union-attr]  # one of the two is set
        emit_json(doc)
    else:
        show(render.trialled(found, profile))
    if found.measured is not None and found.measured.exit_code:
        sys.exit(found.measured.exit_code)


@trial_group.command("show")
@click.argument("trial_id", required=False)
@with_targets
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write a report.")
@click.option("--export", "record_path", type=click.Path(dir_okay=False),
              help="Write the trial as a known.toml record.")
@json_option
def trial_show_cmd(
    trial_id: str | None,
    sglang: str | None,
    flashinfer: str | None,
    html_path: str | None,
    record_path: str | None,
    as_json: bool,
) -> None:
    """Show a recorded trial (the latest, or ID or a prefix of it); --html draws a report."""
    found = app.trial_show(session(sglang, flashinfer), trial_id, html_path, record_path)
    if as_json:
        if record_path:
            echo_err(f"wrote {record_path}: one known.toml record")
        emit_json(found.trial.to_json())
        return
    show(render.shown(found))


@trial_group.command("forget")
@click.argument("trial_ids", nargs=-1, metavar="[ID]...")
@click.option("--all", "everything", is_flag=True, help="Forget every recorded trial.")
@with_targets
@json_option
def trial_forget_cmd(
    trial_ids: tuple[str, ...],
    everything: bool,
    sglang: str | None,
    flashinfer: str | None,
    as_json: bool,
) -> None:
    """Remove recorded trials (IDs or unique prefixes of them, or --all) from every target."""
    gone = app.trial_forget(session(sglang, flashinfer), trial_ids, everything=everything)
    if as_json:
        emit_json({"forgotten": gone})
        return
    show(render.forgotten(gone))


@main.command("doctor")
@with_targets
@verbose_option
@json_option
def doctor_cmd(sglang: str | None, flashinfer: str | None, verbose: bool, as_json: bool) -> None:
    """What this machine has (GPUs, SGLang, FlashInfer) and one verdict per profile here.

    The known outcomes that match this box come after the profiles, one line each (--verbose:
    in full), then the summary.
    """
    found = app.doctor(session(sglang, flashinfer, verbose=verbose))
    if as_json:
        emit_json(found.to_dict())
        return
    show(render.doctor(found))


@main.command("pin")
@click.argument("profile", shell_complete=complete_profile)
@with_targets
@click.option(
    "-o",
    "--output",
    default="sm120patch.lock",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the lock file.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Pin outside the profile's pinned versions, and replace an existing lock file.",
)
def pin_cmd(
    profile: str, sglang: str | None, flashinfer: str | None, output: str, force: bool
) -> None:
    """Write a lock file freezing versions, file hashes and each patch's diff of PROFILE here."""
    show(render.pinned(app.pin(session(sglang, flashinfer), profile, output, force=force), profile))


@main.command("export")
@click.argument("profile", shell_complete=complete_profile)
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
    written = app.write_patch_mails(session(sglang, flashinfer), profile, out_dir, force=force,
                         overwrite=overwrite)  # fmt: skip
    for item in written:
        echo_out(f"{item.target}: {item.path}")


@main.command("new-patch")
@click.argument("patch_id")
@click.option("--target", type=click.Choice(["sglang", "flashinfer", "vllm"]), required=True)
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
def new_patch_cmd(**options: Any) -> None:
    """Write a patch module, its facts table, a profile and a test into a pack directory."""
    written = app.new_patch(app.NewPatchRequest(**options))
    for path in (written.module, written.test, written.profiles, written.registry):
        if path is None:
            continue
        echo_out(f"wrote {path}")
    directory = options["directory"]
    for line in render.hint_lines(
        f"fill in the TODOs, then `python -m pytest {shlex.quote(str(written.test))}` and "
        f"`sm120patch --patches {shlex.quote(directory)} apply {written.profile} --dry-run`"
    ):
        echo_out(line.strip())


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
@click.option("--vllm", "vllm_spec", metavar="SPEC",
              help="vLLM releases to plan ('' for every one tracked); only when named.")
@click.option("--profile", "profiles", multiple=True, help="Only these profiles (repeatable).")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Releases planned in parallel (default: the CPU count).",
)
@json_option
@click.option("--markdown", "as_markdown", is_flag=True, help="Print Markdown tables (default).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr.")
@click.option("--scan", is_flag=True, help="Scan each whole release too: its new candidate gates.")
def matrix_cmd(
    sglang_spec: str | None,
    flashinfer_spec: str | None,
    vllm_spec: str | None,
    profiles: tuple[str, ...],
    jobs: int | None,
    as_json: bool,
    as_markdown: bool,
    quiet: bool,
    scan: bool,
) -> None:
    """Plan every profile on every SGLang and FlashInfer release on pip's index (vLLM with
    --vllm): outcome per site. Naming some kinds plans only those. Releases come from pip's
    configured index (pip config, PIP_INDEX_URL) into the release cache; offline, the cached
    release list is used with a warning."""
    if as_json and as_markdown:
        raise UsageError(
            "give at most one of --json and --markdown", "Markdown is the default; drop one"
        )
    found = app.matrix(
        session(),
        {"sglang": sglang_spec, "flashinfer": flashinfer_spec, "vllm": vllm_spec},
        profiles,
        jobs,
        on_warning=lambda line: echo_err(f"sm120patch: warning: {line}"),
        progress_quiet=quiet,
        scan=scan,
    )
    show(render.matrix(found, as_json))
    if found.failed:
        sys.exit(1)


@main.command("scan")
@with_targets
@json_option
@click.option("--all", "all_", is_flag=True, help="List the upstream and kernel gates too.")
@click.option("--fail-on-candidate", is_flag=True, help="Exit 1 when a new candidate is found.")
@click.option("--known", metavar="FILE", help="A `scan --json` whose candidates are not new.")
def scan_cmd(sglang: str | None, flashinfer: str | None, known: str | None, **o: bool) -> None:
    """The GPU-arch gates that leave SM120 out, read from the sources (nothing is imported), by
    class. Given a path, only that target; else the ones installed in this Python."""
    found = app.scan(session(sglang, flashinfer), known)
    show(render.scan(found, as_json=o["as_json"], all_=o["all_"]))
    if o["fail_on_candidate"] and found.new_candidates():
        sys.exit(1)


@main.command("explain", context_settings={"ignore_unknown_options": True})
@with_targets
@click.option(
    "--python",
    "python",
    metavar="PATH",
    help="The interpreter the server runs in (default: the venv's python beside the target).",
)
@click.option(
    "--simulate",
    type=click.Choice(["sm120", "sm100", "sm90"]),
    help="Decide as on a GPU of this architecture instead of the real one.",
)
@click.option(
    "--profile",
    "profile",
    default=None,
    metavar="PROFILE",
    help="Where nothing is applied, the patched side is what this profile would write "
    "(default: all, which leaves out fp4-gemm and attention; with --vllm, the profile that "
    "patches vLLM where only one does).",
)
@json_option
@click.argument("launch", nargs=-1, type=click.UNPROCESSED)
def explain_cmd(
    sglang: str | None,
    flashinfer: str | None,
    python: str | None,
    simulate: str | None,
    profile: str | None,
    as_json: bool,
    launch: tuple[str, ...],
) -> None:
    """What upstream's own code decides, pristine vs patched, for `-- SGLANG LAUNCH ARGS`.

    Runs SGLang's server-argument resolution, the allreduce-fusion gate, _resolve_backend, the
    FP4 GEMM backend `auto` resolves to and FlashInfer's comm module flags in the target's
    interpreter: no weights, no server. With --vllm PATH: what vLLM's patches read there.
    """
    found = app.explain(session(sglang, flashinfer), python, simulate, launch, profile)
    if as_json:
        emit_json(found.to_dict())
        return
    show(render.explained(found, simulate))


render.describe(main)  # --help: the order of the work, a summary that fits, an example each
