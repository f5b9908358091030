"""The verdict of a measured trial, first match wins: a crash, nothing answered on the
baseline, wrong output, a patched path skipped, then the figures (`decide.decide_gain`); and
whether the figures so far lean enough that one more run a side could decide them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict

from sm120patch.trial import decide, engines, loadgen, sanity, serve, wiring
from sm120patch.trial.measured import (
    FIGURES,
    MIN_RUNS,
    REPEAT,
    MeasuredTrial,
    Options,
    Run,
    api_of,
)


def leans(result: MeasuredTrial, opts: Options) -> bool:
    """Whether the figures so far lean one way without clearing the noise, so that one more
    run a side could decide them (`decide.GainDecision.more`); never once the output is
    wrong: that verdict needs no more runs."""
    base = [r for r in result.runs if r.side == "baseline"]
    patched = [r for r in result.runs if r.side == "patched"]
    if not _judge_output(base, patched, opts).ok:
        return False
    decided = decide.decide_gain(
        _figure_values(base, opts.figure),
        _figure_values(patched, opts.figure),
        FIGURES[opts.figure][1],
        opts.min_gain,
    )
    return decided.more


def _judge_output(base: list[Run], patched: list[Run], opts: Options) -> sanity.Sanity:
    """The output checks (`sanity.judge`) on the first run of each side's probes and eval
    score, and every run's load texts and errors."""
    scores = None
    if opts.eval_cmd and base[0].eval_score is not None and patched[0].eval_score is not None:
        scores = sanity.EvalScores(
            base[0].eval_score, patched[0].eval_score, opts.eval_tolerance, opts.eval_key
        )
    return sanity.judge(
        [loadgen.Answer(**a) for a in base[0].answers],
        [loadgen.Answer(**a) for a in patched[0].answers],
        patched_load_texts=[t for r in patched for t in r.load_texts],
        patched_load_errors=[e for r in patched for e in r.load_errors],
        baseline_load_errors=[e for r in base for e in r.load_errors],
        min_similarity=opts.min_similarity,
        min_agreement=opts.min_agreement,
        scores=scores,
    )


def _figure_values(runs: list[Run], figure: str) -> list[float]:
    """In ABAB order, 0 where a run measured nothing (kept, so the pairs stay aligned)."""
    return [float((r.figures or {}).get(figure) or 0.0) for r in runs]


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "spread": None, "runs": 0}
    med = statistics.median(values)
    spread = (max(values) - min(values)) / med if med else 0.0
    return {
        "median": round(med, 3),
        "min": min(values),
        "max": max(values),
        # None with one run: one value has no spread (0 would read as "no noise").
        "spread": round(spread, 4) if len(values) > 1 else None,
        "runs": len(values),
    }


def _crash(result: MeasuredTrial, bad: Run) -> None:
    sig = serve.diagnose(bad.tail)
    result.signature = asdict(sig) if sig else None
    what = {
        "timeout": "was not ready before the timeout",
        "died-under-load": f"died under load (exit {bad.exit_code})",
    }.get(bad.outcome, f"exited with code {bad.exit_code}")
    head = f"{bad.side} server {what} in run {bad.round + 1}"
    if sig:
        head += f": {sig.diagnosis}"
    tail = "reverted" if bad.side == "patched" else "the command fails without the patch too"
    result.verdict = "crashed"
    result.message = f"{head}: {tail}"


def judge(result: MeasuredTrial, opts: Options, engine: engines.Engine = engines.SGLANG) -> None:
    bad = next((r for r in result.runs if r.outcome != "ok"), None)
    if bad is not None:
        _crash(result, bad)
        return
    base = [r for r in result.runs if r.side == "baseline"]
    patched = [r for r in result.runs if r.side == "patched"]
    if base and not base[0].answered():
        api = api_of(opts, result.command, engine)
        first = next((e for e in base[0].load_errors), None) or next(
            (a.get("error") for a in base[0].answers if a.get("error")), "no answer"
        )
        result.verdict = "unreachable"
        result.message = (
            f"nothing answered at {api} on the baseline (no load request, no probe: {first}); "
            "this says nothing about the patch: reverted"
        )
        return
    for side, runs in (("baseline", base), ("patched", patched)):
        result.summary[side] = {
            name: _stats([v for r in runs if (v := (r.figures or {}).get(name)) is not None])
            for name in FIGURES
        }
        result.summary[side]["power_w"] = _stats(
            [p for r in runs if (p := r.mean_power_w()) is not None]
        )
    verdict = _judge_output(base, patched, opts)
    result.sanity = asdict(verdict)
    unit, higher = FIGURES[opts.figure]

    decision = decide.decide_gain(
        _figure_values(base, opts.figure),
        _figure_values(patched, opts.figure),
        higher,
        opts.min_gain,
    )
    result.gain, result.noise, result.pairs = decision.gain, decision.noise, decision.pairs
    figures = _figures_line(result, opts.figure, unit)
    skipped = next((s for r in patched if (s := wiring.skipped(r.wiring)) is not None), None)
    if not verdict.ok:
        result.verdict = "reverted-wrong-output"
        result.message = f"{figures}, but the output is wrong ({verdict.reasons[0]}): reverted"
    elif skipped is not None:
        patch, line = skipped
        run = next(r for r in patched if wiring.skipped(r.wiring) is not None)
        result.verdict = "inert"
        result.message = (
            f"the patched server skipped {patch}'s path in run {run.round + 1} "
            f"(its log: {line!r}); the figures measure the unpatched path: reverted"
        )
    elif decision.gain is None:
        result.verdict = "inconclusive"
        result.message = f"no {opts.figure} was measured on one side: reverted"
    elif decision.why == "few":
        result.verdict = "inconclusive"
        result.message = (
            f"{figures}: one run a side, no spread measured; a keep needs at least "
            f"{MIN_RUNS} runs a side (--repeat {REPEAT}, the default): reverted"
        )
    else:
        result.verdict = decision.verdict
        noise = (
            f"±{100 * (decision.noise or 0):.1f}% noise + --min-gain {100 * opts.min_gain:g}% "
            f"({len(patched)} runs a side)"
        )
        if decision.verdict == "inconclusive":
            result.message = f"{figures}: inside the {noise}: reverted"
        elif decision.verdict == "kept":
            result.message = f"{figures}: beyond the {noise}: kept"
        else:
            result.message = f"{figures}: slower beyond the {noise}: reverted"
    unseen = [
        p for p, ev in (patched[0].wiring if patched else {}).items() if ev["seen"] == "not-seen"
    ]
    if unseen and result.verdict != "inert":
        result.message += f" (the log showed neither ran nor skipped for {', '.join(unseen)})"


def _figures_line(result: MeasuredTrial, figure: str, unit: str) -> str:
    """'patched 236 tok/s vs baseline 880 tok/s (-73%), power 125 W vs 250 W'."""
    b = result.summary["baseline"][figure]["median"]
    p = result.summary["patched"][figure]["median"]
    gain = "" if result.gain is None else f" ({100 * result.gain:+.0f}%)"
    if result.gain is not None and abs(result.gain) < 0.1:
        gain = f" ({100 * result.gain:+.1f}%)"
    line = f"patched {_num(p)} {unit} vs baseline {_num(b)} {unit}{gain}"
    pb = result.summary["baseline"]["power_w"]["median"]
    pp = result.summary["patched"]["power_w"]["median"]
    if pb is not None and pp is not None:
        line += f", power {pp:.0f} W vs {pb:.0f} W"
    return line


def _num(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
