"""`trial PROFILE --measure`: the patch judged by measurement, baseline against patched.

The same server command runs without the profile (baseline) and with it (patched), alternated
ABAB... `repeat` times (default 3 of each), and again up to `max_repeat` (6) while the
figures lean one way without clearing the noise (`decide.GainDecision.more`). Each run: start
the server in its own process group, wait for readiness, drive the same load (built-in
generator, or `bench_cmd`) while NVML samples every GPU, ask the greedy probe prompts and run
`eval_cmd` (first run of each side), stop the group; every line of its output is read for
the profile's wiring evidence (the log lines a patch declares to show that its path ran or was
skipped). Then, first match wins:

- a crash or no readiness on either side: `crashed` (exit 3), matched against the known
  failure signatures;
- nothing answered on the baseline (no load request, no probe): `unreachable` (exit 8), an
  error of the setup (`--api`, the port), never evidence about the patch;
- answers that fail `sanity.judge`: `reverted-wrong-output` (exit 6), whatever the speed;
- a patched run whose log shows a patch's path skipped: `inert` (exit 5), quoting the line;
- the figures (`decide.decide_gain`): `kept` (exit 0), `reverted-slower` (exit 5) or `inconclusive`
  (exit 5: inside the noise, or fewer than 2 runs a side).

The profile is left applied only on `kept`. Every trial is recorded with both sides in the
trial history (`trials.record_trial`); only `kept`, `reverted-slower`, `reverted-wrong-output`
and a crash of the patched side are evidence (`evidence`: shown as "you measured" lines and
exportable). The engine never prints: server output goes to `on_line`, progress to `on_event`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sm120patch.engine import apply, assess, revert, trials
from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import Refused, TrialUnreachable, UsageError
from sm120patch.targets.resolved import Given, resolved
from sm120patch.trial import decide, engines, gpu, loadgen, sanity, serve, wiring

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

# the result keys of sglang.bench_serving and of `vllm bench serve` (the same) -> ours
BENCH_KEYS = {
    "output_throughput": "output_tok_s",
    "request_throughput": "req_s",
    "median_ttft_ms": "ttft_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "median_itl_ms": "itl_p50_ms",
    "p99_itl_ms": "itl_p99_ms",
    "completed": "completed",
    "total_output_tokens": "output_tokens",
    "duration": "duration_s",
}


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


def check_options(opts: Options, engine: engines.Engine = engines.SGLANG) -> None:
    if opts.figure not in FIGURES:
        raise UsageError(
            f"--figure {opts.figure} is not one of {', '.join(FIGURES)}",
            "the default, output_tok_s, is what the patches are meant to raise",
        )
    if min(opts.repeat, opts.max_repeat, opts.requests, opts.concurrency) < 1:
        raise UsageError(
            "--repeat, --max-repeat, --requests and --concurrency must be at least 1",
            "leave them out for the defaults (3 runs a side, up to 6 while the figures lean; "
            "64 requests, 8 in flight)",
        )
    if not 0 <= opts.min_agreement <= 1:
        raise UsageError("--min-agreement is a share between 0 and 1")
    if opts.eval_tolerance < 0:
        raise UsageError("--eval-tolerance cannot be negative")
    if opts.bench_cmd is not None and "{output}" not in opts.bench_cmd:
        raise UsageError(
            "--bench-cmd needs {output} where its JSON result file goes",
            f"e.g. --bench-cmd '{engine.bench_example}'",
        )
    for name, cmdline in (("--bench-cmd", opts.bench_cmd), ("--eval-cmd", opts.eval_cmd)):
        if cmdline is not None:
            try:
                shlex.split(cmdline)
            except ValueError as exc:
                raise UsageError(f"{name}: {exc}") from None
    if opts.ready_pattern:
        try:
            re.compile(opts.ready_pattern)
        except re.error as exc:
            raise UsageError(
                f"--ready-pattern is not a valid regular expression: {exc}",
                f"quote it for the shell, e.g. --ready-pattern '{engine.ready_line}'",
            ) from None


def _applied_profiles(paths: Given) -> set[str]:
    return {s.profile for s in assess.status(paths) if s.profile}


def run(
    profile: str,
    paths: Given,
    command: Sequence[str],
    opts: Options,
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    log_path: Path | None = None,
    on_line: Callable[[str], None] = lambda line: None,
    on_event: Callable[[str], None] = lambda line: None,
    on_wait: Callable[[float, str | None], None] | None = None,
) -> MeasuredTrial:
    """Baseline and patched, alternated; keep or revert on the figures. Never raises for a
    slow, wrong, inert, unreachable or crashed server: that is the trial's verdict
    (`exit_code`). `on_wait(elapsed, last_line)` is called every few seconds while a server
    is not ready yet."""
    engine = engines.of_profile(profile)  # an unknown profile is a usage error first
    if not command:
        raise UsageError("give the server command after `--`", f"e.g. -- {engine.example}")
    check_options(opts, engine)
    if preconditions is not None:
        preconditions()
    paths = resolved(paths)  # the targets found once, for every apply, revert and record
    applied = _applied_profiles(paths)
    others = applied - {profile}
    if others:
        raise Refused(
            f"profile {', '.join(sorted(others))} is applied; the baseline would not be pristine",
            f"revert it first (`sm120patch revert {sorted(others)[0]}`)",
        )
    if profile not in applied:
        from sm120patch.plan import planner

        planner.checked(profile, paths, force=force)  # refuse now, not after the baseline ran
    result = MeasuredTrial(profile, list(command), asdict(opts), time.time())
    result.versions = {s.target.kind: s.target.version for s in assess.status(paths)}
    found = gpu.read_gpus()
    result.gpu_names = [g.name for g in found.gpus]
    result.gpu_family = found.family
    declared = wiring.declared(profile)
    is_applied = profile in applied
    log = serve.open_log(log_path)
    try:
        limit = max(opts.repeat, opts.max_repeat)
        round_ = 0
        while round_ < opts.repeat or (round_ < limit and _leans(result, opts)):
            if round_ >= opts.repeat:
                on_event(
                    f"the figures lean but have not cleared the noise after {round_} runs a "
                    f"side: one more (--max-repeat {limit})"
                )
            for side in ("baseline", "patched"):
                want = side == "patched"
                if want and not is_applied:
                    apply.apply(profile, paths, force=force)
                elif not want and is_applied:
                    revert.revert(profile, paths)
                is_applied = want
                on_event(f"{side} run {round_ + 1} of {max(opts.repeat, round_ + 1)}")
                one = _one_run(
                    side, round_, command, opts, on_line, log, declared, on_wait,
                    first=round_ == 0, engine=engine,
                )  # fmt: skip
                result.runs.append(one)
                if one.outcome != "ok":
                    raise _Stop
                if side == "baseline" and round_ == 0 and not one.answered():
                    raise _Stop  # unreachable: more runs would not answer either
                if side == "patched" and wiring.skipped(one.wiring) is not None:
                    raise _Stop  # inert: the figures would measure the unpatched path
            round_ += 1
    except _Stop:
        pass
    except KeyboardInterrupt:
        result.verdict = "interrupted"
        result.message = "interrupted: the profile was reverted"
    except Exception:
        # A refusal between runs (a benchmark that fails, an apply that refuses): never leave
        # the profile applied by a trial that did not finish.
        if is_applied:
            revert.revert(profile, paths)
        raise
    finally:
        if log:
            log.close()
    if result.verdict != "interrupted":
        _decide(result, opts, engine)
    if result.verdict != "kept" and is_applied:
        revert.revert(profile, paths)
        result.reverted = True
    elif result.verdict == "kept" and not is_applied:  # pragma: no cover - ABAB ends patched
        apply.apply(profile, paths, force=force)
    result.ended = time.time()
    trials.record_trial(paths, profile, result.record())
    if result.verdict == "interrupted":
        raise KeyboardInterrupt
    return result


def _leans(result: MeasuredTrial, opts: Options) -> bool:
    """Whether the figures so far lean one way without clearing the noise, so that one more
    run a side could decide them (`decide.GainDecision.more`); never once the output is
    wrong: that verdict needs no more runs."""
    base = [r for r in result.runs if r.side == "baseline"]
    patched = [r for r in result.runs if r.side == "patched"]
    if not _judge_output(base, patched, opts).ok:
        return False
    decided = decide.decide_gain(
        _figure_values(base, opts.figure), _figure_values(patched, opts.figure),
        FIGURES[opts.figure][1], opts.min_gain,
    )  # fmt: skip
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


class _Stop(Exception):
    """No further runs: a side crashed, nothing answers, or the patched path did not run."""


def _one_run(
    side: str,
    round_: int,
    command: Sequence[str],
    opts: Options,
    on_line: Callable[[str], None],
    log: Any,
    declared: Sequence[wiring.Declared],
    on_wait: Callable[[float, str | None], None] | None,
    *,
    first: bool,
    engine: engines.Engine = engines.SGLANG,
) -> Run:
    api = api_of(opts, command, engine)
    ready_url = opts.ready_url or (None if opts.ready_pattern else f"{api}{engine.health}")
    pattern = re.compile(opts.ready_pattern) if opts.ready_pattern else None
    started = time.time()
    one = Run(side, round_, started)
    scan = wiring.Scan(declared)

    def each_line(line: str) -> None:
        scan.feed(serve.plain(line))  # wiring patterns read the text, not its colours
        on_line(line)

    proc = serve.spawn(command)
    watcher = serve._Watcher(proc, pattern, each_line, log)
    try:
        verdict, ready_at = serve._judge(
            proc, watcher, ready_url, pattern is not None, opts.timeout, started, on_wait
        )
        if verdict == "interrupted":
            raise KeyboardInterrupt
        if verdict != "ready":
            one.outcome = "timeout" if verdict == "timeout" else "crashed"
            one.exit_code = proc.poll()
            return one
        one.ready_s = None if ready_at is None else round(ready_at - started, 2)
        sampler = gpu.Sampler(opts.sample_every)

        def window_start() -> None:
            one.window_start = time.time()
            sampler.start()

        def window_end() -> None:
            sampler.stop()
            one.window_end = time.time()

        # The name /v1/models lists (vLLM answers no other), else the command's own.
        model = opts.model or loadgen.resolve_model(api, fallback=engine.served_name(command))
        spec = loadgen.LoadSpec(
            api=api,
            model=model,
            requests=opts.requests,
            concurrency=opts.concurrency,
            max_tokens=opts.max_tokens,
            warmup=opts.warmup,
        )
        if opts.bench_cmd:
            one.figures = _bench(opts.bench_cmd, spec, window_start, window_end, model)
        else:
            measured = loadgen.run(spec, on_start=window_start, on_end=window_end)
            one.figures = measured.figures.to_dict()
            one.timeline = measured.timeline
            one.load_errors = measured.errors
            one.load_texts = measured.texts
        one.power = sampler.samples
        one.nvml_problem = sampler.problem
        one.gpus = [asdict(g) for g in gpu.summarise(sampler.samples)]
        if first and proc.poll() is None:
            one.answers = [asdict(a) for a in loadgen.greedy_answers(api, model)]
            if opts.eval_cmd and proc.poll() is None and one.answered():
                one.eval_score = _eval(opts, api, model)
        if proc.poll() is not None:
            one.outcome = "died-under-load"
            one.exit_code = proc.returncode
        return one
    finally:
        serve._stop(proc)
        watcher.thread.join(timeout=5)
        one.tail = list(watcher.tail)
        one.wiring = scan.result()


def _bench(
    bench_cmd: str,
    spec: loadgen.LoadSpec,
    on_start: Callable[[], None],
    on_end: Callable[[], None],
    model: str = "",
) -> dict[str, Any]:
    """Run the field's own benchmark after the built-in warm-up; read its JSON result. Its
    command line gets {output} (the result file), {api} and {model} filled in."""
    loadgen.run(loadgen.LoadSpec(**{**asdict(spec), "requests": 1, "warmup": None}))
    with tempfile.TemporaryDirectory(prefix="sm120patch-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        values = {"{output}": out, "{api}": spec.api, "{model}": model}
        argv = [_fill(part, values) for part in shlex.split(bench_cmd)]
        on_start()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        finally:
            on_end()
        if done.returncode != 0 or not os.path.exists(out):
            raise Refused(
                f"--bench-cmd exited with code {done.returncode} and wrote no result",
                _last_line(done) or "run the benchmark by hand against the server",
            )
        lines = [ln for ln in Path(out).read_text(encoding="utf-8").splitlines() if ln.strip()]
    # bench_serving appends one JSON line per run; `vllm bench serve` writes one document.
    doc = json.loads(lines[-1])
    # A figure the benchmark wrote as NaN or infinity is one it did not measure: a record
    # holds finite numbers only (`TrialRecord.check`), or the trial could not be kept.
    figures: dict[str, Any] = {
        ours: None if isinstance(v := doc.get(theirs), float) and not math.isfinite(v) else v
        for theirs, ours in BENCH_KEYS.items()
    }
    figures["source"] = "bench-cmd"
    return figures


def _fill(part: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        part = part.replace(key, value)
    return part


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    text = (done.stderr or done.stdout or "").strip()
    return text.splitlines()[-1] if text else ""


def _eval(opts: Options, api: str, model: str) -> float:
    """Run the user's quality command against this side's server; its score at `eval_key`."""
    assert opts.eval_cmd is not None
    with tempfile.TemporaryDirectory(prefix="sm120patch-eval-") as tmp:
        out = os.path.join(tmp, "result.json")
        values = {"{output}": out, "{api}": api, "{model}": model}
        argv = [_fill(part, values) for part in shlex.split(opts.eval_cmd)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise Refused(f"--eval-cmd cannot start {argv[0]}: {exc.strerror}") from None
        if done.returncode != 0:
            raise Refused(
                f"--eval-cmd exited with code {done.returncode}",
                _last_line(done) or "run the quality command by hand against the server",
            )
        text = Path(out).read_text(encoding="utf-8") if os.path.exists(out) else done.stdout
    return sanity.eval_score(text, opts.eval_key)


# ---- the verdict --------------------------------------------------------------------------


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


def _decide(result: MeasuredTrial, opts: Options,
            engine: engines.Engine = engines.SGLANG) -> None:
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
        _figure_values(base, opts.figure), _figure_values(patched, opts.figure), higher,
        opts.min_gain,
    )  # fmt: skip
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
