"""The commands on a tree, `apply`, `ensure`, `revert`, `status`, `recover`, `pin` and
`export`: their options, the verb each calls (`sm120patch/commands/tree.py`) and what each
prints of its result."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from sm120patch import app, render
from sm120patch.cmdline.options import (
    complete_profile,
    json_option,
    locked_option,
    session,
    verbose_option,
    with_targets,
)
from sm120patch.commands import tree as verbs
from sm120patch.render import PATCH_WIDTH, Text, echo_err, echo_out, emit_json, pasted, quiet, show

if TYPE_CHECKING:
    from sm120patch.commands.tree import DryRun, Pinned
    from sm120patch.engine.assess import FileState, TargetStatus
    from sm120patch.engine.reports import Report
    from sm120patch.patchkit.model import Outcome

# ---- what each prints --------------------------------------------------------------------


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


def dry_run_text(found: DryRun) -> Text:
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
        if s.trials:  # the trial family's words, loaded only where there is a trial to show
            from sm120patch.cmdline.trial import trial_lines

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


# ---- the commands ------------------------------------------------------------------------


@click.command("apply")
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
    targets: app.Named,
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
    s = session(targets, verbose=verbose)
    want = app.locked(profile, locked)
    known = quiet if as_json else (pasted(echo_err) if dry_run else pasted(echo_out))
    if dry_run:
        found = verbs.apply_dry_run(
            s, want, force=force, gpu_check=not no_gpu_check, on_known=known
        )
        if as_json:
            show(Text(err=dry_run_warnings(found)))
            emit_json(dry_run_doc(found))
        else:
            show(dry_run_text(found))
        return
    report = verbs.apply(s, want, force=force, gpu_check=not no_gpu_check, on_known=known)
    if as_json:
        emit_json(report.to_dict())
        return
    show(applied(report, want.profile, want.lock_path))


@click.command("ensure")
@click.argument("profile", required=False, shell_complete=complete_profile)
@with_targets
@locked_option
@click.option("--force", is_flag=True, help="Allow versions outside the profile's pins.")
@click.option("--no-gpu-check", is_flag=True, help="Skip the SM120 GPU precondition.")
@click.option(
    "--no-apply",
    is_flag=True,
    help="Only verify: exit 1 unless already exactly as wanted (never writes).",
)
@click.option(
    "--lock-wait",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    metavar="SECONDS",
    help="Wait this long for another run's lock (two services "
    "sharing a venv), then decide from the bytes; 0 refuses at once.",
)
@json_option
def ensure_cmd(
    profile: str | None,
    targets: app.Named,
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
    report = verbs.ensure(
        session(targets),
        want,
        force=force,
        gpu_check=not no_gpu_check,
        apply_if_needed=not no_apply,
        lock_wait=lock_wait,
        on_wait=render.waiting(lock_wait),
    )
    if as_json:
        emit_json(report.to_dict())
        return
    show(ensured(report, f"{locked}" if locked else f"profile {want.profile}"))


@click.command("revert")
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
    targets: app.Named,
    force: bool,
    keep_branch: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Revert PROFILE, or --all: every touched file back byte for byte."""
    report = verbs.revert(
        session(targets),
        profile,
        every=all_,
        force=force,
        keep_branch=keep_branch,
        dry_run=dry_run,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    show(reverted(report))


@click.command("status")
@with_targets
@click.option(
    "--check",
    is_flag=True,
    help="Exit 0 only when every target is as recorded (pristine or applied): 1 when one is "
    "drifted, gone, replaced or missing or none is found, 75 when one is unfinished.",
)
@json_option
def status_cmd(targets: app.Named, check: bool, as_json: bool) -> None:
    """The state of each target, decided from the bytes on disk, and of every touched file."""
    found = verbs.status(session(targets))
    code = status_exit(found) if check else 0
    if as_json:
        emit_json({"targets": [s.to_dict() for s in found], "exit_code": code})
    else:
        show(status(found))
    if code:
        sys.exit(code)


@click.command("recover")
@with_targets
@json_option
def recover_cmd(targets: app.Named, as_json: bool) -> None:
    """Finish an interrupted apply (roll back) or revert (roll forward)."""
    report = verbs.recover(session(targets))
    if as_json:
        emit_json(report.to_dict())
        return
    show(recovered(report))


@click.command("pin")
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
def pin_cmd(profile: str, targets: app.Named, output: str, force: bool) -> None:
    """Write a lock file freezing versions, file hashes and each patch's diff of PROFILE here."""
    show(pinned(verbs.pin(session(targets), profile, output, force=force), profile))


@click.command("export")
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
    targets: app.Named,
    out_dir: str,
    force: bool,
    overwrite: bool,
) -> None:
    """Write one mail-format patch per applied patch per target (for git am / git apply)."""
    written = verbs.write_patch_mails(
        session(targets), profile, out_dir, force=force, overwrite=overwrite
    )
    for item in written:
        echo_out(f"{item.target}: {item.path}")
