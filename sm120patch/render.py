"""Results in words: each function turns one command's typed result into the lines it prints,
split into standard output (what a script would capture: a diff, a table) and standard error
(what is said about it). JSON documents come from each result's `to_dict`. Errors too: the
click group every command runs in prints a typed error as one line and what to do next (a
hint that pastes: the command's own paths and packs), JSON under --json, usage errors included."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from sm120patch.errors import Sm120Error
from sm120patch.terminal import colour_wanted as colour_wanted
from sm120patch.terminal import coloured as coloured
from sm120patch.terminal import error_doc as error_doc
from sm120patch.terminal import exhausted, path_options
from sm120patch.terminal import fallback_hint as fallback_hint
from sm120patch.terminal import hint_lines as hint_lines
from sm120patch.terminal import interrupt_notice as interrupt_notice
from sm120patch.terminal import json_asked as json_asked
from sm120patch.terminal import page_width as page_width
from sm120patch.terminal import pasteable as pasteable
from sm120patch.terminal import printable as printable
from sm120patch.terminal import run_tool as run_tool
from sm120patch.terminal import waiting as waiting

if TYPE_CHECKING:
    from sm120patch.app import DryRun, Matrix, Pinned, Shown, Trialled
    from sm120patch.engine.assess import FileState, TargetStatus
    from sm120patch.engine.reports import Report
    from sm120patch.engine.trialrecord import TrialRecord
    from sm120patch.explain.doctor import Examination
    from sm120patch.explain.explain import Explanation
    from sm120patch.patchkit.model import Outcome
    from sm120patch.plan.catalog import Catalog, Profile
    from sm120patch.plan.known import Entry
    from sm120patch.scan.run import Report as ScanReport


@dataclass
class Text:
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    # stdout text printed as it is, without a newline added (a diff)
    raw: str = ""


# The patch-id column: the longest id in the library (vllm.allreduce-fusion-oneshot) and a space.
PATCH_WIDTH = 30


def profiles(cat: Catalog, held: Mapping[str, list[str]] | None = None) -> Text:
    """`list`; `held`: per profile, why it is not recommended here (app.held_here)."""
    from sm120patch.patchkit.versions import range_text

    text = Text()
    held = held or {}
    width = max([len(p.name) for p in cat.profiles.values()] + [8])
    for p in cat.profiles.values():
        pins = ", ".join(f"{k} {range_text(v)}" for k, v in p.pins.items())
        origin = cat.profile_sources[p.name]
        where = "" if origin.built_in else f" (from {origin.name})"
        status = f"{p.status}, not here" if held.get(p.name) else p.status
        text.out.append(f"{p.name:{width}} [{status}] {p.title}{where}")
        text.out.append(f"{'':{width}} pins: {pins}")
        if p.refuse:
            refused = ", ".join(f"{r.kind} {range_text(r.releases)}" for r in p.refuse)
            text.out.append(f"{'':{width}} refuses (unless --force): {refused}")
        for why in held.get(p.name, []):
            text.out.append(f"{'':{width}} not recommended here: {why}")
        for pid in p.patches:
            row = cat.patches.rows[pid]  # the registry's row: no patch module imported
            where = "" if row.pack.built_in else f" (from {row.pack.name})"
            text.out.append(f"{'':{width}}   {pid:{PATCH_WIDTH}} {row.title}{where}")
    return text


def profiles_doc(cat: Catalog, held: Mapping[str, list[str]] | None = None) -> dict[str, Any]:
    from sm120patch.patchkit.versions import range_text

    held = held or {}
    return {
        "profiles": [
            {
                "name": p.name,
                "title": p.title,
                "status": p.status,
                "patches": list(p.patches),
                "pins": {k: range_text(v) for k, v in p.pins.items()},
                "refuses": [
                    {"kind": r.kind, "releases": range_text(r.releases), "reason": r.reason}
                    for r in p.refuse
                ],
                "source": cat.profile_sources[p.name].name,
                "not_recommended_here": held.get(p.name, []),
            }
            for p in cat.profiles.values()
        ],
        "patches": [
            {"id": p.id, "target": p.target, "title": p.title, "source": p.pack.name}
            for p in cat.patches.rows.values()
        ],
    }


def profile_doc(cat: Catalog, prof: Profile, known: Sequence[Entry] = ()) -> dict[str, Any]:
    """`show --json`: the profile as `list --json` has it, its patches in full and every known
    outcome about it."""
    [doc] = [p for p in profiles_doc(cat)["profiles"] if p["name"] == prof.name]
    return {
        **doc,
        "known_text": " ".join(prof.known.split()) if prof.known else None,
        **prof.ran_doc(),
        "patches": [
            {
                "id": patch.id,
                "target": patch.target,
                "title": patch.title,
                "source": cat.source(patch.id).name,
                "why": patch.why,
                "upstream": patch.upstream or None,
                "shapes": [str(shape) for shape in patch.shapes],
            }
            for patch in cat.patches_of(prof)
        ],
        "known": [
            {"id": e.id, "outcome": e.outcome, "evidence": e.evidence, "figure": e.figure,
             "measured": e.measured or None, "condition": e.condition, "date": e.date,
             "source": e.source, **e.ran_doc()}  # fmt: skip
            for e in known
        ],
    }


def profile(cat: Catalog, prof: Profile, known: Sequence[Entry] = (), width: int = 100) -> Text:
    """`show PROFILE`: first the summary (what it is, pins, refusals, one line per patch and
    per known outcome), then the profile's notes, each patch in full, and every known outcome
    about it in full with its quote (what the one-line known outcomes of `apply` and `doctor`
    point to); wrapped at `width`."""
    from sm120patch.patchkit.versions import range_text
    from sm120patch.terminal import wrapped

    patches = cat.patches_of(prof)
    lines = [f"{prof.name} [{prof.status}]: {prof.title}"]
    lines += [f"  pinned on {k} {range_text(v)}" for k, v in prof.pins.items()]
    lines += [f"  refuses {r.kind} {r.releases} (--force to apply anyway): {r.reason}"
              for r in prof.refuse]  # fmt: skip
    lines += [f"  patch {p.id}: {p.title}" for p in patches]
    lines += [f"  {e.line()}" for e in known]
    if prof.known:
        lines += ["", "About it: " + " ".join(prof.known.split())]
    lines += ["", prof.flag_sentence()] if prof.flag else []
    for patch in patches:
        lines.append("")
        lines.append(f"{patch.id} ({patch.target}, {cat.source(patch.id).name}): {patch.title}")
        lines.append("  why: " + patch.why)
        if patch.upstream:
            lines.append(f"  upstream: {patch.upstream}")
        if patch.wiring is not None:
            lines.append("  in the server log, ran: " + " | ".join(patch.wiring.ran))
            if patch.wiring.skipped:
                lines.append("  in the server log, skipped: " + " | ".join(patch.wiring.skipped))
        lines += [f"  - {shape}" for shape in patch.shapes]
    if known:
        lines += ["", f"Known outcomes about {prof.name}, in full:"]
        lines += [f"  {e.full()}" for e in known]
    return Text(out=[w for line in lines for w in wrapped(line, width)])


def outcomes(found: Sequence[Outcome]) -> list[str]:
    lines = []
    for o in found:
        where = f"{o.file}::{o.site}" if o.file else o.site
        lines.append(f"  {o.status.value:16} {o.patch:{PATCH_WIDTH}} {where}")
        if o.status.value in ("refused", "upstream", "not-applicable"):
            lines.append(f"  {'':16} {o.reason}")
        if getattr(o, "note", ""):
            lines.append(f"  {'':16} note: {o.note}")
    return lines


def report(found: Report) -> Text:
    """What an apply or ensure did: outcomes (stderr), notes and each target's files."""
    text = Text(err=outcomes(found.outcomes))
    text.out += found.notes
    for t in found.targets:
        if not t.files:
            continue
        where = f"on branch {t.branch}" if t.branch else "(pristine copies kept for revert)"
        text.out.append(
            f"{t.target.name} {t.target.version} at {t.target.root}: "
            f"{len(t.files)} file(s) patched {where}"
        )
    return text


def dry_run_warnings(found: DryRun) -> list[str]:
    """What a dry run warns of on stderr, with --json too (the Ansible module's check mode
    reads the GPU warning there)."""
    if found.gpu is not None and not found.gpu["has_sm120"]:
        return [
            f"warning: no SM120 GPU here ({found.gpu['summary']}); a real apply "
            "will refuse without --no-gpu-check"
        ]
    return []


def dry_run(found: DryRun) -> Text:
    """The apply minus the writes: the diff on stdout, what is said about it on stderr."""
    text = Text(err=dry_run_warnings(found))
    for tp in found.plan.targets:
        t = tp.target
        text.err.append(f"# {t.name} {t.version} ({t.layout}) at {t.root}")
    text.err += outcomes(found.plan.outcomes)
    text.err += found.prepared.notes
    if not found.prepared.nothing_to_do:
        text.raw = found.plan.diff()
    return text


def dry_run_doc(found: DryRun) -> dict[str, Any]:
    """The keys of `revert --dry-run --json` and `apply --json` for the same ideas: the
    `action` the apply would take, whether it would change files (`changed`), `dry_run`."""
    nothing = found.prepared.nothing_to_do or not found.plan.applies
    return {
        "action": "nothing-to-do" if nothing else "applied",
        "changed": not nothing,
        "dry_run": True,
        **found.plan.to_dict(),
        "nothing_to_do": found.prepared.nothing_to_do,
        "notes": found.prepared.notes,
        "gpu": found.gpu,
        "error": None,
    }


def applied(found: Report, profile: str, lock_path: str | None) -> Text:
    text = report(found)
    if found.action == "applied":
        text.out.append(
            f"applied {profile}; restart the server to use it. "
            f"Undo with `sm120patch revert {profile}`."
        )
    elif lock_path is not None:
        text.out.append(f"already exactly as {lock_path} says; nothing was changed")
    return text


def ensured(found: Report, what: str) -> Text:
    text = report(found)
    if found.action == "applied":
        text.out.append(f"ensured {what}: applied now; the trees are as wanted")
    else:
        text.out.append(f"ensured {what}: already as wanted; nothing was changed")
    return text


def reverted(found: Report) -> Text:
    text = Text()
    if found.dry_run:
        # As apply's dry run: stdout is the diff, what it says about it goes to stderr.
        text.err += found.notes
        for t in found.targets:
            if found.action == "reverted" and t.files:
                text.err.append(
                    f"{t.target.name} at {t.target.root}: the revert would restore "
                    f"{len(t.files)} file(s)"
                )
        text.raw = found.restores
        return text
    text.out += found.notes
    for t in found.targets:
        if found.action == "reverted" and t.files:
            kept = f"; branch {t.branch} kept" if t.branch else ""
            text.out.append(
                f"{t.target.name} at {t.target.root}: {len(t.files)} file(s) restored{kept}"
            )
    return text


def recovered(found: Report) -> Text:
    return Text(out=list(found.notes))


def _file_line(f: FileState) -> str:
    extra = ""
    if f.as_installed is True and f.state != "pristine":
        extra = " (matches the installed RECORD)"
    elif f.as_installed is False and f.state == "drifted":
        extra = " (matches neither what sm120patch wrote nor the installed RECORD)"
    elif f.as_installed is False and f.state == "pristine":
        extra = " (differs from the installed RECORD)"
    return f"    {f.state:9} {f.path}{extra}"


def status(found: list[TargetStatus]) -> Text:
    text = Text()
    if not found:
        text.out.append("no SGLang or FlashInfer found; pass --sglang / --flashinfer")
    for s in found:
        t = s.target
        text.out.append(f"{t.name} {t.version} ({t.layout}) at {t.root}: {s.state}")
        if t.version == "unknown":  # targets.UNKNOWN: why, and how to state it
            text.out.append(f"  version unknown: {t.version_source}")
        if s.state != "pristine":
            text.out.append(f"  {s.assessment.message}")
        text.out += ["  " + line for line in trial_lines(s.trials)]
        if s.profile is None or not (s.files or s.branch):
            continue  # a profile that needs nothing here: its message line says so, no header
        branch = f" on branch {s.branch} (base {s.base[:12]})" if s.branch and s.base else ""
        text.out.append(f"  profile {s.profile}{branch}")
        text.out += [_file_line(f) for f in s.files]
    return text


def status_exit(found: Sequence[TargetStatus]) -> int:
    """`status --check`: 0 when every target is as recorded (pristine, or applied with every
    touched file as written), 75 when a run was interrupted (`recover`), 1 otherwise (drifted,
    gone, replaced, missing) or when no target is found."""
    states = {str(s.state) for s in found}
    if not found:
        return 1
    if "unfinished" in states:
        return 75
    return 0 if states <= {"pristine", "applied"} else 1


def pinned(found: Pinned, profile: str) -> Text:
    versions = ", ".join(f"{k} {v}" for k, v in found.lock.versions.items())
    return Text(
        out=[f"wrote {found.output}: {profile} on {versions}, {len(found.lock.files)} file(s)"]
    )


# ---- trials ----------------------------------------------------------------------------------


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


# ---- doctor, explain, matrix ------------------------------------------------------------------


def doctor(found: Examination) -> Text:
    text = Text()
    gpus = found.gpus
    if gpus.problem or not gpus.gpus:
        text.out.append(f"GPUs: {gpus.summary()}")
    else:
        text.out.append(f"GPUs (driver {gpus.driver}, CUDA {gpus.cuda_driver}):")
        for g in gpus.gpus:
            mark = "SM120" if g.is_sm120 else "not SM120"
            text.out.append(f"  {g.describe()} ({mark})")
    for t in found.targets:
        text.out.append(f"{t['kind']}: {t['version']} ({t['layout']}) at {t['root']}")
        if t["version"] == "unknown":
            text.out.append(f"  version unknown: {t['version_source']}")
        text.out += [f"  {b['package']}: {b['state']}" for b in t.get("beside", ())]
    text.out += found.missing
    for p in found.profiles:
        text.out.append(f"profile {p.name} [{p.status}]: {p.verdict}")
        for o in p.outcomes:
            where = f"{o['file']}::{o['site']}" if o["file"] else o["site"]  # as `outcomes`
            text.out.append(f"  {o['status']:16} {o['patch']:{PATCH_WIDTH}} {where}")
        text.out += [f"  applied now on {root}" for root in p.applied_on]
        text.out += [f"  {p.flag}"] if p.flag else []
    for a in found.applied:
        if a.get("problem"):
            text.out.append(f"status: {a['problem']}")
    text.out += found.known
    text.out.append(found.recommendation)
    return text


def explained(found: Explanation, simulate: str | None) -> Text:
    text = Text()
    gpu = f"simulated {simulate.upper()}" if simulate else "this machine's GPU"
    text.out.append(f"# {gpu}, {found.python}")
    for t in found.targets:
        text.out.append(f"# {t['kind']} {t['version']} at {t['root']}")
    if found.launch:
        text.out.append(f"# launch: {' '.join(found.launch)}")
    side = "patched (on disk)" if found.applied else "patched (planned)"

    def cell(value: str, most: int = 56) -> str:
        return value if len(value) <= most else value[: most - 3] + "..."

    rows = [("", "pristine", side), *((k, cell(a), cell(b)) for k, a, b in found.rows())]
    width = max(len(r[0]) for r in rows)
    left = max(len(r[1]) for r in rows)
    for label, before, after in rows:
        mark = "  " if before == after or not label else "->"
        text.out.append(f"{label:{width}}  {before:{left}}  {mark} {after}")
    text.out += [f"note: {note}" for note in found.notes]
    return text


def matrix(found: Matrix, as_json: bool) -> Text:
    from sm120patch.maintain import matrix as planning

    if as_json:
        return Text(out=[planning.to_json(found.rows, [found.warning] if found.warning else [])])
    return Text(out=[planning.markdown(found.rows, found.profiles)])


def scan(found: ScanReport, *, as_json: bool, all_: bool) -> Text:
    """A scan: JSON for tools, else the gates by class (sm120patch.scan.report)."""
    from sm120patch.scan import report

    if as_json:
        import json

        return Text(out=[json.dumps(found.to_dict(), indent=2)])
    return Text(raw=report.text(found, all_=all_))


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


def paste(text: str) -> str:
    """`text` with each `sm120patch ...` in it completed with this command's paths, packs and
    kept flags."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    if root is None:
        return text
    argv = root.meta.get(ARGV_META, [])
    return pasteable(text, root.meta.get(PATHS_META, {}), root.obj or (), argv,
                     path_options(root.command))  # fmt: skip


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
        doc["commands"] = [line[len("  next: "):] for line in lines if line.startswith("  next: ")]
        emit_json(doc)
    sys.exit(error.exit_code)


ARGV_META, PATHS_META = "sm120patch.argv", "sm120patch.paths"  # argv; the targets given


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
    "apply": ("Apply a profile (--dry-run: the diff, nothing written)",
              "sm120patch apply moe --dry-run"),
    "status": ("Each target's state, from the bytes on disk (--check)",
               "sm120patch status --check"),
    "ensure": ("At service start: exactly as wanted, or exit 1",
               "sm120patch ensure --locked /etc/sm120patch.lock"),
    "revert": ("Put every touched file back, byte for byte", "sm120patch revert moe"),
    "recover": ("Finish an interrupted apply or revert", "sm120patch recover"),
    "pin": ("Write a lock file of the profile as applied here",
            "sm120patch pin moe -o /etc/sm120patch.lock"),
    "trial": ("Run a server under a profile; keep it only if it helps",
              "sm120patch trial moe --measure -- python -m sglang.launch_server ..."),
    "explain": ("What SGLang or vLLM decides, pristine against patched",
                "sm120patch explain --simulate sm120 -- --model-path M --tp 4"),
    "list": ("The profiles, their pins and patches", "sm120patch list"),
    "show": ("One profile in full, its known outcomes included", "sm120patch show moe --json"),
    "export": ("Write the patches as mail files (git am)", "sm120patch export moe -o patches/"),
    "scan": ("The arch gates that leave SM120 out", "sm120patch scan --json"),
    "matrix": ("Plan every profile on every release (maintainers)",
               "sm120patch matrix --sglang '>=0.5.23'"),
    "new-patch": ("Start a patch in a pack of your own",
                  "sm120patch new-patch my.site --target sglang --file F --function FN --pins P"),
}  # fmt: skip


def describe(group: click.Group) -> None:
    """--help in the order of the work: each command's summary and example (`HELP`), the
    group's order (`Group.list_commands`)."""
    for name, (summary, example) in HELP.items():
        command = group.commands[name]
        command.short_help = summary
        command.epilog = f"\b\nExample: {example}"  # \b: click keeps the line as it is
    if isinstance(group, Group):
        group.order = tuple(HELP)


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
