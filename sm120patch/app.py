"""The command layer: one plain function per verb over a `Session`, in the manner of Alembic's
`command.py`. Each function does what its command does and returns a typed result; it never
prints (render.py turns results into text and JSON) and raises the typed errors of errors.py.

A `Session` is what every command shares: the targets named on the command line, each found
once (`targets`: the `Target` objects every verb of the engine is given, never a path it would
find again), the patch packs, the catalog loaded once with those packs, and one reading of the
GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch.errors import UnknownProfile, UsageError

if TYPE_CHECKING:
    from sm120patch.engine.apply import Prepared
    from sm120patch.engine.assess import TargetStatus
    from sm120patch.engine.reports import Report
    from sm120patch.engine.trialrecord import TrialRecord
    from sm120patch.explain.doctor import Examination
    from sm120patch.explain.explain import Explanation
    from sm120patch.maintain.matrix import Row
    from sm120patch.patchkit.newpatch import Written
    from sm120patch.plan.catalog import Catalog, Profile
    from sm120patch.plan.lockfile import Lock, PlanCheck
    from sm120patch.plan.mails import MailFile
    from sm120patch.plan.plans import Plan
    from sm120patch.scan.run import Report as ScanReport
    from sm120patch.targets import Target
    from sm120patch.targets.resolved import Resolved
    from sm120patch.trial.gpu import GpuInventory
    from sm120patch.trial.measure import MeasuredTrial
    from sm120patch.trial.serve import TrialResult

Lines = Callable[[str], None]


def on_interrupt(notice: Callable[[int, int], None]) -> None:
    """Have `notice(signal, count)` acknowledge each deferred SIGINT/SIGTERM/SIGHUP at once
    (it runs inside the signal handler)."""
    from sm120patch.engine import interrupts

    interrupts.notice = notice


@dataclass
class Session:
    """What one command works on: targets, packs, the catalog and the GPUs, resolved once."""

    sglang: str | None = None
    flashinfer: str | None = None
    packs: tuple[str, ...] = ()
    stated: dict[str, str] = field(default_factory=dict)  # --sglang-version, --flashinfer-version
    _gpus: GpuInventory | None = field(default=None, repr=False)
    verbose: bool = False  # the known outcomes in full, not one short line each
    vllm: str | None = None  # --vllm: looked for only when given (kinds.LOOKED_FOR)

    def __post_init__(self) -> None:
        from sm120patch import targets
        from sm120patch.plan import packdirs

        packdirs.use_packs(self.packs)  # also when empty: one process may run several commands
        targets.state_versions(self.stated)  # the same

    @property
    def paths(self) -> dict[str, str | None]:
        return {"sglang": self.sglang, "flashinfer": self.flashinfer, "vllm": self.vllm}

    @functools.cached_property
    def targets(self) -> Resolved:
        """The command's targets, each found on first use and then kept (a refusal too): what
        the verbs are given, so no command finds a target twice."""
        from sm120patch.targets.resolved import Resolved

        return Resolved(self.paths)

    def target(self, kind: str) -> Target:
        """The target of `kind` (at its path, or the one installed here); its refusal."""
        return self.targets.find(kind)

    @functools.cached_property
    def catalog(self) -> Catalog:
        from sm120patch.plan import catalog

        return catalog.load()

    def profile(self, name: str) -> Profile:
        return self.catalog.profile(name)

    def gpus(self) -> GpuInventory:
        """The GPUs, read once per command (starting NVML is a tenth of a second)."""
        if self._gpus is None:
            from sm120patch.trial import gpu

            self._gpus = gpu.read_gpus()
        return self._gpus

    def sm120_check(self, gpu_check: bool) -> Callable[[], None] | None:
        """The apply's precondition: an SM120 GPU here, unless the check is off."""
        if not gpu_check:
            return None
        from sm120patch.trial import gpu

        def check() -> None:
            gpu.require_sm120(self.gpus())

        return check

    def known_lines(self, profile: str | None, command: list[str] | None = None) -> list[str]:
        """The known outcomes and the trials measured here that match this box: one short
        line each and where the whole entries are, or the whole entries with `verbose`."""
        from sm120patch.trial import known

        found = known.lines(profile, self.targets, command or [], self.gpus,
                            verbose=self.verbose)  # fmt: skip
        return self._with_where_in_full(profile, found)

    def _with_where_in_full(self, profile: str | None, lines: list[str]) -> list[str]:
        """Short known lines end with the command that prints them in full (not with
        --verbose, which already did)."""
        if profile and not self.verbose and any(line.startswith("known: ") for line in lines):
            lines.append(f"known outcomes in full: `sm120patch show {profile}`")
        return lines

    def known_before_apply(self, profile: str, gpu_check: bool) -> list[str]:
        """The known outcomes and the trials measured here that match this box, for `apply`
        and its dry run: data the plan wing reads (`plan.known`) and the trials as recorded,
        never the trial wing. The GPUs are read only where the GPU check reads them anyway;
        unread, a GPU condition does not exclude an entry. Nothing is assessed here: the
        versions and trials are the targets' own, and the apply assesses each target once."""
        from sm120patch.engine import trials as recorded
        from sm120patch.errors import Sm120Error
        from sm120patch.plan import known

        try:
            found_here = self.targets.each()
            trials = recorded.recorded(found_here)
        except Sm120Error:  # the apply itself refuses in its own words
            found_here, trials = [], []
        found = self.gpus() if gpu_check else None
        box = known.Box(
            versions={t.kind: t.version for t in found_here},
            gpu_family=found.family if found else None,
            gpus=(len(found.gpus) or None) if found else None,
        )
        return self._with_where_in_full(
            profile, known.lines(profile, box, known.once_each(trials), verbose=self.verbose)
        )


# ---- lock files --------------------------------------------------------------------------


@dataclass(frozen=True)
class Locked:
    """The profile a command works on, and the lock it must reproduce (if any)."""

    profile: str
    lock: Lock | None = None
    lock_path: str | None = None
    check_plan: PlanCheck | None = None


def locked(profile: str | None, lock_path: str | None) -> Locked:
    """PROFILE and/or --locked LOCKFILE, read and checked against each other."""
    if not lock_path:
        if not profile:
            raise UsageError(
                "give a profile or --locked with a lock file",
                "`sm120patch list` shows the profiles; `sm120patch <again> moe` for the "
                "recommended one",
            )
        return Locked(profile)
    from sm120patch.plan import lockfile

    lock = lockfile.read(Path(lock_path))
    if profile and profile != lock.profile:
        raise UsageError(
            f"{lock_path} locks profile {lock.profile}, not {profile}",
            f"leave the profile out (the lock says {lock.profile}), or use a lock of {profile}",
        )
    return Locked(lock.profile, lock, lock_path, lockfile.check(lock, Path(lock_path)))


@contextlib.contextmanager
def _profile_of(want: Locked) -> Iterator[None]:
    """A profile the lock names that nothing here defines is said to come from the lock."""
    try:
        yield
    except UnknownProfile as exc:
        if want.lock_path is None or exc.name != want.profile:
            raise
        raise UsageError(
            f"lock file {want.lock_path} locks profile '{exc.name}', which neither this "
            "sm120patch nor its packs define",
            "`sm120patch list` shows the profiles here; a pack's profile needs its pack "
            "(--patches DIR)",
        ) from None


# ---- the verbs -----------------------------------------------------------------------------


def list_profiles(session: Session) -> Catalog:
    return session.catalog


def held_here(cat: Catalog) -> dict[str, list[str]]:
    """Per recommended profile, why not to recommend it with the SGLang and FlashInfer
    installed here: a release it refuses, or a wrong-output known entry about it that matches
    (no reading of the GPUs: `list` stays quick, and an unknown GPU does not exclude an entry)."""
    recommended = [p for p in cat.profiles.values() if p.status == "recommended"]
    if not recommended:
        return {}
    from sm120patch.plan import known, pins

    found = known.installed_targets()
    box = known.Box(versions={t.kind: t.version for t in found})
    shipped = known.entries()
    held = {}
    for p in recommended:
        why = pins.refusal_lines(p, found)
        why += [e.line() for e in known.condemning(p.name, box, shipped)]
        if why:
            held[p.name] = why
    return held


def profile_names(packs: tuple[str, ...]) -> list[str]:
    """The profiles' names, the packs' included (shell completion); none where a pack is
    broken: completion is no place for a traceback."""
    try:
        return list(Session(packs=packs).catalog.profiles)
    except Exception:
        return []


def show(session: Session, name: str) -> Profile:
    return session.profile(name)


def known_about(profile: str) -> list[Any]:
    """Every known outcome about `profile` (plan.known.Entry), whatever this box is."""
    from sm120patch.plan import known

    return known.about_profile(profile)


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

    with _profile_of(want):
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

    with _profile_of(want):
        for line in session.known_before_apply(want.profile, gpu_check):
            on_known(line)
        return applying.apply(want.profile, session.targets, force=force, lock=want.lock,
                              preconditions=session.sm120_check(gpu_check),
                              check_plan=want.check_plan)  # fmt: skip


def ensure(
    session: Session, want: Locked, *, force: bool, gpu_check: bool, apply_if_needed: bool,
    lock_wait: float = 0.0, on_wait: Callable[[Path], None] | None = None,
) -> Report:  # fmt: skip
    """`ensure`; a lock another run holds is waited for up to `lock_wait` seconds, `on_wait`
    told once (the CLI's line on stderr)."""
    from sm120patch.engine import ensure as ensuring
    from sm120patch.engine.store import Waiting

    with _profile_of(want):
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
    session: Session, profile: str | None, *, every: bool, force: bool, keep_branch: bool,
    dry_run: bool,
) -> Report:  # fmt: skip
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


def doctor(session: Session) -> Examination:
    from sm120patch.explain import doctor as examining

    return examining.examine(session.targets, verbose=session.verbose)


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


@dataclass(frozen=True)
class NewPatchRequest:
    patch_id: str
    target: str
    rel: str
    function: str
    pins: str
    keyword: str | None
    expect: str | None
    add: int | None
    profile: str | None
    directory: str
    force: bool


def new_patch(request: NewPatchRequest) -> Written:
    from sm120patch.patchkit import newpatch

    try:
        majors = tuple(int(x) for x in request.expect.split(",")) if request.expect else ()
    except ValueError:
        raise UsageError(
            f"--expect '{request.expect}' is not a list of integers", "e.g. --expect 9,10"
        ) from None
    spec = newpatch.NewPatch(
        request.patch_id, request.target, request.rel, request.function, request.pins,
        request.profile or "", request.keyword, majors, request.add,
    )  # fmt: skip
    from sm120patch.targets.files import write_output

    return newpatch.write(spec, Path(request.directory), write_output, force=request.force)


@dataclass
class Matrix:
    rows: list[Row]
    warning: str | None
    profiles: list[str] | None  # the columns asked for; None: every profile

    @property
    def failed(self) -> bool:
        return any(r.error for r in self.rows)


def matrix(
    session: Session,
    specs: Mapping[str, str | None],
    profiles: tuple[str, ...],
    jobs: int | None,
    *,
    on_warning: Lines,
    progress_quiet: bool,
    scan: bool = False,
) -> Matrix:
    """Every profile on every release matching `specs` (kind -> PEP 440 specifier, '' for the
    tracked range, or None: not named); with `scan`, each release's candidate gates and those
    new since the previous release."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from sm120patch.maintain import matrix as planning
    from sm120patch.maintain.progress import Progress

    for name in profiles:
        session.profile(name)
    # The kinds named; none named: SGLang and FlashInfer (vLLM only when named, as everywhere).
    chosen: dict[str, str | None] = {k: s for k, s in specs.items() if s is not None}
    if not chosen:
        chosen = {"sglang": None, "flashinfer": None}
    for kind, spec in chosen.items():
        try:
            SpecifierSet(spec or "")
        except InvalidSpecifier:
            raise UsageError(
                f"--{kind} {spec!r} is not a PEP 440 specifier",
                f"e.g. --{kind} '>=0.5.8' or --{kind} '==0.5.10.post1'",
            ) from None
    progress = Progress(quiet=progress_quiet)
    with progress.phase("reading the release index", len(chosen)):
        selection = planning.releases_for(chosen, progress=progress.advance)
    warning = selection.warning()
    if warning:
        on_warning(warning)
    work = selection.work
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    with progress.phase("planning releases", len(work)):
        rows = planning.run(
            work,
            jobs,
            progress=lambda row: progress.advance(f"{row.kind} {row.version}"),
            scan=scan,
        )
    return Matrix(rows, warning, list(profiles) or None)


def scan(session: Session, known: str | None = None) -> ScanReport:
    """The GPU-arch gates of the session's targets, each classified (nothing is imported);
    `known`: an earlier `scan --json` whose candidates are not new."""
    import json

    from sm120patch import safeio
    from sm120patch.scan import run as scanning

    seen = None
    if known is not None:
        try:
            raw = safeio.read_named(Path(known), "--known file")
            seen = scanning.known_candidates(json.loads(raw.decode("utf-8")))
        except RecursionError:
            raise UsageError(f"--known {known}: nested too deep to be a scan",
                             "give the output of `sm120patch scan --json`") from None  # fmt: skip
        except (OSError, ValueError) as exc:
            raise UsageError(
                f"--known {known}: {exc}", "give the output of `sm120patch scan --json`"
            ) from None
    found = scanning.scan(session.targets, catalog=session.catalog)
    found.known = seen
    return found


def explain(
    session: Session,
    python: str | None,
    simulate: str | None,
    launch: tuple[str, ...],
    profile: str | None = None,
) -> Explanation:
    """Pristine against patched; where nothing is applied the patched side is `profile`'s."""
    from sm120patch.explain import explain as explaining

    return explaining.explain(
        session.targets, python=python, simulate=simulate, launch=launch, profile=profile
    )


# ---- trial ---------------------------------------------------------------------------------


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
    """trial.measure.Options from the request and the --measure options (`min_gain` in
    percent, as the command line takes it)."""
    from sm120patch.trial import measure as measuring

    return measuring.Options(
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
    """Apply, run the command, judge, keep or revert. `measure` (trial.measure.Options) makes
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
            write_outcome_record(measured.record(), Path(str(request.record_path)))
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
        write_outcome_record(found, Path(record_path))
    return Shown(found, html_path, record_path)


def trial_forget(session: Session, trial_ids: Sequence[str], *, everything: bool) -> list[str]:
    """Remove recorded trials (IDs or unique prefixes, or every one) from every target; the
    ids removed."""
    from sm120patch.trial import known

    if everything and trial_ids:
        raise UsageError("give trial IDs or --all, not both")
    return known.forget(session.targets, list(trial_ids), everything=everything)


def write_outcome_record(trial: TrialRecord, path: Path) -> None:
    """A trial as one known.toml record."""
    from sm120patch.targets.files import write_output  # never through a link at its name
    from sm120patch.trial import known

    write_output(path, known.outcome_record(trial))
