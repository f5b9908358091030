"""What `trial` does: run a server under a profile and keep the patch only if it helps
(`trial`), and the trials recorded (`trial_show`, `trial_forget`). Nothing here prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch.app import Lines, Session
from sm120patch.errors import UsageError

if TYPE_CHECKING:
    from sm120patch.engine.trialrecord import TrialRecord
    from sm120patch.plan.catalog import Catalog
    from sm120patch.trial.measured import MeasuredTrial
    from sm120patch.trial.serve import TrialResult


@dataclass(frozen=True)
class TrialRequest:
    """What `trial PROFILE -- COMMAND` runs, however it is judged."""

    profile: str
    command: tuple[str, ...]
    ready_url: str | None = None
    ready_pattern: str | None = None
    timeout: float = 600.0
    log_path: str | None = None
    force: bool = False
    gpu_check: bool = True
    # a crash trial only
    leave_running: bool = False
    sample_power: bool = False
    # a measured trial only
    record_path: str | None = None


def measure_options(request: TrialRequest, *, min_gain: float, **measured: Any) -> Any:
    """trial.measured.Options from the request and the --measure options (`min_gain` in
    percent, as the command line takes it)."""
    from sm120patch.trial.measured import Options

    return Options(
        ready_url=request.ready_url,
        ready_pattern=request.ready_pattern,
        timeout=request.timeout,
        min_gain=min_gain / 100,
        **measured,
    )


@dataclass
class Trialled:
    """A trial run: the crash trial's result or the measured trial."""

    result: TrialResult | None = None
    measured: MeasuredTrial | None = None
    # whether --export wrote the record (only a trial that is evidence is exported)
    record_written: bool = False


def trial(
    session: Session,
    request: TrialRequest,
    measure: Any | None,
    *,
    on_known: Lines,
    on_line: Lines,
    on_event: Lines,
    on_progress: Lines | None = None,
) -> Trialled:
    """Apply, run the command, judge, keep or revert. `measure` (trial.measured.Options) makes
    it an A/B measurement. The known outcomes go to `on_known` before anything runs;
    `on_progress` hears a line every few seconds while a server is not ready. A measured trial
    is exported (`record_path`) only when it is evidence; one that found nothing answering at
    the API is the error TrialUnreachable (exit 8), its record in the error's JSON."""
    from sm120patch.trial import serve

    def on_wait(elapsed: float, last: str | None) -> None:
        if on_progress is not None:
            on_progress(f"sm120patch: {serve.waiting_line(elapsed, last)}")

    if request.record_path and measure is None:
        raise UsageError(
            "--export needs --measure",
            "add --measure, or export the latest recorded trial: "
            f"`sm120patch trial show --export {request.record_path}`",
        )
    for line in session.known_lines(request.profile, list(request.command)):
        on_known(line)
    log_path = Path(request.log_path) if request.log_path else None
    if measure is not None:
        from sm120patch.trial import measure as measuring

        measured = measuring.run(
            request.profile,
            session.targets,
            list(request.command),
            measure,
            force=request.force,
            preconditions=session.sm120_check(request.gpu_check),
            log_path=log_path,
            on_line=on_line,
            on_event=on_event,
            on_wait=on_wait if on_progress else None,
        )
        if measured.verdict == "unreachable":
            raise measured.unreachable(with_record=True)
        written = bool(request.record_path) and measured.evidence
        if written:
            write_outcome_record(measured.record(), Path(str(request.record_path)), session.catalog)
        return Trialled(measured=measured, record_written=written)
    result = serve.run(
        request.profile,
        session.targets,
        list(request.command),
        ready_url=request.ready_url,
        ready_pattern=request.ready_pattern,
        timeout=request.timeout,
        leave_running=request.leave_running,
        sample_power=request.sample_power,
        log_path=log_path,
        force=request.force,
        preconditions=session.sm120_check(request.gpu_check),
        on_line=on_line,
        on_wait=on_wait if on_progress else None,
    )
    return Trialled(result=result)


@dataclass
class Shown:
    trial: TrialRecord
    html_path: str | None
    record_path: str | None


def trial_show(
    session: Session, trial_id: str | None, html_path: str | None, record_path: str | None
) -> Shown:
    from sm120patch.trial import known, report

    found = known.find_trial(known.history(session.targets), trial_id)
    if html_path:
        from sm120patch.targets.files import write_output  # never through a link at its name

        write_output(html_path, report.html(found))
    if record_path:
        write_outcome_record(found, Path(record_path), session.catalog)
    return Shown(found, html_path, record_path)


def trial_forget(session: Session, trial_ids: Sequence[str], *, everything: bool) -> list[str]:
    """Remove recorded trials (IDs or unique prefixes, or every one) from every target; the
    ids removed."""
    from sm120patch.trial import known

    if everything and trial_ids:
        raise UsageError("give trial IDs or --all, not both")
    return known.forget(session.targets, list(trial_ids), everything=everything)


def write_outcome_record(trial: TrialRecord, path: Path, cat: Catalog) -> None:
    """A trial as one known.toml record (its profile's engine and kernel from `cat`)."""
    from sm120patch.targets.files import write_output  # never through a link at its name
    from sm120patch.trial import known

    write_output(path, known.outcome_record(trial, cat))
