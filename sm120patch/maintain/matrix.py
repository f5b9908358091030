"""`matrix`: every profile planned on every release matching a specifier, as a table.

Releases come from the cache (`releases.py`; vLLM's as its sources, `sources.py`), fetched
from pip's configured index when missing.
Each release is planned in a worker process (`-j`), without pins: the table is the evidence
pins are made of. Maintainer tooling: only the `matrix` command imports it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import Version

from sm120patch.errors import UsageError
from sm120patch.maintain import dists, releases, sources, trees
from sm120patch.plan import catalog

DISPLAY = {"sglang": "SGLang", "flashinfer": "FlashInfer", "vllm": "vLLM"}

# Table order; a kind's rows are oldest first.
ORDER = ("sglang", "flashinfer", "vllm")


def release_tree(kind: str, version: str) -> Path:
    """The release's files in the cache: unpacked from its distribution, or (vLLM) its kept
    sources."""
    if kind in releases.SOURCES_ONLY:
        return sources.tree(kind, version)
    return trees.tree(kind, version)


@dataclass
class Row:
    kind: str
    version: str
    sites: dict[str, str] = field(default_factory=dict)  # patch id -> outcome
    profiles: dict[str, str] = field(default_factory=dict)  # profile -> verdict
    notes: dict[str, str] = field(default_factory=dict)  # patch id -> the outcome's note
    error: str | None = None
    # With --scan: the release's candidate gates (`sm120patch scan`), and those of them the
    # previous release of its kind did not have (`mark_new`).
    candidates: list[dict[str, Any]] | None = None
    new_candidates: list[dict[str, Any]] = field(default_factory=list)
    # Why the release's bytes were not checked against the index's sha256 (a vLLM wheel read
    # by range requests: `sources.unchecked`); None when they were.
    unchecked: str | None = None


def plan_release(kind: str, version: str, scan: bool = False) -> Row:
    """Fetch (or reuse) one release and plan every profile's patches for its kind on it; with
    `scan`, scan the whole release for its candidate gates too."""
    row = _plan_release(kind, version)
    if scan and row.error is None:
        try:
            row.candidates = scan_release(kind, version)
        except Exception as exc:  # a release we cannot scan is a row that says so
            row.error = f"scan: {type(exc).__name__}: {exc}"
    return row


def _plan_release(kind: str, version: str) -> Row:
    from sm120patch.patchkit.model import Status
    from sm120patch.plan import planner
    from sm120patch.targets import finding

    row = Row(kind, version)
    try:
        tree = release_tree(kind, version)
        target = finding.find(kind, tree)
    except Exception as exc:  # a release we cannot fetch is a row that says so
        row.error = f"{type(exc).__name__}: {exc}"
        return row
    if kind in releases.SOURCES_ONLY:
        row.unchecked = sources.unchecked(kind, version)
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
    *,
    scan: bool = False,
) -> list[Row]:
    """A row per (kind, version), planned in `jobs` worker processes (and scanned, with
    `scan`: then each row also says which candidates are new since the previous release)."""
    rows: list[Row] = []
    if jobs <= 1:
        for kind, v in work:
            rows.append(plan_release(kind, v, scan))
            progress(rows[-1])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(plan_release, kind, v, scan) for kind, v in work]
            for future in as_completed(futures):
                rows.append(future.result())
                progress(rows[-1])
    rows.sort(key=lambda r: (ORDER.index(r.kind), Version(r.version)))
    if scan:
        mark_new(rows)
    return rows


# ----------------------------------------------------------------------------- candidates


SCAN_SCHEMA = 2


def scan_release(kind: str, version: str) -> list[dict[str, Any]]:
    """The candidate gates of a whole release (every `.py` of its distribution), kept in the
    release cache under a key of the distribution, the scanner and the patch library: a
    scan of a whole release takes seconds, and `matrix --scan` reads dozens."""
    key = _scan_key(_release_digest(kind, version))
    path = releases.cache_dir() / "scans" / f"{kind}-{version}.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("schema") == SCAN_SCHEMA and doc.get("key") == key:
            return list(doc["candidates"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from sm120patch.scan import run as scanning

    files = (sources.package_files(kind, version) if kind in releases.SOURCES_ONLY
             else trees.package_files(kind, version))
    found = scanning.scan_files(kind, version, files)
    wanted = ("file", "line", "function", "expression", "gates", "reason", "key")
    candidates = [{k: x.to_dict()[k] for k in wanted} for x in found.of("candidate")]
    doc = {"schema": SCAN_SCHEMA, "key": key, "candidates": candidates}
    with contextlib.suppress(OSError):  # a read-only cache still scans
        releases.write_atomic(path, json.dumps(doc, indent=1).encode())
    return candidates


def _release_digest(kind: str, version: str) -> str:
    """sha256 of the release as cached: its distribution file, or (vLLM) the record of its
    kept sources, which holds each file's sha256."""
    import hashlib

    if kind in releases.SOURCES_ONLY:
        record = sources.tree(kind, version) / trees.TREE_RECORD
        return hashlib.sha256(record.read_bytes()).hexdigest()
    return dists.sha256_file(dists.fetch(kind, version))


def _scan_key(release: str) -> str:
    """sha256 over the release, the scanner's code and every pack's patches and tables."""
    import hashlib

    from sm120patch import __version__, scan
    from sm120patch.patchkit import arch, runner

    h = hashlib.sha256(f"{__version__}\0{release}\0".encode())
    here = Path(next(iter(scan.__path__)))
    for code in [*sorted(here.glob("*.py")), Path(arch.__file__), Path(runner.__file__)]:
        h.update(code.name.encode() + b"\0" + code.read_bytes())
    cat = catalog.load()
    for pack in {p.name: p for p in cat.sources.values()}.values():
        h.update(pack.digest().encode())
    return h.hexdigest()


def mark_new(rows: list[Row]) -> None:
    """Each scanned row's candidates that the previous scanned release of its kind lacks
    (rows sorted by version; `scan.classify.identities`); the first release of each kind has
    no previous one."""
    from sm120patch.scan.classify import identities

    previous: dict[str, set[tuple[str, ...]]] = {}
    for row in rows:
        if row.candidates is None:
            continue
        seen = previous.get(row.kind)
        keys: set[tuple[str, ...]] = set()
        for c in row.candidates:
            mine = identities(c["file"], c["key"])
            if seen is not None and not mine & seen:
                row.new_candidates.append(c)
            keys |= mine
        previous[row.kind] = keys


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
    for kind in ORDER:
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
        for r in mine:
            if r.unchecked and not r.error:
                out.append(
                    f"{DISPLAY[kind]} {r.version}: not verified against the index, {r.unchecked}"
                )
                out.append("")
        out += _new_candidates(mine)
    return "\n".join(out)


def _new_candidates(rows: list[Row]) -> list[str]:
    """With --scan: per release, the candidate gates that appeared since the previous one."""
    scanned = [r for r in rows if r.candidates is not None]
    if not scanned:
        return []
    kind, first = DISPLAY[scanned[0].kind], scanned[0]
    out = [
        f"New candidate gates per {kind} release (`sm120patch scan`; the first release "
        f"scanned, {first.version}, has {len(first.candidates or [])}):",
        "",
    ]
    for r in scanned[1:]:
        if not r.new_candidates:
            continue
        out.append(f"- {kind} {r.version}: {len(r.new_candidates)} new")
        for c in r.new_candidates:
            out.append(f"  - `{c['file']}:{c['line']}` `{c['function']}`: `{c['expression']}`")
    out.append("")
    return out


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
             "notes": r.notes, **_scanned(r),
             **({"unchecked": r.unchecked} if r.unchecked else {})}
            for r in rows
            if not r.error
        ],
        "errors": [
            {"kind": r.kind, "version": r.version, "error": r.error} for r in rows if r.error
        ],
        "warnings": list(warnings),
    }
    return json.dumps(doc, indent=2)


def _scanned(row: Row) -> dict[str, Any]:
    """With --scan: how many candidates a row has, and the new ones."""
    if row.candidates is None:
        return {}
    return {"candidates": len(row.candidates), "new_candidates": row.new_candidates}
