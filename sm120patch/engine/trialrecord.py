"""A trial's record (trials.json): what the tool decides on as typed fields, what it only
renders as a checked mapping, and the checks every read makes.

A record is untrusted input like every state file: `TrialRecord.check` reads each value for its
type, its shape and its size before a record is made of it, so that an edited or forged
trials.json is one line saying what to do, never a traceback in `status`, `trial show` or the
HTML report, and never a name that could pass for another trial's. `to_json` writes back the
very document it was made of (the same keys in the same order, the same values), so that the
history on disk and every `--json` stays as every earlier version wrote it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from sm120patch.errors import Refused

# A name the tool prints, matches and builds other names from (id, profile, verdict, kind):
# printable, no white space, no terminal control, bounded, so that a forged record cannot
# print as something else or run off the screen.
_WORD = re.compile(r"[^\s\x00-\x1f\x7f-\x9f]{1,200}")
# Seconds since the epoch that `time.localtime` takes on every platform (years 1970 to 2514):
# a larger one is an OverflowError where a report is drawn.
_TIME_MAX = 2.0**34
_ROUNDS_MAX = 1_000_000
_EXIT_RANGE = range(-(2**31), 2**31)

_TEXTS = ("id", "profile", "verdict", "kind", "message", "log")
_FIGURES = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
_GPU_FIGURES = {"index", "name", "mean_w", "max_w", "limit_w", "limit_share", "mean_util_pct"}


def _number(value: object) -> bool:
    # Finite and within what a float holds: `inf`, `NaN` or a thousand-digit int would be an
    # OverflowError (or nonsense) where a figure is formatted.
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < 2**63
    return isinstance(value, float) and math.isfinite(value)


def _maybe_number(value: object) -> bool:
    return value is None or _number(value)


def _time(value: object) -> bool:
    return _number(value) and isinstance(value, (int, float)) and 0 <= value <= _TIME_MAX


def _text(value: object) -> bool:
    return isinstance(value, str)


def _list_of(value: object, each: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(each(v) for v in value)


def _table_of(value: object, each: Callable[[Any], bool]) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and each(v) for k, v in value.items())


def _maybe(value: object, each: Callable[[Any], bool]) -> bool:
    return value is None or each(value)


def _power_sample(sample: object) -> bool:
    return (
        isinstance(sample, dict)
        and _number(sample.get("t"))
        and _list_of(
            sample.get("gpus"),
            lambda g: (
                isinstance(g, dict)
                and type(g.get("index")) is int
                and _maybe_number(g.get("power_w"))
            ),
        )
    )


def _gpu_figures(g: object) -> bool:
    # Drawn as `GpuFigures(**g)`: exactly its fields.
    return (
        isinstance(g, dict)
        and set(g) == _GPU_FIGURES
        and type(g["index"]) is int
        and isinstance(g["name"], str)
        and all(_maybe_number(g[k]) for k in _GPU_FIGURES - {"index", "name"})
    )


def _answer(a: object) -> bool:
    return isinstance(a, dict) and all(
        _maybe(a.get(k), _text) for k in ("prompt", "text", "error")
    )


def _evidence_line(ev: object) -> bool:
    return _table_of(ev, _text) and isinstance(ev, dict) and _text(ev.get("seen"))


def _check_run(r: dict[str, Any]) -> str:
    if not isinstance(r.get("side"), str) or type(r.get("round")) is not int:
        return "a trial's run has no side or round"
    if not 0 <= r["round"] < _ROUNDS_MAX:
        return "a trial's run has a round out of range"
    figures = r.get("figures")
    if figures is not None and (
        not isinstance(figures, dict) or not all(_maybe_number(figures.get(k)) for k in _FIGURES)
    ):
        return "a trial's run has figures that are not numbers"
    checks: tuple[tuple[str, Callable[[Any], bool]], ...] = (
        ("outcome", _text),
        ("exit_code", lambda c: c is None or (type(c) is int and c in _EXIT_RANGE)),
        ("window_start", lambda t: _maybe(t, _time)),
        ("window_end", lambda t: _maybe(t, _time)),
        (
            "timeline",
            lambda v: _list_of(
                v, lambda p: isinstance(p, dict) and _number(p.get("t")) and _number(p.get("tok_s"))
            ),
        ),
        ("power", lambda v: _list_of(v, _power_sample)),
        ("gpus", lambda v: _list_of(v, _gpu_figures)),
        ("nvml_problem", lambda v: _maybe(v, _text)),
        ("answers", lambda v: _list_of(v, _answer)),
        ("eval_score", _maybe_number),
        ("wiring", lambda v: _table_of(v, _evidence_line)),
        ("load_errors", lambda v: _list_of(v, _text)),
        ("tail", lambda v: _list_of(v, _text)),
    )
    for key, ok in checks:
        if key == "outcome" and key not in r:
            return "a trial's run has no outcome"
        if key in r and not ok(r[key]):
            return f"a trial's run has a {key} that is not what a run records"
    return ""


def _sanity(s: object) -> bool:
    if not isinstance(s, dict):
        return False
    scores = s.get("eval")
    return (
        all(_maybe_number(s.get(k)) for k in ("similarity", "agreement"))
        and _maybe(s.get("agreement_positions"), lambda n: type(n) is int)
        and all(
            _maybe(s.get(k), lambda v: _list_of(v, _text))
            for k in ("reasons", "notes", "baseline_reasons")
        )
        and (
            not scores
            or (
                isinstance(scores, dict)
                and _text(scores.get("key"))
                and all(_number(scores.get(k)) for k in ("patched", "baseline", "tolerance"))
            )
        )
    )


# What each other field of a record may hold (a run's are checked in `_check_run`).
_FIELDS: dict[str, Callable[[Any], bool]] = {
    "ended": lambda t: _maybe(t, _time),
    "reverted": lambda v: isinstance(v, bool),
    "evidence": lambda v: isinstance(v, bool),
    "versions": lambda v: _table_of(v, _text),
    "gain": _maybe_number,
    "noise": _maybe_number,
    "pairs": lambda v: _list_of(v, _number),
    "gpu_names": lambda v: _list_of(v, _text),
    "gpu_family": lambda v: _maybe(v, _text),
    "options": lambda v: isinstance(v, dict) and _maybe(v.get("figure"), _text),
    "summary": lambda v: _table_of(
        v, lambda side: _table_of(side, lambda stats: _table_of(stats, _maybe_number))
    ),
    "sanity": lambda v: _maybe(v, _sanity),
    "signature": lambda v: _maybe(v, lambda s: _table_of(s, _text) and _text(s.get("action"))),
    "tail": lambda v: _list_of(v, _text),
    "power_samples": lambda v: _list_of(v, _power_sample),
    "time_to_ready_s": _maybe_number,
}


def check_trial(t: object) -> str:
    """What is wrong with one trial's record read from trials.json, or ''."""
    if not isinstance(t, dict):
        return "a trial is not a record"
    for key in _TEXTS:
        if t.get(key) is not None and not isinstance(t[key], str):
            return f"a trial's {key} is not a string"
    command = t.get("command")
    if command is not None and not _list_of(command, _text):
        return "a trial's command is not a list of words"
    code = t.get("exit_code")
    if code is not None and (type(code) is not int or code not in _EXIT_RANGE):
        return "a trial's exit_code is not a number"
    runs = t.get("runs")
    if runs is not None:
        if not _list_of(runs, lambda r: isinstance(r, dict)):
            return "a trial's runs is not a list of records"
        for r in runs:
            problem = _check_run(r)
            if problem:
                return problem
    for key in ("profile", "verdict"):
        if key not in t:
            return f"a trial without its {key}"
    for key in ("id", "profile", "verdict", "kind"):
        if t.get(key) is not None and not _WORD.fullmatch(t[key]):
            return f"a trial's {key} {t[key][:40]!r} is not a name"
    if t.get("started") is not None and not _time(t["started"]):
        return "a trial's started is not a time"
    for key, ok in _FIELDS.items():
        if key in t and t[key] is not None and not ok(t[key]):
            return f"a trial's {key} is not what a trial records"
    return ""


def check_trials(doc: dict[str, Any]) -> str:
    trials = doc.get("trials", [])
    if not isinstance(trials, list) or not all(isinstance(t, dict) for t in trials):
        return "trials is not a list of records"
    for t in trials:
        problem = check_trial(t)
        if problem:
            return problem
    return ""


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class TrialRecord:
    """One trial, plain (`trial PROFILE -- CMD`: no `kind`) or measured (`kind: measured`).

    The typed fields are what the tool decides on: which trial it is (`id`, `key`), what ran
    (`profile`, `command`, `versions`, the GPUs), when, how it ended (`verdict`, `exit_code`,
    `reverted`, `message`) and whether it is evidence. Everything else a trial recorded (a
    measured trial's runs, pairs, summary, power, wiring, quality checks; a plain trial's
    tail, log and power samples) is `measured`: large, only ever rendered, and its shape
    varies with the version that wrote it, so it stays the checked mapping it was read as
    rather than a second copy of the run classes of `trial.measured`.
    """

    profile: str
    verdict: str
    id: str | None = None
    kind: str | None = None  # "measured" for `trial --measure`; absent for a plain trial
    command: tuple[str, ...] = ()
    # int or float as written: a value is written back exactly as it was read
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    reverted: bool | None = None
    message: str | None = None
    evidence: bool | None = None  # absent from records written before trials said so
    versions: Mapping[str, str] = field(default_factory=_empty)
    gain: float | None = None
    gpu_names: tuple[str, ...] = ()
    gpu_family: str | None = None
    measured: Mapping[str, Any] = field(default_factory=_empty)
    # The keys of the document it was read from, in its order: which optional fields it had
    # (a plain trial has no `kind`, an old one no `evidence`) and how `--json` lists them.
    # Empty for a record made here: every typed field, then `measured`.
    keys: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def is_measured(self) -> bool:
        return self.kind == "measured"

    @property
    def key(self) -> str:
        """What names one trial across targets (it is kept on each target of its profile)."""
        return self.id or f"{self.started}:{self.profile}"

    @classmethod
    def check(cls, obj: object) -> str:
        return check_trial(obj)

    @classmethod
    def from_json(cls, obj: object) -> TrialRecord:
        """The record of `obj` (one entry of trials.json, or a trial's own document), or
        Refused, one line, when it is not one."""
        problem = check_trial(obj)
        if problem:
            raise Refused(
                f"a trial record is corrupt ({problem})",
                "if it is in a target's trials.json, move that file aside (`sm120patch status` "
                "names the file)",
            )
        assert isinstance(obj, dict)
        typed = {f.name for f in fields(cls)} - {"measured", "keys"}
        # A null where a list or a table goes stays as read, in `measured`: written back null.
        typed -= {k for k in ("command", "gpu_names", "versions") if obj.get(k) is None}
        values: dict[str, Any] = {k: v for k, v in obj.items() if k in typed}
        for name in ("command", "gpu_names"):
            if name in values:
                values[name] = tuple(values[name])
        if "versions" in values:
            values["versions"] = MappingProxyType(dict(values["versions"]))
        rest = {k: v for k, v in obj.items() if k not in typed}
        return cls(**values, measured=MappingProxyType(rest), keys=tuple(obj))

    def to_json(self) -> dict[str, Any]:
        """The document this record was read from (or, made here, every field of it)."""
        typed = [f.name for f in fields(self) if f.name not in ("measured", "keys")]
        out: dict[str, Any] = {}
        for key in self.keys or (*typed, *self.measured):
            if key in self.measured:
                out[key] = self.measured[key]
            elif key in ("command", "gpu_names"):
                out[key] = list(getattr(self, key))
            elif key == "versions":
                out[key] = dict(self.versions)
            else:
                out[key] = getattr(self, key)
        return out


def trial_key(trial: TrialRecord) -> str:
    """What names one trial across targets (`TrialRecord.key`)."""
    return trial.key
