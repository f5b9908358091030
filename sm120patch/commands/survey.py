"""What the commands that read, and write nothing into a tree, do: `doctor` (this box),
`explain` (what upstream's code decides), `scan` (the arch gates of a tree) and `matrix` (every
profile on every release). Nothing here prints."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch.app import Lines, Session
from sm120patch.errors import UsageError

if TYPE_CHECKING:
    from sm120patch.explain.doctor import Examination
    from sm120patch.explain.explain import Explanation
    from sm120patch.maintain.matrix import Row
    from sm120patch.scan.run import Report as ScanReport


def doctor(session: Session) -> Examination:
    from sm120patch.explain import doctor as examining

    return examining.examine(session.targets, verbose=session.verbose)


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
            raise UsageError(
                f"--known {known}: nested too deep to be a scan",
                "give the output of `sm120patch scan --json`",
            ) from None
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
