"""What the commands on a tree do: `apply` (and its dry run), `ensure`, `revert`, `status`,
`recover`, `pin` and `export`, each one plain function over an `app.Session` returning a typed
result. Nothing here prints."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch.app import Lines, Locked, Session, profile_of
from sm120patch.errors import UsageError

if TYPE_CHECKING:
    from sm120patch.engine.apply import Prepared
    from sm120patch.engine.assess import TargetStatus
    from sm120patch.engine.reports import Report
    from sm120patch.plan.lockfile import Lock
    from sm120patch.plan.mails import MailFile
    from sm120patch.plan.plans import Plan


@dataclass
class DryRun:
    """`apply --dry-run`: what the apply would do, refused exactly as it would refuse."""

    prepared: Prepared
    plan: Plan
    gpu: dict[str, Any] | None  # None when the GPU check is off


def apply_dry_run(
    session: Session, want: Locked, *, force: bool, gpu_check: bool, on_known: Lines
) -> DryRun:
    """The known outcomes go to `on_known` before anything is decided (a refusal follows
    them)."""
    from sm120patch.engine import apply

    with profile_of(want):
        for line in session.known_before_apply(want.profile, gpu_check):
            on_known(line)
        prep = apply.dry_run(
            want.profile, session.targets, force=force, check_plan=want.check_plan, lock=want.lock
        )
    gpu_doc = None
    if gpu_check:
        found = session.gpus()
        gpu_doc = {"has_sm120": found.has_sm120, "summary": found.summary()}
    assert prep.plan is not None  # a dry run always plans (or refuses)
    return DryRun(prep, prep.plan, gpu_doc)


def apply(
    session: Session, want: Locked, *, force: bool, gpu_check: bool, on_known: Lines
) -> Report:
    from sm120patch.engine import apply as applying

    with profile_of(want):
        for line in session.known_before_apply(want.profile, gpu_check):
            on_known(line)
        return applying.apply(
            want.profile,
            session.targets,
            force=force,
            lock=want.lock,
            preconditions=session.sm120_check(gpu_check),
            check_plan=want.check_plan,
        )


def ensure(
    session: Session,
    want: Locked,
    *,
    force: bool,
    gpu_check: bool,
    apply_if_needed: bool,
    lock_wait: float = 0.0,
    on_wait: Callable[[Path], None] | None = None,
) -> Report:
    """`ensure`; a lock another run holds is waited for up to `lock_wait` seconds, `on_wait`
    told once (the CLI's line on stderr)."""
    from sm120patch.engine import ensure as ensuring
    from sm120patch.engine.store import Waiting

    with profile_of(want):
        return ensuring.ensure(
            want.profile,
            session.targets,
            force=force,
            preconditions=session.sm120_check(gpu_check),
            check_plan=want.check_plan,
            lock=want.lock,
            apply_if_needed=apply_if_needed,
            wait=Waiting(lock_wait, on_wait) if lock_wait > 0 else None,
        )


def revert(
    session: Session,
    profile: str | None,
    *,
    every: bool,
    force: bool,
    keep_branch: bool,
    dry_run: bool,
) -> Report:
    """`revert PROFILE` or `revert --all` (`every`); with `dry_run` only what it would do."""
    from sm120patch.engine import revert as reverting

    if bool(profile) == every:
        raise UsageError(
            "give exactly one of a profile or --all",
            "`sm120patch status` shows what is applied",
        )
    name = None if every else profile
    if dry_run:
        return reverting.revert_dry_run(name, session.targets, force=force)
    return reverting.revert(name, session.targets, force=force, keep_branch=keep_branch)


def status(session: Session) -> list[TargetStatus]:
    from sm120patch.engine import assess

    return assess.status(session.targets)


def recover(session: Session) -> Report:
    from sm120patch.engine import recover as recovering

    return recovering.recover(session.targets)


@dataclass(frozen=True)
class Pinned:
    lock: Lock
    output: str


def pin(session: Session, profile: str, output: str, *, force: bool) -> Pinned:
    from sm120patch.engine import pin as pinning
    from sm120patch.targets.files import write_output  # never through a link at its name

    if not force and os.path.lexists(output):
        # As `export` keeps the patches already in its directory: a lock is a fleet's record.
        raise UsageError(
            f"{output} exists; nothing was written",
            f"`sm120patch pin {profile} -o {shlex.quote(output)} --force` replaces it",
        )
    lock = pinning.make(profile, session.targets, force=force)
    write_output(output, lock.to_toml())
    return Pinned(lock, output)


def write_patch_mails(
    session: Session, profile: str, out_dir: str, *, force: bool, overwrite: bool
) -> list[MailFile]:
    from sm120patch.engine import pristine
    from sm120patch.plan import mails

    # On a reference box the profile is usually applied: planned from the pristine side.
    plan = pristine.plan_from_pristine(profile, session.targets, force=force)
    return mails.write_mails(plan, Path(out_dir), overwrite=overwrite)
