"""`trial PROFILE --measure`: the patch judged by measurement, baseline against patched.

The same server command runs without the profile (baseline) and with it (patched), alternated
ABAB... `repeat` times. Each run: start the server in its own process group, wait for
readiness, drive the same load (built-in generator, or `bench_cmd`) while NVML samples every
GPU, ask the greedy probe prompts (first run of each side), stop the group. Then:

- a crash or no readiness on either side: verdict `crashed` (exit 3), matched against the
  known failure signatures; the profile is left reverted;
- answers that fail `sanity.judge`: `reverted-wrong-output` (exit 6), whatever the speed;
- the chosen figure's gain of the patched median over the baseline median must reach
  `min_gain` plus the measured noise (the larger relative spread, (max - min) / median, of the
  two sides): `kept` (exit 0); a gain of `min_gain` that the noise swallows:
  `reverted-noise` (exit 5); less: `reverted-slower` (exit 5).

Every trial is recorded with both sides in the trial history (`trials.record_trial`).
The engine never prints: server output goes to `on_line`, progress to `on_event`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sm120patch.engine import apply, assess, revert, trials
from sm120patch.errors import Refused, UsageError
from sm120patch.trial import gpu, loadgen, sanity, serve

EXIT = {
    "kept": 0,
    "crashed": 3,
    "interrupted": 130,
    "reverted-slower": 5,
    "reverted-noise": 5,
    "reverted-wrong-output": 6,
}

# figure -> (unit shown, higher is better)
FIGURES: dict[str, tuple[str, bool]] = {
    "output_tok_s": ("tok/s", True),
    "req_s": ("req/s", True),
    "ttft_p50_ms": ("ms TTFT p50", False),
    "ttft_p99_ms": ("ms TTFT p99", False),
    "itl_p50_ms": ("ms ITL p50", False),
    "itl_p99_ms": ("ms ITL p99", False),
}

# sglang.bench_serving's result keys -> ours
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
    api: str | None = None  # None: from --ready-url, the command's --port, or :30000
    ready_url: str | None = None
    ready_pattern: str | None = None
    timeout: float = 600.0
    requests: int = 64
    concurrency: int = 8
    max_tokens: int = 128
    warmup: int | None = None
    repeat: int = 1
    min_gain: float = 0.02
    figure: str = "output_tok_s"
    min_similarity: float = sanity.MIN_SIMILARITY
    model: str | None = None
    bench_cmd: str | None = None  # a command line with {output} for its JSON result file
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
    timeline: list[dict[str, float]] = field(default_factory=list)
    power: list[dict[str, Any]] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    nvml_problem: str | None = None
    answers: list[dict[str, Any]] = field(default_factory=list)
    load_errors: list[str] = field(default_factory=list)
    load_texts: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    def mean_power_w(self) -> float | None:
        watts = [g["mean_w"] for g in self.gpus if g.get("mean_w") is not None]
        return sum(watts) / len(watts) if watts else None


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

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        for run in doc["runs"]:
            run.pop("load_texts")  # checked, not kept: they would swell the history
        doc["exit_code"] = self.exit_code
        return doc


def api_of(opts: Options, command: Sequence[str]) -> str:
    if opts.api:
        return opts.api.rstrip("/")
    if opts.ready_url:
        parts = urlsplit(opts.ready_url)
        return f"{parts.scheme}://{parts.netloc}"
    port = "30000"  # SGLang's default
    for flag, value in zip(command, command[1:], strict=False):
        if flag == "--port":
            port = value
    return f"http://127.0.0.1:{port}"


def check_options(opts: Options) -> None:
    if opts.figure not in FIGURES:
        raise UsageError(
            f"--figure {opts.figure} is not one of {', '.join(FIGURES)}",
            "the default, output_tok_s, is what the patches are meant to raise",
        )
    if opts.repeat < 1 or opts.requests < 1 or opts.concurrency < 1:
        raise UsageError(
            "--repeat, --requests and --concurrency must be at least 1",
            "leave them out for the defaults (1 round, 64 requests, 8 in flight)",
        )
    if opts.bench_cmd is not None and "{output}" not in opts.bench_cmd:
        raise UsageError(
            "--bench-cmd needs {output} where its JSON result file goes",
            "e.g. --bench-cmd 'python -m sglang.bench_serving --backend sglang "
            "--num-prompts 200 --output-file {output}'",
        )
    if opts.ready_pattern:
        try:
            re.compile(opts.ready_pattern)
        except re.error as exc:
            raise UsageError(
                f"--ready-pattern is not a valid regular expression: {exc}",
                "quote it for the shell, e.g. --ready-pattern 'The server is fired up'",
            ) from None


def _applied_profiles(paths: Mapping[str, str | Path | None]) -> set[str]:
    return {s.profile for s in assess.status(paths) if s.profile}


def run(
    profile: str,
    paths: Mapping[str, str | Path | None],
    command: Sequence[str],
    opts: Options,
    *,
    force: bool = False,
    preconditions: Callable[[], None] | None = None,
    log_path: Path | None = None,
    on_line: Callable[[str], None] = lambda line: None,
    on_event: Callable[[str], None] = lambda line: None,
) -> MeasuredTrial:
    """Baseline and patched, alternated; keep or revert on the figures. Never raises for a
    slow, wrong or crashed server: that is the trial's verdict (`exit_code`)."""
    if not command:
        raise UsageError(
            "give the server command after `--`",
            "e.g. -- python -m sglang.launch_server --model-path MODEL --port 30000",
        )
    check_options(opts)
    from sm120patch.plan import catalog

    catalog.load().profile(profile)  # an unknown profile is a usage error before anything runs
    if preconditions is not None:
        preconditions()
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
    probe = gpu.probe()
    result.gpu_names = [g.name for g in probe.gpus]
    result.gpu_family = probe.family
    is_applied = profile in applied
    log = serve.open_log(log_path)
    try:
        for round_ in range(opts.repeat):
            for side in ("baseline", "patched"):
                want = side == "patched"
                if want and not is_applied:
                    apply.apply(profile, paths, force=force)
                elif not want and is_applied:
                    revert.revert(profile, paths)
                is_applied = want
                on_event(f"{side} run {round_ + 1} of {opts.repeat}")
                one = _one_run(side, round_, command, opts, on_line, log, first=round_ == 0)
                result.runs.append(one)
                if one.outcome != "ok":
                    raise _Stop
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
        _decide(result, opts)
    if result.verdict != "kept" and is_applied:
        revert.revert(profile, paths)
        result.reverted = True
    elif result.verdict == "kept" and not is_applied:  # pragma: no cover - ABAB ends patched
        apply.apply(profile, paths, force=force)
    result.ended = time.time()
    trials.record_trial(paths, profile, result.to_dict())
    if result.verdict == "interrupted":
        raise KeyboardInterrupt
    return result


class _Stop(Exception):
    """A side crashed: no further runs."""


def _one_run(
    side: str,
    round_: int,
    command: Sequence[str],
    opts: Options,
    on_line: Callable[[str], None],
    log: Any,
    *,
    first: bool,
) -> Run:
    api = api_of(opts, command)
    ready_url = opts.ready_url or (None if opts.ready_pattern else f"{api}/health")
    pattern = re.compile(opts.ready_pattern) if opts.ready_pattern else None
    started = time.time()
    one = Run(side, round_, started)
    proc = serve.spawn(command)
    watcher = serve._Watcher(proc, pattern, on_line, log)
    try:
        verdict, ready_at = serve._judge(
            proc, watcher, ready_url, pattern is not None, opts.timeout, started
        )
        if verdict == "interrupted":
            raise KeyboardInterrupt
        if verdict != "ready":
            one.outcome = "timeout" if verdict == "timeout" else "crashed"
            one.exit_code = proc.poll()
            return one
        one.ready_s = None if ready_at is None else round(ready_at - started, 2)
        sampler = gpu.Sampler(opts.sample_every)
        model = opts.model or loadgen.resolve_model(api)
        spec = loadgen.LoadSpec(
            api=api,
            model=model,
            requests=opts.requests,
            concurrency=opts.concurrency,
            max_tokens=opts.max_tokens,
            warmup=opts.warmup,
        )
        if opts.bench_cmd:
            one.figures = _bench(opts.bench_cmd, spec, sampler)
        else:
            measured = loadgen.run(spec, on_start=sampler.start, on_end=sampler.stop)
            one.figures = measured.figures.to_dict()
            one.timeline = measured.timeline
            one.load_errors = measured.errors
            one.load_texts = measured.texts
        one.power = sampler.samples
        one.nvml_problem = sampler.problem
        one.gpus = [asdict(g) for g in gpu.summarise(sampler.samples)]
        if first and proc.poll() is None:
            one.answers = [asdict(a) for a in loadgen.probe(api, model)]
        if proc.poll() is not None:
            one.outcome = "died-under-load"
            one.exit_code = proc.returncode
        return one
    finally:
        serve._stop(proc)
        watcher.thread.join(timeout=5)
        one.tail = list(watcher.tail)


def _bench(bench_cmd: str, spec: loadgen.LoadSpec, sampler: gpu.Sampler) -> dict[str, Any]:
    """Run the field's own benchmark after the built-in warm-up; read its JSON result."""
    loadgen.run(loadgen.LoadSpec(**{**asdict(spec), "requests": 1, "warmup": None}))
    with tempfile.TemporaryDirectory(prefix="sm120patch-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [part.replace("{output}", out) for part in shlex.split(bench_cmd)]
        sampler.start()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        finally:
            sampler.stop()
        if done.returncode != 0 or not os.path.exists(out):
            raise Refused(
                f"--bench-cmd exited with code {done.returncode} and wrote no result",
                (done.stderr or done.stdout).strip().splitlines()[-1:][0]
                if (done.stderr or done.stdout).strip()
                else "run the benchmark by hand against the server",
            )
        lines = [ln for ln in Path(out).read_text(encoding="utf-8").splitlines() if ln.strip()]
    doc = json.loads(lines[-1])  # bench_serving appends one JSON line per run
    figures: dict[str, Any] = {ours: doc.get(theirs) for theirs, ours in BENCH_KEYS.items()}
    figures["source"] = "bench-cmd"
    return figures


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "spread": None}
    med = statistics.median(values)
    spread = (max(values) - min(values)) / med if med else 0.0
    return {
        "median": round(med, 3),
        "min": min(values),
        "max": max(values),
        "spread": round(spread, 4),
    }


def _decide(result: MeasuredTrial, opts: Options) -> None:
    bad = next((r for r in result.runs if r.outcome != "ok"), None)
    if bad is not None:
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
        return
    for side in ("baseline", "patched"):
        runs = [r for r in result.runs if r.side == side]
        result.summary[side] = {
            name: _stats([r.figures[name] for r in runs if r.figures.get(name) is not None])
            for name in FIGURES
        }
        result.summary[side]["power_w"] = _stats(
            [p for r in runs if (p := r.mean_power_w()) is not None]
        )
    base = [r for r in result.runs if r.side == "baseline"]
    patched = [r for r in result.runs if r.side == "patched"]
    verdict = sanity.judge(
        [loadgen.Answer(**a) for a in base[0].answers],
        [loadgen.Answer(**a) for a in patched[0].answers],
        patched_load_texts=[t for r in patched for t in r.load_texts],
        patched_load_errors=[e for r in patched for e in r.load_errors],
        baseline_load_errors=[e for r in base for e in r.load_errors],
        min_similarity=opts.min_similarity,
    )
    result.sanity = asdict(verdict)
    unit, higher = FIGURES[opts.figure]
    b = result.summary["baseline"][opts.figure]
    p = result.summary["patched"][opts.figure]
    if b["median"] and p["median"]:
        ratio = p["median"] / b["median"] if higher else b["median"] / p["median"]
        result.gain = round(ratio - 1, 4)
    result.noise = max(b["spread"] or 0.0, p["spread"] or 0.0)
    figures = _figures_line(result, opts.figure, unit)
    if not verdict.ok:
        result.verdict = "reverted-wrong-output"
        result.message = f"{figures}, but the output is wrong ({verdict.reasons[0]}): reverted"
    elif result.gain is None:
        result.verdict = "reverted-slower"
        result.message = f"no {opts.figure} was measured on one side: reverted"
    elif result.gain >= opts.min_gain + result.noise:
        result.verdict = "kept"
        result.message = f"{figures}: kept"
        if opts.repeat == 1:
            result.message += " (one run each: no spread measured; --repeat 3 shows the noise)"
    elif result.gain >= opts.min_gain:
        result.verdict = "reverted-noise"
        result.message = (
            f"{figures}: the gain is inside the measured spread "
            f"(±{100 * result.noise:.1f}% + --min-gain {100 * opts.min_gain:g}%): reverted"
        )
    else:
        result.verdict = "reverted-slower"
        result.message = f"{figures}: reverted"


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
