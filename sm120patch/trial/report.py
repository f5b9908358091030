"""A recorded trial in words (`trial show`, the end of `trial --measure`) and as one
self-contained HTML file with inline SVG, no plotting dependency (`trial show --html`).

Drawn from a measured trial's record: the verdict and why, the paired gains and the noise, a
table of every run (its measured window's absolute start and end, figures, per-GPU mean and max
watts, share of the power limit, utilisation, wiring evidence), output tokens/s over each run's
measured window, power of every GPU over the same windows with the power limit drawn, latency
percentiles per side, the output quality checks, and the greedy probe answers side by side.
A record's typed fields (id, profile, command, verdict, versions, GPUs) come from the record,
the rest from its `measured` mapping, whose shape `TrialRecord.check` vouches for on every read.
Baseline is blue, patched orange; each series is a `<polyline>` with `data-side`, `data-run`
(and `data-gpu`) so a script or a test can find it.
"""

from __future__ import annotations

import html as _html
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sm120patch.engine.trialrecord import TrialRecord

COLOURS = {"baseline": "#1f77b4", "patched": "#ff7f0e"}
LIMIT_COLOUR = "#c62828"
GOOD = ("kept", "ready", "exited-ok")
BAD = ("reverted-slower", "reverted-wrong-output", "crashed", "timeout")
DASHES = ("", "6 3", "2 2", "8 3 2 3")
W, H, PAD = 720, 260, 48


def _esc(value: Any) -> str:
    return _html.escape(str(value), quote=True)


def _chart(
    title: str,
    series: Sequence[tuple[dict[str, str], list[tuple[float, float]]]],
    x_label: str,
    y_label: str,
    limits: Sequence[float] = (),
) -> str:
    """A line chart: `series` is (attributes, points); attributes hold side, run, label.
    `limits`: horizontal lines (the GPUs' power limits), drawn dashed and labelled."""
    points = [p for _, pts in series for p in pts]
    if not points:
        return f"<h3>{_esc(title)}</h3><p>no data</p>"
    x_max = max(x for x, _ in points) or 1.0
    y_max = max([y for _, y in points] + list(limits)) * 1.1 or 1.0

    def sx(x: float) -> float:
        return PAD + (W - 2 * PAD) * x / x_max

    def sy(y: float) -> float:
        return H - PAD + -(H - 2 * PAD) * y / y_max

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="{_esc(title)}">',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#333"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>',
        f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">{_esc(x_label)}</text>',
        f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" '
        f'text-anchor="middle">{_esc(y_label)}</text>',
    ]
    for frac in (0, 0.5, 1):
        y = y_max * frac / 1.1
        parts.append(
            f'<text x="{PAD - 4}" y="{sy(y) + 4:.1f}" text-anchor="end" '
            f'font-size="10">{y:.0f}</text>'
        )
    parts.append(
        f'<text x="{W - PAD}" y="{H - PAD + 14}" text-anchor="end" font-size="10">'
        f"{x_max:.1f}</text>"
    )
    for limit in sorted(set(limits)):
        parts.append(
            f'<line class="limit" data-limit="{limit:g}" x1="{PAD}" y1="{sy(limit):.1f}" '
            f'x2="{W - PAD}" y2="{sy(limit):.1f}" stroke="{LIMIT_COLOUR}" stroke-width="1" '
            f'stroke-dasharray="4 3"/><text x="{W - PAD}" y="{sy(limit) - 4:.1f}" '
            f'text-anchor="end" font-size="10" fill="{LIMIT_COLOUR}">power limit {limit:.0f} W'
            "</text>"
        )
    for attrs, pts in series:
        side = attrs["side"]
        dash = DASHES[int(attrs.get("gpu", 0)) % len(DASHES)]
        data = " ".join(f'data-{k}="{_esc(v)}"' for k, v in attrs.items() if k != "label")
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline class="series {side}" {data} fill="none" stroke="{COLOURS[side]}" '
            f'stroke-width="1.8" stroke-dasharray="{dash}" points="{coords}">'
            f"<title>{_esc(attrs.get('label', side))}</title></polyline>"
        )
    parts.append(_legend(series))
    parts.append("</svg>")
    return f"<h3>{_esc(title)}</h3>" + "".join(parts)


def _legend(series: Sequence[tuple[dict[str, str], list[tuple[float, float]]]]) -> str:
    """One row above the plot: the sides by colour, the GPUs (if any) by dash."""
    items = [
        (side, COLOURS[side], "") for side in COLOURS if any(a["side"] == side for a, _ in series)
    ]
    gpus = sorted({int(a["gpu"]) for a, _ in series if "gpu" in a})
    if len(gpus) > 1:
        items += [(f"GPU {g}", "#555", DASHES[g % len(DASHES)]) for g in gpus]
    out, x = [], PAD
    for label, colour, dash in items:
        out.append(
            f'<line x1="{x}" y1="16" x2="{x + 22}" y2="16" stroke="{colour}" stroke-width="2" '
            f'stroke-dasharray="{dash}"/><text x="{x + 26}" y="20" font-size="11">'
            f"{_esc(label)}</text>"
        )
        x += 34 + 7 * len(label)
    return "".join(out)


def _bars(doc: Mapping[str, Any]) -> str:
    """Latency percentiles: baseline and patched medians side by side."""
    names = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    summary = doc.get("summary") or {}
    values = {
        side: [((summary.get(side) or {}).get(n) or {}).get("median") for n in names]
        for side in ("baseline", "patched")
    }
    top = max([v for vs in values.values() for v in vs if v] or [1.0]) * 1.1
    group = (W - 2 * PAD) / len(names)
    bar = group / 3
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="latency percentiles">',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#333"/>',
    ]
    for i, name in enumerate(names):
        x0 = PAD + group * i + bar / 2
        parts.append(
            f'<text x="{x0 + bar:.1f}" y="{H - PAD + 16}" text-anchor="middle" '
            f'font-size="11">{_esc(name)}</text>'
        )
        for j, side in enumerate(("baseline", "patched")):
            v = values[side][i]
            if v is None:
                continue
            h = (H - 2 * PAD) * v / top
            parts.append(
                f'<rect class="bar {side}" data-side="{side}" data-figure="{name}" '
                f'x="{x0 + j * bar:.1f}" y="{H - PAD - h:.1f}" width="{bar * 0.9:.1f}" '
                f'height="{h:.1f}" fill="{COLOURS[side]}"><title>{side} {name} {v:.1f} ms'
                f'</title></rect><text x="{x0 + j * bar + bar * 0.45:.1f}" '
                f'y="{H - PAD - h - 3:.1f}" text-anchor="middle" font-size="10">{v:.1f}</text>'
            )
    parts.append(_legend([({"side": side}, []) for side in COLOURS]))
    parts.append("</svg>")
    return "<h3>Latency percentiles (median over runs, ms)</h3>" + "".join(parts)


def _summary_table(doc: Mapping[str, Any]) -> str:
    summary = doc.get("summary") or {}
    if not summary:
        return ""
    rows = []
    for name in ("output_tok_s", "req_s", *[k for k in summary.get("baseline", {}) if "_ms" in k]):
        cells = []
        for side in ("baseline", "patched"):
            s = (summary.get(side) or {}).get(name) or {}
            med = s.get("median")
            cells.append("<td>?</td>" if med is None else f"<td>{med:.2f} {_spread(s)}</td>")
        rows.append(f"<tr><th>{_esc(name)}</th>{''.join(cells)}</tr>")
    power = [(summary.get(s) or {}).get("power_w", {}).get("median") for s in COLOURS]
    rows.append(
        "<tr><th>mean power per GPU (W)</th>"
        + "".join(f"<td>{'?' if p is None else f'{p:.0f}'}</td>" for p in power)
        + "</tr>"
    )
    return (
        "<table><tr><th></th><th>baseline (median)</th><th>patched (median)</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _spread(stats: dict[str, Any]) -> str:
    """'(spread 4.1%)', or '(one run: no spread)': one value measures no noise."""
    if stats.get("spread") is None or stats.get("runs") == 1:
        return "<small>(one run: no spread)</small>"
    return f"<small>(spread {100 * stats['spread']:.1f}%)</small>"


def _clock(epoch: float | None) -> str:
    if epoch is None:
        return "?"
    whole = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    return f"{whole}.{int((epoch % 1) * 1000):03d}"


def _runs_table(doc: Mapping[str, Any]) -> str:
    """Every run: its measured window, figures, per-GPU power and utilisation, wiring."""
    runs = doc.get("runs") or []
    if not runs:
        return ""
    rows = []
    for r in runs:
        f = r.get("figures") or {}
        gpus = "<br>".join(
            f"GPU {g['index']}: mean {_w(g.get('mean_w'))}{_share(g)}, max {_w(g.get('max_w'))}"
            + ("" if g.get("mean_util_pct") is None else f", util {g['mean_util_pct']:.0f}%")
            for g in r.get("gpus") or []
        ) or _esc(r.get("nvml_problem") or "no GPU figures")
        wiring = "<br>".join(
            f"{_esc(p)}: <b>{_esc(ev.get('seen'))}</b>"
            + (f" <small>{_esc(ev['line'])}</small>" if ev.get("line") else "")
            for p, ev in (r.get("wiring") or {}).items()
        )
        figures = (
            f"{_fig(f.get('output_tok_s', 0), '.1f')}</td><td>{_fig(f.get('req_s', 0), '.2f')}</td>"
            f"<td>{_ms(f.get('ttft_p50_ms'))} / {_ms(f.get('itl_p50_ms'))}"
            if r.get("outcome") == "ok" and f
            else f"{_esc(r.get('outcome'))} (exit {_esc(r.get('exit_code'))})</td><td></td><td>"
        )
        rows.append(
            f'<tr class="run {_esc(r["side"])}" data-side="{_esc(r["side"])}" '
            f'data-run="{r["round"] + 1}"><td>{_esc(r["side"])} {r["round"] + 1}</td>'
            f"<td>{_clock(r.get('window_start'))}<br>{_clock(r.get('window_end'))}</td>"
            f"<td>{figures}</td><td>{gpus}</td><td>{wiring or '-'}</td></tr>"
        )
    return (
        "<h3>Runs</h3><table><tr><th>run</th><th>measured window (start, end)</th>"
        "<th>tok/s</th><th>req/s</th><th>TTFT / ITL p50 (ms)</th>"
        "<th>GPUs: power (share of the limit), utilisation</th><th>wiring</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _w(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} W"


def _share(g: dict[str, Any]) -> str:
    if not g.get("limit_share") or not g.get("limit_w"):
        return ""
    return f" ({100 * g['limit_share']:.0f}% of the {g['limit_w']:.0f} W limit)"


def _ms(value: float | None) -> str:
    return _fig(value, ".1f")


def _fig(value: float | None, spec: str) -> str:
    # None: a figure `--bench-cmd` did not report.
    return "?" if value is None else format(value, spec)


def _quality(doc: Mapping[str, Any]) -> str:
    """Top-1 token agreement, the quality command's scores, what was not checked."""
    lines = quality_lines(doc)
    if not lines:
        return ""
    return "<h3>Output quality</h3>" + "".join(f"<p>{_esc(line)}</p>" for line in lines)


def _answers(doc: Mapping[str, Any]) -> str:
    firsts = {}
    for run in doc.get("runs", []):
        if run.get("answers") and run["side"] not in firsts:
            firsts[run["side"]] = run["answers"]
    base, patched = firsts.get("baseline", []), firsts.get("patched", [])
    if not base and not patched:
        return ""
    rows = []
    for i in range(max(len(base), len(patched))):
        b = base[i] if i < len(base) else {}
        p = patched[i] if i < len(patched) else {}
        rows.append(
            f"<tr><td>{_esc(b.get('prompt') or p.get('prompt'))}</td>"
            f"<td>{_esc(b.get('error') or b.get('text', ''))}</td>"
            f"<td>{_esc(p.get('error') or p.get('text', ''))}</td></tr>"
        )
    reasons = (doc.get("sanity") or {}).get("reasons") or []
    similarity = (doc.get("sanity") or {}).get("similarity")
    head = f"<p>similarity to the baseline: {similarity}</p>" if similarity is not None else ""
    head += "".join(f'<p class="bad">{_esc(r)}</p>' for r in reasons)
    return (
        "<h3>Greedy probe answers</h3>"
        + head
        + "<table><tr><th>prompt</th><th>baseline</th><th>patched</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def html(trial: TrialRecord) -> str:
    """The report of one recorded trial (measured, or a plain liveness trial in words)."""
    doc = trial.measured
    runs = doc.get("runs") or []
    throughput = [
        (
            {
                "side": r["side"],
                "run": str(r["round"] + 1),
                "label": f"{r['side']} run {r['round'] + 1}",
            },
            [(p["t"], p["tok_s"]) for p in r.get("timeline", [])],
        )
        for r in runs
        if r.get("timeline")
    ]
    power = []
    for r in runs:
        per_gpu: dict[int, list[tuple[float, float]]] = {}
        for sample in r.get("power", []):
            for g in sample["gpus"]:
                if g.get("power_w") is not None:
                    per_gpu.setdefault(g["index"], []).append((sample["t"], g["power_w"]))
        for index, pts in sorted(per_gpu.items()):
            power.append(
                (
                    {
                        "side": r["side"],
                        "run": str(r["round"] + 1),
                        "gpu": str(index),
                        "label": f"{r['side']} run {r['round'] + 1} GPU {index}",
                    },
                    pts,
                )
            )
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(trial.started or 0))
    verdict = trial.verdict
    tone = "good" if verdict in GOOD else "bad" if verdict in BAD else "unsure"
    versions = ", ".join(f"{k} {v}" for k, v in trial.versions.items())
    limits = sorted({g["limit_w"] for r in runs for g in r.get("gpus") or [] if g.get("limit_w")})
    body = [
        f"<h1>sm120patch trial {_esc(trial.id)}: {_esc(trial.profile)}</h1>",
        f'<p class="{tone}" id="verdict"><b>{_esc(verdict)}</b>: '
        f"{_esc(trial.message or '')}</p>",
        "".join(f"<p>{_esc(line)}</p>" for line in gain_lines(trial)),
        "<table>",
        f"<tr><th>started</th><td>{_esc(when)}</td></tr>",
        f"<tr><th>command</th><td><code>{_esc(' '.join(trial.command))}</code></td></tr>",
        f"<tr><th>versions</th><td>{_esc(versions or '?')}</td></tr>",
        f"<tr><th>GPUs</th><td>{_esc(', '.join(trial.gpu_names) or 'none seen')}"
        "</td></tr>",
        "</table>",
        _summary_table(doc),
        _runs_table(doc),
        _chart("Output tokens/s over the measured window", throughput, "seconds", "tok/s"),
        _chart("Power per GPU over the measured window", power, "seconds", "W", limits),
        _bars(doc) if doc.get("summary") else "",
        _quality(doc),
        _answers(doc),
    ]
    style = (
        "body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:left;vertical-align:top}.good{color:#1a7f37}"
        ".bad{color:#c62828}.unsure{color:#9a6700}svg{background:#fafafa}"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>sm120patch trial {_esc(trial.id)}</title><style>{style}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


# ---- in words: `trial show`, `status`, the end of `trial --measure` -------------------------


def trial_line(t: TrialRecord) -> str:
    """One line of a recorded trial, for `status` and `trial show`."""
    if t.is_measured:
        return f"trial {t.id} {t.profile} measured: {t.verdict}: {t.message}"
    head = f"trial {t.id} " if t.id else "trial "
    return f"{head}{t.profile}: {t.verdict}, exit {t.exit_code}: {' '.join(t.command)}"


def gain_lines(trial: TrialRecord) -> list[str]:
    """The paired gains the verdict was taken on, and the noise."""
    doc = trial.measured
    pairs = doc.get("pairs") or []
    if not pairs:
        return []
    figure = (doc.get("options") or {}).get("figure", "output_tok_s")
    each = ", ".join(f"{100 * p:+.1f}%" for p in pairs)
    line = f"{figure}, each patched run against its neighbouring baseline runs: {each}"
    if trial.gain is not None:
        line += f"; median {100 * trial.gain:+.1f}%"
    noise = doc.get("noise")
    line += (
        "; noise not measured (one run a side)" if noise is None else f"; noise ±{100 * noise:.1f}%"
    )
    return [line]


def quality_lines(doc: Mapping[str, Any]) -> list[str]:
    """Top-1 token agreement, the quality command's scores, and what was not checked."""
    sanity = doc.get("sanity") or {}
    lines = []
    if sanity.get("similarity") is not None:
        lines.append(
            f"word similarity of the probe answers to the baseline: {sanity['similarity']}"
        )
    if sanity.get("agreement") is not None:
        lines.append(
            f"greedy top-1 token agreement with the baseline: {100 * sanity['agreement']:.0f}% "
            f"of {sanity.get('agreement_positions')} positions"
        )
    scores = sanity.get("eval")
    if scores:
        lines.append(
            f"--eval-cmd {scores['key']}: patched {scores['patched']:g} vs baseline "
            f"{scores['baseline']:g} (tolerance {scores['tolerance']:g})"
        )
    lines += [f"not checked: {note}" for note in sanity.get("notes") or []]
    lines += [f"baseline: {reason}" for reason in sanity.get("baseline_reasons") or []]
    return lines


def wiring_lines(doc: Mapping[str, Any]) -> list[str]:
    """Per patch that declares its wiring: what each run's log showed, baseline against
    patched, and the line that showed it on the patched side."""
    runs = doc.get("runs") or []
    patches = sorted({p for r in runs for p in r.get("wiring") or {}})
    lines = []
    for patch in patches:
        sides = []
        for side in ("baseline", "patched"):
            seen = [
                (r.get("wiring") or {}).get(patch, {}).get("seen", "?")
                for r in runs
                if r.get("side") == side
            ]
            if seen:
                sides.append(f"{side} {', '.join(seen)}")
        line = f"wiring {patch}: {'; '.join(sides)}"
        quoted = next(
            (
                ev["line"]
                for r in runs
                if r.get("side") == "patched"
                and (ev := (r.get("wiring") or {}).get(patch, {})).get("line")
            ),
            None,
        )
        if quoted:
            line += f" ({quoted!r})"
        lines.append(line)
    return lines


def measured_lines(trial: TrialRecord) -> list[str]:
    """A measured trial in words: each run's figures, window and power, the paired gains, the
    quality checks and wiring evidence, then the verdict."""
    from sm120patch.trial import gpu

    doc = trial.measured
    lines = [f"trial {trial.id} of {trial.profile}: {' '.join(trial.command)}"]
    if trial.versions or trial.gpu_names:
        versions = ", ".join(f"{k} {v}" for k, v in trial.versions.items())
        lines.append(f"  {versions}; GPUs: {', '.join(trial.gpu_names or ['none seen'])}")
    for run in doc.get("runs") or []:
        head = f"  {run['side']:8} run {run['round'] + 1}: "
        f = run.get("figures")
        if run["outcome"] != "ok" or not f:
            lines.append(head + f"{run['outcome']} (exit {run.get('exit_code')})")
            continue
        window = ""
        if run.get("window_start") and run.get("window_end"):
            window = f"; window {_clock(run['window_start'])} to {_clock(run['window_end'])[11:]}"
        lines.append(
            head
            + f"{_fig(f.get('output_tok_s'), '.1f')} tok/s, {_fig(f.get('req_s'), '.2f')} req/s, "
            f"TTFT p50/p99 {_ms(f.get('ttft_p50_ms'))}/{_ms(f.get('ttft_p99_ms'))} ms, "
            f"ITL p50/p99 {_ms(f.get('itl_p50_ms'))}/{_ms(f.get('itl_p99_ms'))} ms{window}"
        )
        for g in run.get("gpus", []):
            lines.append("    " + gpu.GpuFigures(**g).describe())
        if run.get("nvml_problem"):
            lines.append(f"    no GPU figures: {run['nvml_problem']}")
    lines += ["  " + line for line in gain_lines(trial)]
    lines += ["  " + line for line in wiring_lines(doc)]
    lines += ["  " + line for line in quality_lines(doc)]
    for reason in (doc.get("sanity") or {}).get("reasons") or []:
        lines.append(f"  wrong output: {reason}")
    if doc.get("signature"):
        lines.append(f"  what to do: {doc['signature']['action']}")  # words, not a command
    lines.append(f"verdict: {trial.verdict}: {trial.message}")
    return lines


def power_lines(samples: list[dict[str, Any]]) -> list[str]:
    """A plain trial's `--sample-power`: mean and max draw per GPU against its limit."""
    from sm120patch.trial import gpu

    return [g.describe() for g in gpu.summarise(samples)]
