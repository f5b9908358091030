"""The rule a measured trial decides its figures by: each patched run against its neighbouring
baseline runs (ABAB), the noise from how those pairs and each side's runs scatter, and a keep
only beyond `min_gain` plus that noise with at least MIN_RUNS runs a side. docs/trial.md says
why, and what the rule costs in false keeps at each number of runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_RUNS = 2  # a side needs this many runs before its spread means anything

# The mean range of n draws of a normal distribution in standard deviations (d2 of the control
# chart tables): two runs show a range of 1.13 sigma on average, three 1.69. The noise below
# is scaled by d2(3) / d2(n), so that it means the same at every number of runs.
_D2 = {
    2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078,
    11: 3.173, 12: 3.258, 13: 3.336, 14: 3.407, 15: 3.472, 16: 3.532, 17: 3.588, 18: 3.640,
    19: 3.689, 20: 3.735,
}  # fmt: skip


@dataclass(frozen=True)
class GainDecision:
    verdict: str  # "kept", "reverted-slower", "inconclusive"
    gain: float | None  # the median paired gain
    noise: float | None
    pairs: list[float]
    why: str  # for an inconclusive verdict, in words


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


def decide_gain(
    baseline: Sequence[float], patched: Sequence[float], higher: bool, min_gain: float
) -> GainDecision:
    """Kept, slower or inconclusive, from each side's runs in ABAB order.

    The gain is the median of the paired gains (`paired_gains`). The noise is the larger
    side's run-to-run spread ((max - min) / median) plus how far the paired gains scatter from
    their median (the larger of median - lowest and highest - median), scaled by
    d2(3) / d2(n) for n runs a side so that it means the same at any n (the range of few
    draws underestimates their spread: two runs show two thirds of what three show). Kept:
    gain >= min_gain + noise; slower: gain <= -(min_gain + noise); else inconclusive. With
    fewer than MIN_RUNS runs a side nothing is measured of the noise: inconclusive."""
    pairs = paired_gains(baseline, patched, higher)
    measured = [[v for v in side if v > 0] for side in (baseline, patched)]
    n = min(len(m) for m in measured)
    if n < MIN_RUNS or not pairs:
        gain = round(statistics.median(pairs), 4) if pairs else None
        return GainDecision("inconclusive", gain, None, [round(p, 4) for p in pairs], "few")
    gain = statistics.median(pairs)
    spread = max((max(m) - min(m)) / statistics.median(m) for m in measured)
    scatter = max(gain - min(pairs), max(pairs) - gain)
    noise = (spread + scatter) * _D2[3] / _D2.get(n, _D2[max(_D2)])
    if gain >= min_gain + noise:
        verdict = "kept"
    elif gain <= -(min_gain + noise):
        verdict = "reverted-slower"
    else:
        verdict = "inconclusive"
    return GainDecision(
        verdict, round(gain, 4), round(noise, 4), [round(p, 4) for p in pairs], "noise"
    )
