"""The rule a measured trial decides its figures by: each patched run against its neighbouring
baseline runs (ABAB) for the gain, the runs' own scatter for the noise, and a keep only when
the gain clears `min_gain` plus a one-sided 99.99% bound on what noise alone could show, with
at least MIN_RUNS runs a side. When the gain leans one way (beyond a 95% bound) without
clearing that, `more` asks for another run a side. docs/trial.md says why, and what the rule
costs in false keeps and in runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_RUNS = 2  # a side needs this many runs before its spread means anything

# One-sided quantiles of Student's t by degrees of freedom (2 to 40): the bound the noise is
# measured against. KEEP at 0.01%: a no-effect patch on a box whose runs scatter normally
# clears it once in 10,000 trials at one look (the trial looks up to four times, and the
# gain is a median of pairs, not a mean: docs/trial.md has the simulated rates). LEAN at 5%:
# a gain past this one is worth another run. Beyond 40 the value at 40 stands (a little
# stricter than the true one). tests/test_trial_measure.py recomputes both from the density.
_T_KEEP = (
    70.7,
    22.204,
    13.034,
    9.678,
    8.025,
    7.063,
    6.442,
    6.01,
    5.694,
    5.453,
    5.263,
    5.111,
    4.985,
    4.88,
    4.791,
    4.714,
    4.648,
    4.59,
    4.539,
    4.493,
    4.452,
    4.415,
    4.382,
    4.352,
    4.324,
    4.299,
    4.275,
    4.254,
    4.234,
    4.216,
    4.198,
    4.182,
    4.167,
    4.153,
    4.14,
    4.127,
    4.116,
    4.105,
    4.094,
)
_T_LEAN = (
    2.92,
    2.353,
    2.132,
    2.015,
    1.943,
    1.895,
    1.86,
    1.833,
    1.812,
    1.796,
    1.782,
    1.771,
    1.761,
    1.753,
    1.746,
    1.74,
    1.734,
    1.729,
    1.725,
    1.721,
    1.717,
    1.714,
    1.711,
    1.708,
    1.706,
    1.703,
    1.701,
    1.699,
    1.697,
    1.696,
    1.694,
    1.692,
    1.691,
    1.69,
    1.688,
    1.687,
    1.686,
    1.685,
    1.684,
)
KEEP_ALPHA, LEAN_ALPHA = 0.0001, 0.05

# figure -> (unit shown, higher is better): what `--figure` may decide on
FIGURES: dict[str, tuple[str, bool]] = {
    "output_tok_s": ("tok/s", True),
    "req_s": ("req/s", True),
    "ttft_p50_ms": ("ms TTFT p50", False),
    "ttft_p99_ms": ("ms TTFT p99", False),
    "itl_p50_ms": ("ms ITL p50", False),
    "itl_p99_ms": ("ms ITL p99", False),
}


def t_quantile(table: Sequence[float], df: int) -> float:
    """The table's value at `df` degrees of freedom (2 or more)."""
    return table[min(df, 1 + len(table)) - 2]


@dataclass(frozen=True)
class GainDecision:
    verdict: str  # "kept", "reverted-slower", "inconclusive"
    gain: float | None  # the median paired gain
    noise: float | None  # the bound the gain must clear beyond min_gain
    pairs: list[float]
    why: str  # for an inconclusive verdict, in words: "few" runs, or the "noise"
    # Inconclusive, but the gain leans one way: another run a side could decide it.
    more: bool = False


def paired_gains(baseline: Sequence[float], patched: Sequence[float], higher: bool) -> list[float]:
    """Each patched run against its neighbouring baseline runs (the one before it and, where
    there is one, the one after: ABAB puts a baseline on both sides), as a gain: a slow drift
    of the box (clocks, heat, a cache warming) shifts both neighbours and cancels out."""
    gains = []
    for i, p in enumerate(patched):
        neighbours = [b for b in baseline[i : i + 2] if b > 0]  # 0: the run measured nothing
        if not neighbours or p <= 0:
            continue
        b = statistics.fmean(neighbours)
        gains.append((p / b if higher else b / p) - 1)
    return gains


def standard_error(measured: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The standard error of the relative difference between the two sides' means, from
    their pooled relative variance, and its degrees of freedom: how far apart two sides of
    the same server would read, from how this box's runs scatter."""
    rel = [[v / statistics.fmean(side) for v in side] for side in measured]
    df = sum(len(side) - 1 for side in rel)
    pooled = sum(statistics.variance(side) * (len(side) - 1) for side in rel) / df
    return (pooled * sum(1 / len(side) for side in rel)) ** 0.5, df


def decide_gain(
    baseline: Sequence[float], patched: Sequence[float], higher: bool, min_gain: float
) -> GainDecision:
    """Kept, slower or inconclusive, from each side's runs in ABAB order (0: a run that
    measured nothing).

    The gain is the median of the paired gains (`paired_gains`). The noise is a one-sided
    99.99% bound on the gain noise alone would show: Student's t at KEEP_ALPHA times the
    standard error (`standard_error`). Kept: gain >= min_gain + noise; slower: gain <=
    -(min_gain + noise); else inconclusive, with `more` set when the gain clears the same
    bound at LEAN_ALPHA (95%). With fewer than MIN_RUNS runs a side nothing is measured of
    the noise: inconclusive."""
    pairs = paired_gains(baseline, patched, higher)
    measured = [[v for v in side if v > 0] for side in (baseline, patched)]
    if min(len(m) for m in measured) < MIN_RUNS or not pairs:
        gain = round(statistics.median(pairs), 4) if pairs else None
        return GainDecision("inconclusive", gain, None, [round(p, 4) for p in pairs], "few")
    gain = statistics.median(pairs)
    se, df = standard_error(measured)
    noise = t_quantile(_T_KEEP, df) * se
    lean = t_quantile(_T_LEAN, df) * se
    if gain >= min_gain + noise:
        verdict = "kept"
    elif gain <= -(min_gain + noise):
        verdict = "reverted-slower"
    else:
        verdict = "inconclusive"
    more = verdict == "inconclusive" and abs(gain) >= min_gain + lean
    return GainDecision(
        verdict, round(gain, 4), round(noise, 4), [round(p, 4) for p in pairs], "noise", more
    )
