"""A measured trial as data: its options, its runs a side, its verdict and the exit code each
verdict has; what the trial history records of it (`MeasuredTrial.record`). `measure.py` runs
the trial, `verdict.py` decides it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import TrialUnreachable
from sm120patch.trial import decide, engines, sanity, serve

EXIT = {
    "kept": 0,
    "crashed": 3,
    "interrupted": 130,
    "inconclusive": 5,
    "inert": 5,
    "reverted-slower": 5,
    "reverted-wrong-output": 6,
    "unreachable": 8,
}
EXIT_UNREACHABLE = EXIT["unreachable"]
# Verdicts that say something about the patch: the only "you measured" lines and exports.
DECIDED = ("kept", "reverted-slower", "reverted-wrong-output")
REPEAT = 3  # default rounds: ABAB with 3 runs a side
MAX_REPEAT = 6  # default most runs a side while the figures lean without clearing the noise
MIN_RUNS = decide.MIN_RUNS

FIGURES = decide.FIGURES


@dataclass(frozen=True)
class Options:
    api: str | None = None  # None: from --ready-url, else the command's --host and --port
    ready_url: str | None = None
    ready_pattern: str | None = None
    timeout: float = 600.0
    requests: int = 64
    concurrency: int = 8
    max_tokens: int = 128
    warmup: int | None = None
    repeat: int = REPEAT
    # While the figures lean one way without clearing the noise, one more run a side, up to
    # this many (decide.GainDecision.more).
    max_repeat: int = MAX_REPEAT
    min_gain: float = 0.02
    figure: str = "output_tok_s"
    min_similarity: float = sanity.MIN_SIMILARITY
    min_agreement: float = sanity.MIN_AGREEMENT
    model: str | None = None
    bench_cmd: str | None = None  # a command line with {output} for its JSON result file
    # A quality command of the user's, run on both sides ({api}, {model}, {output}); its
    # score is the number at `eval_key` (dotted) in the JSON it writes to {output} or prints
    # last on stdout; the patched side may not score below the baseline by more than
    # `eval_tolerance`.
    eval_cmd: str | None = None
    eval_key: str = "score"
    eval_tolerance: float = 0.01
    sample_every: float = 0.25


@dataclass
class Run:
    side: str  # "baseline" or "patched"
    round: int
    started: float
    ready_s: float | None = None
    outcome: str = "ok"  # "ok", "crashed", "timeout", "died-under-load"
    exit_code: int | None = None
    figures: dict[str, Any] | None = None
    # The measured window, seconds since the epoch (time.time()), to align outside telemetry.
    window_start: float | None = None
    window_end: float | None = None
    timeline: list[dict[str, float]] = field(default_factory=list)
    power: list[dict[str, Any]] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    nvml_problem: str | None = None
    answers: list[dict[str, Any]] = field(default_factory=list)
    eval_score: float | None = None
    # patch id -> {"seen": "ran" | "skipped" | "not-seen", "line": the line that showed it}
    wiring: dict[str, dict[str, str]] = field(default_factory=dict)
    load_errors: list[str] = field(default_factory=list)
    load_texts: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    def mean_power_w(self) -> float | None:
        watts = [g["mean_w"] for g in self.gpus if g.get("mean_w") is not None]
        return sum(watts) / len(watts) if watts else None

    def answered(self) -> bool:
        """Whether anything of the API answered: one load request or one probe."""
        completed = (self.figures or {}).get("completed")
        return bool(completed) or any(a.get("error") is None for a in self.answers)


@dataclass
class MeasuredTrial:
    profile: str
    command: list[str]
    options: dict[str, Any]
    started: float
    versions: dict[str, str] = field(default_factory=dict)
    gpu_names: list[str] = field(default_factory=list)
    gpu_family: str | None = None
    runs: list[Run] = field(default_factory=list)
    summary: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)
    gain: float | None = None
    noise: float | None = None
    # Each patched run's gain over its neighbouring baseline runs (decide_gain).
    pairs: list[float] = field(default_factory=list)
    verdict: str = "crashed"
    message: str = ""
    reverted: bool = False
    sanity: dict[str, Any] | None = None
    signature: dict[str, str] | None = None
    ended: float | None = None
    id: str = field(default_factory=serve.new_id)
    kind: str = "measured"

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    @property
    def evidence(self) -> bool:
        """Whether this trial says something about the patch (DECIDED, or the patched side
        crashed): only those are "you measured" lines and exports."""
        if self.verdict == "crashed":
            return any(r.side == "patched" and r.outcome != "ok" for r in self.runs)
        return self.verdict in DECIDED

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        for run in doc["runs"]:
            run.pop("load_texts")  # checked, not kept: they would swell the history
        doc["exit_code"] = self.exit_code
        doc["evidence"] = self.evidence
        return doc

    def record(self) -> TrialRecord:
        """What the trial history keeps of it (checked as every record read back is)."""
        return TrialRecord.from_json(self.to_dict())

    def unreachable(self, *, with_record: bool) -> TrialUnreachable:
        """The error an `unreachable` verdict is shown as (exit 8); `with_record`: the trial's
        record rides along in the error's JSON."""
        return TrialUnreachable(
            self.message,
            "check --api (or --ready-url, or the command's --port): the server must answer "
            "/v1/completions there",
            details=self.to_dict() if with_record else None,
        )


def api_of(opts: Options, command: Sequence[str], engine: engines.Engine = engines.SGLANG) -> str:
    """--api, else the scheme and address of --ready-url, else where the engine's command
    listens (its --host and --port, the engine's default port without one)."""
    if opts.api:
        return opts.api.rstrip("/")
    if opts.ready_url:
        parts = urlsplit(opts.ready_url)
        return f"{parts.scheme}://{parts.netloc}"
    return engine.api(command)
