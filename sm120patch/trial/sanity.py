"""Output sanity of a measured trial: a fast server that answers garbage fails, whatever its speed.

Several SM120 paths start fine and answer with zeros, NaN or repeated tokens (see
patches/known.toml), so the patched side's answers are checked on their own and against the
baseline's greedy answers to the same probe prompts:

- an answer that is empty, an error, contains `nan` as a word or U+FFFD/NUL characters, a run
  of 8 or more of one character ("!!!!!!!!"; ruler characters `- = _ . * # ~` excepted), or one
  word making up more than 80% of 8 or more words, is degenerate;
- the probes' mean word-level similarity to the baseline (difflib's ratio, 1.0 identical) must
  be at least `min_similarity` (default 0.5): greedy decoding under another reduction order
  (allreduce fusion) may drift after a few tokens, so identity is not required, but below half
  the answers are other text. When the baseline's own answers are degenerate the comparison
  means nothing: it is skipped and the report says so.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from sm120patch.trial.loadgen import Answer

MIN_SIMILARITY = 0.5
_RUN = re.compile(r"([^\s\-=_.*#~])\1{7,}")
_NAN = re.compile(r"\bnan\b", re.IGNORECASE)


@dataclass
class Sanity:
    ok: bool
    reasons: list[str] = field(default_factory=list)
    similarity: float | None = None
    baseline_reasons: list[str] = field(default_factory=list)


def degenerate(text: str) -> str | None:
    """Why `text` is not a plausible answer, or None."""
    stripped = text.strip()
    if not stripped:
        return "empty answer"
    if _NAN.search(stripped):
        return "NaN in the answer"
    if "\ufffd" in stripped or "\x00" in stripped:
        return "replacement or NUL characters in the answer"
    run = _RUN.search(stripped)
    if run:
        return f"degenerate text {run.group(0)[:8]!r}..."
    words = stripped.split()
    if len(words) >= 8:
        word, count = Counter(words).most_common(1)[0]
        if count / len(words) > 0.8:
            return f"one word repeated ({word!r} {count} of {len(words)} words)"
    return None


def _answer_problem(answer: Answer) -> str | None:
    if answer.error:
        return f"error: {answer.error}"
    return degenerate(answer.text)


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.split(), b.split(), autojunk=False).ratio()


def judge(
    baseline: Sequence[Answer],
    patched: Sequence[Answer],
    *,
    patched_load_texts: Sequence[str] = (),
    patched_load_errors: Sequence[str] = (),
    baseline_load_errors: Sequence[str] = (),
    min_similarity: float = MIN_SIMILARITY,
) -> Sanity:
    reasons = []
    for answer in patched:
        problem = _answer_problem(answer)
        if problem:
            reasons.append(f"probe {answer.prompt!r}: {problem}")
    bad_load = [p for p in (degenerate(t) for t in patched_load_texts) if p]
    if bad_load:
        reasons.append(f"{len(bad_load)} of {len(patched_load_texts)} load answers: {bad_load[0]}")
    if len(patched_load_errors) > len(baseline_load_errors):
        reasons.append(
            f"{len(patched_load_errors)} load requests failed "
            f"(baseline {len(baseline_load_errors)}): {patched_load_errors[0]}"
        )
    baseline_reasons = [
        f"probe {a.prompt!r}: {p}" for a in baseline if (p := _answer_problem(a)) is not None
    ]
    score = None
    if not baseline_reasons and baseline and len(baseline) == len(patched):
        score = round(
            sum(similarity(b.text, p.text) for b, p in zip(baseline, patched, strict=True))
            / len(baseline),
            3,
        )
        if score < min_similarity:
            reasons.append(
                f"greedy answers differ from the baseline (similarity {score:.2f} < "
                f"{min_similarity:.2f})"
            )
    return Sanity(not reasons, reasons, score, baseline_reasons)
