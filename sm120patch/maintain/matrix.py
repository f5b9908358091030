"""`matrix`: every profile planned on every release matching a specifier, as a table.

Releases come from the cache (`releases.py`), fetched from pip's configured index when missing.
Each release is planned in a worker process (`-j`), without pins: the table is the evidence
pins are made of. Maintainer tooling: only the `matrix` command imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from sm120patch.errors import UsageError
from sm120patch.maintain import releases, trees
from sm120patch.plan import catalog

DISPLAY = {"sglang": "SGLang", "flashinfer": "FlashInfer"}


@dataclass
class Row:
    kind: str
    version: str
    sites: dict[str, str] = field(default_factory=dict)  # patch id -> outcome
    profiles: dict[str, str] = field(default_factory=dict)  # profile -> verdict
    notes: dict[str, str] = field(default_factory=dict)  # patch id -> the outcome's note
    error: str | None = None


def plan_release(kind: str, version: str) -> Row:
    """Fetch (or reuse) one release and plan every profile's patches for its kind on it."""
    from sm120patch import targets
    from sm120patch.patchkit.model import Status
    from sm120patch.plan import planner

    row = Row(kind, version)
    try:
        tree = trees.tree(kind, version)
        target = targets.find(kind, tree)
    except Exception as exc:  # a release we cannot fetch is a row that says so
        row.error = f"{type(exc).__name__}: {exc}"
        return row
    cat = catalog.load()
    for profile in cat.profiles.values():
        if kind not in profile.targets:
            continue
        with planner.no_cycle_collection():
            tp = planner.plan_target(profile, cat.patches_of(profile), target)
        outcomes = [o for f in tp.files for o in f.outcomes]
        for o in outcomes:
            row.sites.setdefault(o.patch, o.status.value)
            if o.note:
                row.notes.setdefault(o.patch, o.note)
        if any(o.status is Status.REFUSED for o in outcomes):
            verdict = "refused"
        elif profile.refusals(kind, version):
            verdict = "refuses"  # inside the pins or not, apply refuses it unless --force
        elif profile.pinned(kind, version):
            verdict = "pinned"
        else:
            verdict = "unpinned"
        row.profiles[profile.name] = verdict
    return row


@dataclass
class Selection:
    work: list[tuple[str, str]]  # (kind, version)
    listings: list[releases.Listing]

    def warning(self) -> str | None:
        """One line when a listing is a cached one because the index could not be read."""
        stale = [ls for ls in self.listings if ls.stale]
        if not stale:
            return None
        reasons = "; ".join(dict.fromkeys(ls.stale or "" for ls in stale))
        return f"{reasons}; using {', '.join(ls.describe() for ls in stale)}"


def releases_for(
    specs: dict[str, str | None], progress: Callable[[str], None] = lambda kind: None
) -> Selection:
    """(kind, version) of every release on the index matching each kind's specifier (None: the
    full range the project tracks; see `releases.select` for post releases). A specifier that
    matches nothing is a usage error."""
    work: list[tuple[str, str]] = []
    listings = []
    for kind, spec in specs.items():
        listing = releases.listing(kind)
        listings.append(listing)
        chosen = releases.select(listing.files, spec or releases.full_range(kind))
        progress(kind)
        if not chosen:
            raise _no_match(kind, spec or releases.full_range(kind), listing)
        work += [(kind, v) for v in chosen]
    return Selection(work, listings)


def _no_match(kind: str, spec: str, listing: releases.Listing) -> UsageError:
    where = ", ".join(listing.sources)
    listed = releases.select(listing.files, "")
    if not listed:
        return UsageError(
            f"no release matches --{kind} {spec!r}: {where} lists no release of "
            f"{releases.PROJECT[kind]}",
            "check pip's index configuration: `python -m pip config list`",
        )
    return UsageError(
        f"no release matches --{kind} {spec!r}: {where} lists {releases.PROJECT[kind]} "
        f"{listed[0]} to {listed[-1]}",
        f"pick a specifier inside that range, e.g. --{kind} '=={listed[-1]}'",
    )


def run(
    work: Sequence[tuple[str, str]],
    jobs: int,
    progress: Callable[[Row], None] = lambda row: None,
) -> list[Row]:
    """A row per (kind, version), planned in `jobs` worker processes."""
    rows: list[Row] = []
    if jobs <= 1:
        for kind, v in work:
            rows.append(plan_release(kind, v))
            progress(rows[-1])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(plan_release, kind, v) for kind, v in work]
            for future in as_completed(futures):
                rows.append(future.result())
                progress(rows[-1])
    rows.sort(key=lambda r: (r.kind != "sglang", Version(r.version)))
    return rows


def columns(kind: str, profiles: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    cat = catalog.load()
    names = [p for p in cat.profiles if profiles is None or p in profiles]
    kinds_profiles = [p for p in names if kind in cat.profiles[p].targets]
    sites = [
        pid
        for pid, patch in cat.patches.items()
        if patch.target == kind and any(pid in cat.profiles[p].patches for p in kinds_profiles)
    ]
    order = (
        {pid: i for i, pid in enumerate(cat.profiles["all"].patches)}
        if "all" in cat.profiles
        else {}
    )
    sites.sort(key=lambda pid: order.get(pid, len(order)))
    return sites, kinds_profiles


def markdown(rows: list[Row], profiles: Sequence[str] | None = None) -> str:
    """One table per kind: release, each profile's verdict, each site's outcome."""
    out = []
    for kind in ("sglang", "flashinfer"):
        mine = [r for r in rows if r.kind == kind]
        if not mine:
            continue
        sites, profs = columns(kind, profiles)
        head = [DISPLAY[kind], *profs, *(s.split(".", 1)[1] for s in sites)]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in mine:
            if r.error:
                cells = [r.version, f"error: {r.error}"] + [""] * (len(head) - 2)
            else:
                cells = [
                    r.version,
                    *(r.profiles.get(p, "") for p in profs),
                    *(r.sites.get(s, "") + (NOTE_MARK if s in r.notes else "") for s in sites),
                ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for site, first, note in _notes(mine):
            out.append(f"{NOTE_MARK} `{site}` from {DISPLAY[kind]} {first}: {note}")
            out.append("")
    return "\n".join(out)


NOTE_MARK = "*"


def _notes(rows: list[Row]) -> list[tuple[str, str, str]]:
    """(site, first release with it, note) for each distinct note in `rows` (oldest first)."""
    seen: dict[tuple[str, str], str] = {}
    for r in rows:
        for site, note in r.notes.items():
            seen.setdefault((site, note), r.version)
    return [(site, first, note) for (site, note), first in seen.items()]


def to_json(rows: list[Row], warnings: Sequence[str] = ()) -> str:
    """One object: the planned rows, the releases that could not be planned, the warnings."""
    doc: dict[str, Any] = {
        "rows": [
            {"kind": r.kind, "version": r.version, "profiles": r.profiles, "sites": r.sites,
             "notes": r.notes}
            for r in rows
            if not r.error
        ],
        "errors": [
            {"kind": r.kind, "version": r.version, "error": r.error} for r in rows if r.error
        ],
        "warnings": list(warnings),
    }
    return json.dumps(doc, indent=2)
