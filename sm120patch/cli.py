"""The command line: parse, call the library, render. Nothing else lives here.

Exit codes (README): 0 success, 1 refused or precondition failed (nothing changed), 2 usage,
3 a trial crashed and was reverted, 4 internal error.
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
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def with_targets(fn: F) -> F:
    for option in reversed(target_options):
        fn = option(fn)
    return fn


def fail(error: Sm120Error) -> None:
    click.echo(f"sm120patch: {error.message}", err=True)
    if error.hint:
        click.echo(f"  next: {error.hint}", err=True)
    sys.exit(error.exit_code)


def handled(fn: F) -> F:
    """Typed errors become one line plus what to do; anything else is a bug (exit 4)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Sm120Error as exc:
            fail(exc)
        except KeyboardInterrupt:
            click.echo("sm120patch: interrupted", err=True)
            click.echo("  next: `sm120patch status` says if `recover` is needed", err=True)
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
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

    return wrapper  # type: ignore[return-value]


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sm120patch")
def main() -> None:
    """Apply, review and revert the patches that enable SGLang and FlashInfer fast paths on
    NVIDIA SM120 GPUs (RTX PRO 6000, RTX 5090)."""


@main.command("list")
@json_option
@handled
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
                    }
                    for p in cat.profiles.values()
                ],
                "patches": [
                    {"id": p.id, "target": p.target, "title": p.title} for p in cat.patches.values()
                ],
            }
        )
        return
    for p in cat.profiles.values():
        pins = ", ".join(f"{k} {v}" for k, v in p.pins.items())
        click.echo(f"{p.name:8} [{p.status}] {p.title}")
        click.echo(f"{'':8} pins: {pins}")
        for pid in p.patches:
            click.echo(f"{'':8}   {pid:26} {cat.patches[pid].title}")


@main.command("show")
@click.argument("profile")
@handled
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
        click.echo(f"\n{patch.id} ({patch.target}): {patch.title}")
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


@main.command("apply")
@click.argument("profile", required=False)
@with_targets
@click.option("--dry-run", is_flag=True, help="Print the unified diff and change nothing.")
@click.option(
    "--locked",
    "locked",
    metavar="LOCKFILE",
    type=click.Path(dir_okay=False),
    help="Apply exactly what this lock file (from `pin`) records, or refuse.",
)
@click.option("--force", is_flag=True, help="Apply outside the profile's pinned versions.")
@click.option(
    "--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition (image builds, CI)."
)
@json_option
@handled
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
    from pathlib import Path

    from sm120patch.errors import UsageError

    paths = {"sglang": sglang, "flashinfer": flashinfer}
    check_plan = None
    if locked:
        from sm120patch import lockfile

        lock = lockfile.read(Path(locked))
        if profile and profile != lock.profile:
            raise UsageError(f"{locked} locks profile {lock.profile}, not {profile}")
        profile = lock.profile
        check_plan = lockfile.check(lock, Path(locked))
    if not profile:
        raise UsageError("give a PROFILE (see `sm120patch list`) or --locked LOCKFILE")
    if dry_run:
        from sm120patch import plan as planner
        from sm120patch.plan import PlanRefused

        plan = planner.plan(profile, paths, force=force)
        if not no_gpu_check:
            from sm120patch import gpu

            found = gpu.probe()
            if not found.has_sm120:
                click.echo(
                    f"warning: no SM120 GPU here ({found.summary()}); a real apply "
                    "will refuse without --no-gpu-check",
                    err=True,
                )
        if as_json:
            emit_json(plan.to_dict())
        else:
            for tp in plan.targets:
                t = tp.target
                click.echo(f"# {t.name} {t.version} ({t.layout}) at {t.root}", err=True)
            render_outcomes(plan.outcomes)
            click.echo(plan.diff(), nl=False)
        if plan.refused:
            raise PlanRefused(plan)
        if check_plan is not None:
            check_plan(plan)
        return
    from sm120patch import engine, gpu

    report = engine.apply(
        profile,
        paths,
        force=force,
        preconditions=None if no_gpu_check else gpu.require_sm120,
        check_plan=check_plan,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    render_outcomes(report.outcomes)
    for note in report.notes:
        click.echo(note)
    for t in report.targets:
        where = f"on branch {t.branch}" if t.branch else "(pristine copies kept for revert)"
        click.echo(
            f"{t.target.name} {t.target.version} at {t.target.root}: "
            f"{len(t.files)} file(s) patched {where}"
        )
    if report.action == "applied":
        click.echo(
            f"applied {profile}; restart the server to use it. "
            f"Undo with `sm120patch revert {profile}`."
        )


@main.command("revert")
@click.argument("profile", required=False)
@click.option("--all", "all_", is_flag=True, help="Revert whatever sm120patch applied.")
@with_targets
@click.option("--force", is_flag=True, help="Discard your edits to patched files.")
@click.option("--keep-branch", is_flag=True, help="Keep the sm120patch/<profile> branch.")
@json_option
@handled
def revert_cmd(
    profile: str | None,
    all_: bool,
    sglang: str | None,
    flashinfer: str | None,
    force: bool,
    keep_branch: bool,
    as_json: bool,
) -> None:
    """Revert PROFILE, or --all: every touched file back byte for byte."""
    from sm120patch import engine
    from sm120patch.errors import UsageError

    if bool(profile) == all_:
        raise UsageError("give exactly one of PROFILE or --all")
    report = engine.revert(
        None if all_ else profile,
        {"sglang": sglang, "flashinfer": flashinfer},
        force=force,
        keep_branch=keep_branch,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    for t in report.targets:
        kept = f"; branch {t.branch} kept" if t.branch else ""
        click.echo(f"{t.target.name} at {t.target.root}: {len(t.files)} file(s) restored{kept}")


@main.command("status")
@with_targets
@json_option
@handled
def status_cmd(sglang: str | None, flashinfer: str | None, as_json: bool) -> None:
    """What sm120patch applied on each target, and the state of every touched file."""
    from sm120patch import engine

    found = engine.status({"sglang": sglang, "flashinfer": flashinfer})
    if as_json:
        emit_json({"targets": [s.to_dict() for s in found]})
        return
    if not found:
        click.echo("no SGLang or FlashInfer found; pass --sglang / --flashinfer")
    for s in found:
        t = s.target
        click.echo(f"{t.name} {t.version} ({t.layout}) at {t.root}")
        if s.unfinished:
            click.echo(f"  UNFINISHED {s.unfinished}: run `sm120patch recover`")
        for trial in s.trials[-5:]:
            click.echo(
                f"  trial {trial.get('profile')}: {trial.get('verdict')}, "
                f"exit {trial.get('exit_code')}: {' '.join(trial.get('command', []))}"
            )
        if s.profile is None:
            click.echo("  nothing applied")
            continue
        branch = f" on branch {s.branch} (base {s.base[:12]})" if s.branch and s.base else ""
        click.echo(f"  profile {s.profile}{branch}")
        for f in s.files:
            click.echo(f"    {f['state']:9} {f['path']}")


@main.command("recover")
@with_targets
@json_option
@handled
def recover_cmd(sglang: str | None, flashinfer: str | None, as_json: bool) -> None:
    """Finish an interrupted apply (roll back) or revert (roll forward)."""
    from sm120patch import engine

    report = engine.recover({"sglang": sglang, "flashinfer": flashinfer})
    if as_json:
        emit_json(report.to_dict())
        return
    for note in report.notes:
        click.echo(note)


@main.command("trial", context_settings={"ignore_unknown_options": True})
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
@json_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@handled
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
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Apply PROFILE, run COMMAND (after --), keep the patch if it gets ready, else revert.

    Exit 3 when the command crashed or never got ready (the profile is then reverted).
    """
    from pathlib import Path

    from sm120patch import gpu, trial

    result = trial.run(
        profile,
        {"sglang": sglang, "flashinfer": flashinfer},
        list(command),
        ready_url=ready_url,
        ready_pattern=ready_pattern,
        timeout=timeout,
        leave_running=leave_running,
        sample_power=sample_power,
        log_path=Path(log_path) if log_path else None,
        force=force,
        preconditions=None if no_gpu_check else gpu.require_sm120,
        on_line=lambda line: click.echo(line, err=as_json),
    )
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
@handled
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
@handled
def pin_cmd(
    profile: str, sglang: str | None, flashinfer: str | None, output: str, force: bool
) -> None:
    """Write a lock file freezing versions, patch digests and file hashes of PROFILE here."""
    from pathlib import Path

    from sm120patch import lockfile
    from sm120patch import plan as planner
    from sm120patch.errors import Refused

    plan = planner.checked(profile, {"sglang": sglang, "flashinfer": flashinfer}, force=force)
    lock = lockfile.from_plan(plan)
    if not lock.files:
        raise Refused(
            f"profile {profile} changes no file here (already applied?)",
            "pin on trees where the profile is not applied yet",
        )
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
@handled
def export_cmd(
    profile: str, sglang: str | None, flashinfer: str | None, out_dir: str, force: bool
) -> None:
    """Write one mail-format patch per applied patch per target (for git am / git apply)."""
    from pathlib import Path

    from sm120patch import export
    from sm120patch import plan as planner

    plan = planner.checked(profile, {"sglang": sglang, "flashinfer": flashinfer}, force=force)
    for item in export.write(plan, Path(out_dir)):
        click.echo(f"{item.target}: {item.path}")


@main.command("matrix")
@click.option(
    "--sglang",
    "sglang_spec",
    metavar="SPEC",
    help="SGLang releases to plan, a PEP 440 specifier (e.g. '>=0.5.8').",
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
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--markdown", "as_markdown", is_flag=True, help="Print Markdown tables (default).")
@handled
def matrix_cmd(
    sglang_spec: str | None,
    flashinfer_spec: str | None,
    profiles: tuple[str, ...],
    jobs: int | None,
    as_json: bool,
    as_markdown: bool,
) -> None:
    """Plan every profile on every SGLang and FlashInfer release from PyPI: outcome per site."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from sm120patch import catalog, matrix
    from sm120patch.errors import UsageError

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
    jobs = jobs or os.cpu_count() or 1
    work = matrix.releases_for(specs)
    if sys.stderr.isatty():
        with click.progressbar(length=len(work), label="planning releases", file=sys.stderr) as bar:

            def tick(row: Any) -> None:
                bar.update(1, current_item=f"{row.kind} {row.version}")

            rows = matrix.run(work, jobs, progress=tick)
    else:
        rows = matrix.run(work, jobs)
    chosen = list(profiles) or None
    click.echo(matrix.to_json(rows) if as_json else matrix.markdown(rows, chosen), nl=not as_json)
    if any(r.error for r in rows):
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
@handled
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
