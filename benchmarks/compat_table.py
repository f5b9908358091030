"""Print the compatibility table: per real release, each site's outcome and each profile's verdict.

    python benchmarks/compat_table.py                 # the default release set of tests/real
    python benchmarks/compat_table.py --full          # every final release (SGLang 0.4.6..0.5.23,
                                                      # FlashInfer 0.2.8..0.7.4), from PyPI
    python benchmarks/compat_table.py --sglang 0.5.8,0.5.22 --flashinfer 0.6.1

Releases come from the cache of sm120patch.releases (downloaded on first use). Each site's
outcome is what the planner says when the site's patch runs after the patches before it in
profile order (the way an apply commits them); a profile's verdict on a release applies the
profile's own rules to those outcomes: outside its pins it is "unpinned", a refusal or a missing
site the profile does not allow there makes it "refuses", otherwise it "applies" its changes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor

from packaging.specifiers import SpecifierSet

from sm120patch import catalog, releases, targets
from sm120patch.catalog import Profile
from sm120patch.plan import plan_target
from sm120patch.transform import Status

# Column headings: the patch and its site letter in DESIGN.md s4.
SITE_LETTER = {
    "sglang.sm120-flag": "A",
    "sglang.fusion-gate": "B",
    "sglang.fusion-autoenable": "C",
    "sglang.fusion-backend": "X",
    "sglang.moe-backend": "D",
    "flashinfer.comm-arch": "F",
}
PROFILES = ("fusion", "moe", "all")
CELL = {
    Status.APPLIED: "applied",
    Status.ALREADY_APPLIED: "already applied",
    Status.UPSTREAM: "upstream",
    Status.NOT_APPLICABLE: "n/a",
    Status.REFUSED: "**refused**",
}

Statuses = dict[str, Status]  # patch id -> outcome on one release


def chain(kind: str) -> tuple[str, ...]:
    """Every patch of `kind`, in the order of the profile holding them all (`all`), then any
    patch no profile names."""
    cat = catalog.load()
    biggest_first = sorted(cat.profiles.values(), key=lambda prof: -len(prof.patches))
    ordered = [p for prof in biggest_first for p in prof.patches]
    ordered += sorted(cat.patches)
    seen = dict.fromkeys(p for p in ordered if cat.patches[p].target == kind)
    return tuple(seen)


def site_statuses(kind: str, version: str) -> Statuses:
    """Each patch's outcome on one release, judged by the planner but allowed to be absent."""
    cat = catalog.load()
    ids = chain(kind)
    probe = Profile(
        name="compat-table",
        title="",
        status="experimental",
        patches=ids,
        pins={kind: SpecifierSet()},
        absent={pid: SpecifierSet() for pid in ids},
    )
    target = targets.find(kind, releases.tree(kind, version))
    planned = plan_target(probe, [cat.patches[p] for p in ids], target)
    return {o.patch: o.status for f in planned.files for o in f.outcomes}


def _job(args: tuple[str, str]) -> tuple[str, str, Statuses]:
    kind, version = args
    return kind, version, site_statuses(kind, version)


def collect(
    versions: Mapping[str, Sequence[str]], workers: int | None = None
) -> dict[str, dict[str, Statuses]]:
    """kind -> version -> statuses, computed in parallel (one process per release at a time)."""
    jobs = [(kind, v) for kind, vs in versions.items() for v in vs]
    out: dict[str, dict[str, Statuses]] = {kind: {} for kind in versions}
    n = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    if n == 1:
        results = [_job(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(_job, jobs))
    for kind, version, statuses in results:
        out[kind][version] = statuses
    return out


def verdict(profile: Profile, kind: str, version: str, statuses: Statuses) -> str:
    """What `apply PROFILE` would say about this release's side of the profile."""
    mine = [p for p in profile.patches if p in statuses]
    if not mine:
        return ""
    bad = [
        p for p in mine
        if statuses[p] is Status.REFUSED
        or (statuses[p] is Status.NOT_APPLICABLE and not profile.absent_ok(p, version))
    ]
    if not profile.pinned(kind, version):
        return "unpinned" + (" (would refuse)" if bad else "")
    if bad:
        return "**refuses** (" + ", ".join(SITE_LETTER.get(p, p) for p in bad) + ")"
    applied = sum(statuses[p] is Status.APPLIED for p in mine)
    return f"applies {applied}" if applied else "nothing to do"


def render(results: Mapping[str, Mapping[str, Statuses]]) -> str:
    """The Markdown tables, one per target kind, releases oldest first."""
    from packaging.version import Version

    cat = catalog.load()
    parts = []
    for kind in releases.KINDS:
        rows = results.get(kind)
        if not rows:
            continue
        ids = chain(kind)
        profiles = [cat.profiles[p] for p in PROFILES if p in cat.profiles
                    and kind in cat.profiles[p].pins]
        head = (["release"] + [f"`{p.name}`" for p in profiles]
                + [f"{SITE_LETTER.get(p, '?')}: `{p}`" for p in ids])
        lines = [f"**{targets.DISPLAY[kind]}**", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head)]
        for version in sorted(rows, key=Version):
            st = rows[version]
            cells = ([version] + [verdict(p, kind, version, st) for p in profiles]
                     + [CELL[st[p]] if p in st else "" for p in ids])
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    legend = ("`applies N`: the profile patches N sites on that release; `upstream`: the "
              "release already enables SM120 there; `n/a`: the site does not exist there; "
              "`unpinned`: outside the profile's pins (refused unless `--force`).")
    return "\n\n".join(parts) + "\n\n" + legend + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every final release from PyPI")
    parser.add_argument("--sglang", help="comma-separated SGLang releases")
    parser.add_argument("--flashinfer", help="comma-separated FlashInfer releases")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    versions: dict[str, Sequence[str]] = {}
    for kind in releases.KINDS:
        given = getattr(args, kind)
        if given:
            versions[kind] = [v.strip() for v in given.split(",") if v.strip()]
        elif args.full:
            versions[kind] = releases.available(kind)
        elif not (args.sglang or args.flashinfer):
            versions[kind] = releases.DEFAULT_RELEASES[kind]
    sys.stdout.write(render(collect(versions, args.workers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
