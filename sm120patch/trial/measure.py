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
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sm120patch.engine import apply, assess, revert, trials
from sm120patch.errors import Refused, UsageError
from sm120patch.targets.resolved import Given, owned
from sm120patch.trial import engines, gpu, loadgen, sanity, serve, verdict, wiring
from sm120patch.trial.measured import FIGURES, MeasuredTrial, Options, Run, api_of

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
    from sm120patch.plan import catalog

    # The targets found once, for every apply, revert and record.
    with owned(paths) as paths:
        cat = catalog.load(paths.config)
        engine = engines.of_profile(profile, cat)  # an unknown profile is a usage error first
        if not command:
            raise UsageError("give the server command after `--`", f"e.g. -- {engine.example}")
        check_options(opts, engine)
        if preconditions is not None:
            preconditions()
        applied = _applied_profiles(paths)
        others = applied - {profile}
        if others:
            raise Refused(
                f"profile {', '.join(sorted(others))} is applied; the baseline would not be "
                "pristine",
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
        declared = wiring.declared(profile, cat)
        is_applied = profile in applied
        log = serve.open_log(log_path)
        try:
            limit = max(opts.repeat, opts.max_repeat)
            round_ = 0
            while round_ < opts.repeat or (round_ < limit and verdict.leans(result, opts)):
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
                        side,
                        round_,
                        command,
                        opts,
                        on_line,
                        log,
                        declared,
                        on_wait,
                        first=round_ == 0,
                        engine=engine,
                    )
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
            verdict.judge(result, opts, engine)
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
