"""A scan in words: gates grouped by class, candidates first, one line each plus the expression,
and a summary line with the counts."""

from __future__ import annotations

from sm120patch.scan import classify as c
from sm120patch.scan.run import Report, TargetScan

DISPLAY = {"sglang": "SGLang", "flashinfer": "FlashInfer"}
LISTED = (c.CANDIDATE, c.COVERED)  # without --all; the other classes are counted


def text(report: Report, *, all_: bool = False) -> str:
    out: list[str] = []
    for target in report.targets:
        out += _target(target, all_, report)
        out.append("")
    summary = "summary: " + _counts(report.counts())
    if report.known is not None:
        summary += f" ({len(report.new_candidates())} candidates not known before)"
    out.append(summary)
    return "\n".join(out) + "\n"


def _target(t: TargetScan, all_: bool, report: Report) -> list[str]:
    where = f" ({t.layout})" if t.layout else ""
    out = [f"{DISPLAY.get(t.kind, t.kind)} {t.version}{where} at {t.root}"]
    hidden = []
    for cls in c.CLASSES:
        gates = t.of(cls)
        if cls not in LISTED and not all_:
            if gates:
                hidden.append(f"{len(gates)} {cls}")
            continue
        if not gates:
            continue
        out.append(f"{cls} ({len(gates)})")
        for x in gates:
            out += _gate(x, known=report.is_known(x))
    if hidden:
        out.append(f"not listed: {', '.join(hidden)} (--all lists them)")
    for o in t.already_applied():
        out.append(f"already applied here: {o.patch} ({o.file}::{o.site})")
    for file, problem in t.problems:
        out.append(f"not read: {file}: {problem}")
    for file, line, size in t.skipped:
        out.append(f"not read: {file}:{line}: a {size // 1000} kB statement (generated code)")
    out.append(
        f"{t.kind} {t.version}: {_counts(t.counts())}; {t.files_read} files read, "
        f"{t.files_parsed} parsed, {t.seconds:.1f} s"
    )
    return out


def _gate(x: c.Classified, known: bool = False) -> list[str]:
    g = x.gate
    favours = "/".join(g.favoured)
    if x.covered_by:
        reason = "covered by " + _covered(x.covered_by)
    else:
        reason = x.reason
    mark = " (known)" if known else ""
    return [
        f"  {g.file}:{g.line} {g.function}: {g.gates} [{favours}] - {reason}{mark}",
        f"      {g.kind} {g.expression}",
    ]


def _covered(covered: tuple[c.Coverage, ...]) -> str:
    """`sglang.fusion-gate (applied) in fusion, all`: one entry per patch and outcome."""
    by_patch: dict[tuple[str, str, bool], list[str]] = {}
    for cov in covered:
        by_patch.setdefault((cov.patch, cov.outcome, cov.pinned), []).append(cov.profile)
    parts = []
    for (patch, outcome, pinned), profiles in by_patch.items():
        pins = "" if pinned else ", outside the pins"
        parts.append(f"{patch} ({outcome}{pins}) in {', '.join(profiles)}")
    return "; ".join(parts)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts.get(cls, 0)} {cls}" for cls in c.CLASSES)
