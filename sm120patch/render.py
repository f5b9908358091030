"""Results in words: each function turns one command's typed result into the lines it prints,
split into standard output (what a script would capture: a diff, a table) and standard error
(what is said about it). JSON documents come from each result's `to_dict`. Errors too: the
click group every command runs in prints a typed error as one line and what to do next (a
hint that pastes: the command's own paths and packs), JSON under --json, usage errors included.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from sm120patch.errors import Sm120Error

if TYPE_CHECKING:
    from sm120patch.app import DryRun, Matrix, Pinned, Shown, Trialled
    from sm120patch.engine.assess import FileState, TargetStatus
    from sm120patch.engine.reports import Report
    from sm120patch.engine.trialrecord import TrialRecord
    from sm120patch.explain.doctor import Examination
    from sm120patch.explain.explain import Explanation
    from sm120patch.patchkit.model import Outcome
    from sm120patch.plan.catalog import Catalog, Profile
    from sm120patch.scan.run import Report as ScanReport


def error_doc(
    message: str, hint: str, exit_code: int, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An error as `--json` prints it."""
    return {"error": message, "next": hint or None, "exit_code": exit_code, **(details or {})}


def json_asked(flag: bool, argv: Sequence[str]) -> bool:
    """--json given: its flag parsed, or in the words before `--` (a trial's command) when
    the command line failed to parse before the flag's callback ran."""
    return flag or "--json" in list(argv)[: ([*argv, "--"]).index("--")]


def fallback_hint(exit_code: int, verb: str | None) -> str:
    """What to do after an error that brings no hint of its own."""
    if exit_code == 2:
        return f"see `sm120patch {verb} --help`" if verb else "see `sm120patch --help`"
    return "`sm120patch status` shows the state of the trees"


# The commands whose --sglang/--flashinfer name targets (matrix's name release specifiers).
TARGET_VERBS = frozenset(
    {"apply", "revert", "ensure", "status", "recover", "doctor", "pin", "export", "explain",
     "trial"}
)  # fmt: skip
# ...and those that are no command without an argument (`sm120patch pin` names the tool's verb)
NEED_ARGUMENT = frozenset({"apply", "revert", "ensure", "pin", "export", "trial"})
_COMMAND = re.compile(r"`sm120patch((?: [^`]*)?)`")


def pasteable(text: str, paths: Mapping[str, str | None], packs: Sequence[str] = ()) -> str:
    """Every `sm120patch ...` in `text` as the user can paste it: with the --patches of the
    command it follows and, for a command on targets, its --sglang/--flashinfer paths (made
    absolute), where the words do not name them already."""
    import shlex

    def complete(match: re.Match[str]) -> str:
        words = match.group(1).split(" ")[1:]
        if not words or (len(words) == 1 and words[0] in NEED_ARGUMENT):
            return match.group(0)
        front = [w for d in packs for w in ("--patches", shlex.quote(os.path.abspath(d)))]
        if "--patches" in words:
            front = []
        targets = []
        if words[0] in TARGET_VERBS and "--help" not in words:
            for kind, path in paths.items():
                if path and f"--{kind}" not in words:
                    targets += [f"--{kind}", shlex.quote(os.path.abspath(path))]
        if "--" in words:  # a trial's own options go before its command
            at = words.index("--")
            words = [*words[:at], *targets, *words[at:]]
        else:
            words = [*words, *targets]
        return "`" + " ".join(["sm120patch", *front, *words]) + "`"

    return _COMMAND.sub(complete, text)


_DIFF_STYLES = (("+++", "bold"), ("---", "bold"), ("diff ", "bold"), ("@@", "cyan"),
                ("+", "green"), ("-", "red"))  # fmt: skip


def coloured(diff: str) -> str:
    """A unified diff with the colours of `git diff` (for a terminal): added lines green,
    removed red, hunk headers cyan, file headers bold."""
    out = []
    for line in diff.splitlines(True):
        style = next((s for prefix, s in _DIFF_STYLES if line.startswith(prefix)), None)
        if style is None:
            out.append(line)
            continue
        body, end = (line[:-1], "\n") if line.endswith("\n") else (line, "")
        out.append(
            click.style(body, bold=True) + end
            if style == "bold"
            else click.style(body, fg=style) + end
        )
    return "".join(out)


@dataclass
class Text:
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    # stdout text printed as it is, without a newline added (a diff)
    raw: str = ""


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
            source = cat.source(pid)
            where = "" if source.built_in else f" (from {source.name})"
            text.out.append(f"{'':{width}}   {pid:26} {cat.patches[pid].title}{where}")
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
            {"id": p.id, "target": p.target, "title": p.title, "source": cat.source(p.id).name}
            for p in cat.patches.values()
        ],
    }


def profile(cat: Catalog, prof: Profile) -> Text:
    from sm120patch.patchkit.versions import range_text

    text = Text()
    text.out.append(f"{prof.name} [{prof.status}]: {prof.title}")
    for k, v in prof.pins.items():
        text.out.append(f"  pinned on {k} {range_text(v)}")
    for r in prof.refuse:
        text.out.append(f"  refuses {r.kind} {r.releases} (--force to apply anyway): {r.reason}")
    if prof.known:
        text.out.append("  known: " + " ".join(prof.known.split()))
    for patch in cat.patches_of(prof):
        text.out.append("")
        text.out.append(f"{patch.id} ({patch.target}, {cat.source(patch.id).name}): {patch.title}")
        text.out.append("  why: " + patch.why)
        if patch.upstream:
            text.out.append(f"  upstream: {patch.upstream}")
        if patch.wiring is not None:
            text.out.append("  in the server log, ran: " + " | ".join(patch.wiring.ran))
            if patch.wiring.skipped:
                text.out.append("  in the server log, skipped: " + " | ".join(patch.wiring.skipped))
        for shape in patch.shapes:
            text.out.append(f"  - {shape}")
    return text


def outcomes(found: Sequence[Outcome]) -> list[str]:
    lines = []
    for o in found:
        where = f"{o.file}::{o.site}" if o.file else o.site
        lines.append(f"  {o.status.value:16} {o.patch:26} {where}")
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
    return {
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
        if s.profile is None:
            continue
        branch = f" on branch {s.branch} (base {s.base[:12]})" if s.branch and s.base else ""
        text.out.append(f"  profile {s.profile}{branch}")
        text.out += [_file_line(f) for f in s.files]
    return text


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
    text.out += found.missing
    for p in found.profiles:
        pins = {True: "inside its pins", False: "OUTSIDE its pins", None: "not checked"}
        text.out.append(f"profile {p.name} [{p.status}]: {pins[p.pinned]}")
        text.out += [f"  {problem}" for problem in p.problems]
        for o in p.outcomes:
            text.out.append(f"  {o['status']:16} {o['patch']:26} {o['file'] or ''}::{o['site']}")
    for a in found.applied:
        if a.get("profile"):
            text.out.append(f"applied now on {a['root']}: {a['profile']}")
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


# C0 and C1 control characters but tab and newline: a record read from a state directory, a
# server's log line or a path may hold terminal escapes (clear the screen, rewrite the line
# before it, set the title); a line the tool prints shows them as `\xNN`, never acts on them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(line: str) -> str:
    """`line` as text a terminal only shows: each control character written as `\\xNN`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line)


def paste(text: str) -> str:
    """`text` with each `sm120patch ...` in it completed with this command's paths and packs."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return pasteable(text, root.meta.get(PATHS_META, {}), root.obj or ()) if root else text


def fail(error: Sm120Error, as_json: bool, verb: str | None = None) -> None:
    """One line and what to do (every refusal has a next), and the same as JSON with --json."""
    hint = paste(error.hint or fallback_hint(error.exit_code, verb))
    click.echo(printable(f"sm120patch: {paste(error.message)}"), err=True)
    click.echo(printable(f"  next: {hint}"), err=True)
    if as_json:
        emit_json(error_doc(paste(error.message), hint, error.exit_code, error.details))
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
    stdout with --json); anything else is a bug (exit 4)."""

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
            line = f"sm120patch: internal error: {type(exc).__name__}: {exc}"
            click.echo(printable(line), err=True)
            click.echo(
                "  next: rerun with SM120PATCH_DEBUG=1 for the traceback and report it; "
                "`sm120patch status` shows the state of your trees",
                err=True,
            )
            sys.exit(4)
