"""The built-in load: fixed prompts streamed through `/v1/completions`, the OpenAI-compatible
API that SGLang and vLLM servers both serve, so one generator measures either.

Greedy (temperature 0), fixed prompts and `max_tokens`, `requests` requests with at most
`concurrency` in flight, after `warmup` requests that are not counted. Output tokens come from
the API's `usage` when the server sends it (`stream_options.include_usage`), else one per
streamed chunk that carries text. httpx is imported here only, when a load runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Fixed prompts: varied enough that a batch is not one prompt repeated, short enough that the
# measurement is dominated by decode, which is what the SM120 patches change.
PROMPTS: tuple[str, ...] = (
    "Explain in plain words how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the steps to bake bread at home, with the reason for each step.",
    "What are the trade-offs between tensor parallelism and pipeline parallelism?",
    "Describe the water cycle to a ten-year-old.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "Give three tips for writing clear technical documentation, and explain each.",
    "How does a transistor work? Answer for a curious high-school student.",
)

# Greedy probes for output sanity: short factual prompts whose answers are plain text, compared
# between baseline and patched.
SANITY_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Count from one to ten in words: one, two,",
    "Q: What is 12 plus 30?\nA:",
    "Translate to French: good morning, my friend.",
)

POINTS = 40  # points of the throughput timeline per run
MIN_STEP = 0.02  # seconds


@dataclass(frozen=True)
class LoadSpec:
    api: str  # base URL, e.g. http://127.0.0.1:30000
    model: str | None = None  # None: the first of /v1/models
    requests: int = 64
    concurrency: int = 8
    max_tokens: int = 128
    warmup: int | None = None  # None: one round of `concurrency` requests
    timeout: float = 300.0
    prompts: tuple[str, ...] = PROMPTS


@dataclass
class Figures:
    output_tok_s: float
    req_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    completed: int
    failed: int
    output_tokens: int
    duration_s: float
    tokens_from_usage: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    figures: Figures
    timeline: list[dict[str, float]] = field(default_factory=list)  # {"t", "tok_s"}
    texts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Answer:
    prompt: str
    text: str
    error: str | None = None
    # The greedy tokens, where the server returns logprobs (OpenAI's `logprobs.tokens`):
    # each is the top-1 token at its step.
    tokens: list[str] | None = None


@dataclass
class _Request:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    usage_tokens: int | None = None
    error: str | None = None
    end: float = 0.0

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default), q in 0..100."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _plain(api: str) -> dict[str, Any]:
    """A client for a plain-HTTP API needs no TLS: without `verify=False` httpx builds a
    certificate store for every client, a tenth of a second each on a busy machine, twice a
    run."""
    return {"verify": False} if api.lower().startswith("http://") else {}


def resolve_model(api: str, timeout: float = 10.0, fallback: str | None = None) -> str:
    """The served model's name from /v1/models (SGLang accepts any name, vLLM answers 404 to
    another); where that is not answered, `fallback` (the name the server command gives)."""
    import httpx

    try:
        doc = httpx.get(f"{api}/v1/models", timeout=timeout, **_plain(api)).json()
        return str(doc["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return fallback or "default"


def run(
    spec: LoadSpec,
    *,
    on_start: Callable[[], None] = lambda: None,
    on_end: Callable[[], None] = lambda: None,
) -> LoadResult:
    """Warm up, then call `on_start`, drive the measured load, call `on_end` (the NVML window)."""
    return asyncio.run(_run(spec, on_start, on_end))


def greedy_answers(
    api: str, model: str, prompts: Sequence[str] = SANITY_PROMPTS, max_tokens: int = 32
) -> list[Answer]:
    """The greedy answers to the probe prompts, one at a time (batch size 1), with their tokens
    where the server gives logprobs. A server that refuses `logprobs` is asked again without."""
    import httpx

    answers = []
    with httpx.Client(timeout=120.0, **_plain(api)) as client:
        for prompt in prompts:
            body: dict[str, Any] = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
            }
            try:
                response = client.post(f"{api}/v1/completions", json=body)
                if 400 <= response.status_code < 500:
                    del body["logprobs"]
                    response = client.post(f"{api}/v1/completions", json=body)
                if response.status_code != 200:
                    answers.append(Answer(prompt, "", f"HTTP {response.status_code}"))
                    continue
                choice = response.json()["choices"][0]
                answers.append(Answer(prompt, choice.get("text") or "", None, _tokens(choice)))
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                answers.append(Answer(prompt, "", f"{type(exc).__name__}: {exc}"))
    return answers


def _tokens(choice: dict[str, Any]) -> list[str] | None:
    """OpenAI's completion logprobs: `{"tokens": [...], "token_logprobs": [...], ...}`."""
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        return None
    return tokens


async def _run(
    spec: LoadSpec, on_start: Callable[[], None], on_end: Callable[[], None]
) -> LoadResult:
    import httpx

    model = spec.model or resolve_model(spec.api)
    limits = httpx.Limits(
        max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency
    )
    async with httpx.AsyncClient(timeout=spec.timeout, limits=limits, **_plain(spec.api)) as client:
        warmup = spec.concurrency if spec.warmup is None else spec.warmup
        if warmup:
            await _drive(client, spec, model, warmup, time.perf_counter())
        on_start()
        try:
            t0 = time.perf_counter()
            done = await _drive(client, spec, model, spec.requests, t0)
            t1 = time.perf_counter()
        finally:
            on_end()
    return _result(done, t1 - t0)


async def _drive(client: Any, spec: LoadSpec, model: str, count: int, t0: float) -> list[_Request]:
    gate = asyncio.Semaphore(spec.concurrency)

    async def one(i: int) -> _Request:
        async with gate:
            return await _stream(client, spec, model, spec.prompts[i % len(spec.prompts)], t0)

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def _stream(client: Any, spec: LoadSpec, model: str, prompt: str, t0: float) -> _Request:
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Every request decodes max_tokens, so both sides do the same work.
        "ignore_eos": True,
    }
    req = _Request(start=time.perf_counter() - t0)
    try:
        async with client.stream("POST", f"{spec.api}/v1/completions", json=body) as response:
            if response.status_code != 200:
                req.error = f"HTTP {response.status_code}"
                await response.aread()
                return req
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                doc = json.loads(data)
                usage = doc.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    req.usage_tokens = int(usage["completion_tokens"])
                for choice in doc.get("choices") or []:
                    piece = choice.get("text") or ""
                    if piece:
                        req.chunk_times.append(time.perf_counter() - t0)
                        req.text += piece
    except (httpx.HTTPError, ValueError, TypeError, AttributeError, KeyError) as exc:
        # A transport error or a malformed event: this request failed, the load goes on.
        req.error = f"{type(exc).__name__}: {exc}"
    finally:
        req.end = time.perf_counter() - t0
    return req


def _result(done: list[_Request], duration: float) -> LoadResult:
    ok = [r for r in done if r.error is None]
    ttfts = [(r.chunk_times[0] - r.start) * 1000 for r in ok if r.chunk_times]
    itls = [
        (b - a) * 1000 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
    ]
    tokens = sum(r.tokens for r in ok)
    figures = Figures(
        output_tok_s=round(tokens / duration, 2) if duration > 0 else 0.0,
        req_s=round(len(ok) / duration, 3) if duration > 0 else 0.0,
        ttft_p50_ms=_round(percentile(ttfts, 50)),
        ttft_p99_ms=_round(percentile(ttfts, 99)),
        itl_p50_ms=_round(percentile(itls, 50)),
        itl_p99_ms=_round(percentile(itls, 99)),
        completed=len(ok),
        failed=len(done) - len(ok),
        output_tokens=tokens,
        duration_s=round(duration, 3),
        tokens_from_usage=bool(ok) and all(r.usage_tokens is not None for r in ok),
    )
    return LoadResult(
        figures,
        timeline(ok, duration),
        [r.text for r in ok],
        [r.error for r in done if r.error],
    )


def timeline(done: Sequence[_Request], duration: float) -> list[dict[str, float]]:
    """Output tokens/s over the window in about POINTS equal steps (of at least about MIN_STEP
    seconds) that tile it exactly: the last ends with the window, none lies past it. A request's
    chunks are weighted so that they sum to its `usage` token count when sent."""
    if duration <= 0:
        return []
    count = max(1, round(duration / max(duration / POINTS, MIN_STEP)))
    step = duration / count
    buckets = [0.0] * count
    for r in done:
        if not r.chunk_times:
            continue
        weight = r.tokens / len(r.chunk_times)
        for t in r.chunk_times:
            buckets[min(max(int(t / step), 0), count - 1)] += weight
    # Each point at its bucket's middle: the rate over [i * step, (i + 1) * step).
    return [
        {"t": round((i + 0.5) * step, 3), "tok_s": round(n / step, 2)}
        for i, n in enumerate(buckets)
    ]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
