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
  means nothing: it is skipped and the report says so;
- where the server returns logprobs (OpenAI's `logprobs.tokens`), the greedy top-1 tokens must
  agree with the baseline's on at least `min_agreement` (default 0.9) of the positions where
  both sides had the same context: each probe is compared token by token up to and including
  its first differing token, since after it the two continue from different text. A drift
  late in an answer (a near tie broken the other way) costs one position; a patched model that
  picks other tokens from the start scores near 0, however alike the words look;
- a quality command of the user's (`--eval-cmd`) scores both sides: the patched score may not
  fall below the baseline's by more than its tolerance.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sm120patch.errors import Refused
from sm120patch.trial.loadgen import Answer

MIN_SIMILARITY = 0.5
MIN_AGREEMENT = 0.9
_RUN = re.compile(r"([^\s\-=_.*#~])\1{7,}")
_NAN = re.compile(r"\bnan\b", re.IGNORECASE)


@dataclass
class Sanity:
    ok: bool
    reasons: list[str] = field(default_factory=list)
    similarity: float | None = None
    baseline_reasons: list[str] = field(default_factory=list)
    # Greedy top-1 agreement with the baseline and over how many positions; None when a side
    # gave no tokens (the server sends no logprobs) or the baseline is degenerate.
    agreement: float | None = None
    agreement_positions: int = 0
    # What was not checked, and why.
    notes: list[str] = field(default_factory=list)
    # The quality command's scores: {"baseline", "patched", "tolerance", "key"}.
    eval: dict[str, Any] | None = None


@dataclass(frozen=True)
class EvalScores:
    """`--eval-cmd`'s score on each side, higher is better."""

    baseline: float
    patched: float
    tolerance: float
    key: str


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


def agreement(baseline: Sequence[Answer], patched: Sequence[Answer]) -> tuple[float, int] | None:
    """(share, positions): greedy top-1 agreement over the positions where both sides had the
    same context, each probe up to and including its first differing token. A side that ended
    (end of sequence) while the other went on differs at that position. None when any answer
    of either side has no tokens."""
    if not baseline or len(baseline) != len(patched):
        return None
    agree = positions = 0
    for b, p in zip(baseline, patched, strict=True):
        if not b.tokens or not p.tokens:
            return None
        same = 0
        while same < min(len(b.tokens), len(p.tokens)) and b.tokens[same] == p.tokens[same]:
            same += 1
        agree += same
        positions += same + (1 if len(b.tokens) != len(p.tokens) or same < len(b.tokens) else 0)
    return (round(agree / positions, 3), positions) if positions else None


def judge(
    baseline: Sequence[Answer],
    patched: Sequence[Answer],
    *,
    patched_load_texts: Sequence[str] = (),
    patched_load_errors: Sequence[str] = (),
    baseline_load_errors: Sequence[str] = (),
    min_similarity: float = MIN_SIMILARITY,
    min_agreement: float = MIN_AGREEMENT,
    scores: EvalScores | None = None,
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
    notes = []
    agreed = None if baseline_reasons else agreement(baseline, patched)
    if agreed is not None and agreed[0] < min_agreement:
        reasons.append(
            f"greedy top-1 tokens agree with the baseline on {100 * agreed[0]:.0f}% of "
            f"{agreed[1]} positions (< {100 * min_agreement:.0f}%)"
        )
    elif agreed is None and not baseline_reasons:
        notes.append("the server returned no logprobs: top-1 token agreement not checked")
    judged_eval = None
    if scores is not None:
        judged_eval = asdict(scores)
        if scores.patched < scores.baseline - scores.tolerance:
            reasons.append(
                f"--eval-cmd scored {scores.patched:g} against the baseline's "
                f"{scores.baseline:g} ({scores.key}; tolerance {scores.tolerance:g})"
            )
    return Sanity(
        not reasons,
        reasons,
        score,
        baseline_reasons,
        agreement=None if agreed is None else agreed[0],
        agreement_positions=0 if agreed is None else agreed[1],
        notes=notes,
        eval=judged_eval,
    )


def eval_score(text: str, key: str) -> float:
    """The number at dotted `key` in a JSON document, or in the last line of `text` that is
    one (a command that prints progress first)."""
    doc: Any = None
    try:
        doc = json.loads(text)
    except ValueError:
        for line in reversed(text.strip().splitlines()):
            try:
                doc = json.loads(line)
                break
            except ValueError:
                continue
    if doc is None:
        raise Refused(
            "--eval-cmd gave no JSON result",
            "write it to {output}, or print it as the last line of standard output",
        )
    value = doc
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise Refused(
                f"--eval-cmd's JSON has no {key!r}",
                f"its keys are: {', '.join(map(str, doc)) if isinstance(doc, dict) else '?'}; "
                "choose with --eval-key",
            )
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refused(f"--eval-cmd's {key!r} is not a number: {value!r}")
    return float(value)
