"""A small real model behind an OpenAI-compatible API, built in code (no download): the server
`benchmarks/trial_h200.py` measures. Not part of sm120patch; it needs torch and transformers.

A transformers `LlamaForCausalLM` with random weights (seeded: every start builds the same
model), fp16 on the GPU, greedy decoding with a KV cache, static batching (the requests waiting
when a batch starts, up to --max-batch, decode together to the end). The tokenizer is a word
list made in code: a prompt's words map to ids by CRC-32, an id prints as one pseudo-word, so
answers are plain words and the trial's sanity checks read them as text. Every prompt is made
--prompt-tokens long (filled with the begin token in front, or its last words kept): a batch
then needs no padding mask, which on the lent H200 made a decode step of this model take 61 ms
instead of 13 (transformers 5.17, torch 2.11).

Endpoints: GET /health, GET /v1/models, POST /v1/completions (prompt, max_tokens, stream,
stream_options.include_usage, logprobs: OpenAI's `logprobs.tokens`; temperature and ignore_eos
are accepted: decoding is always greedy to max_tokens). It does not import SGLang, so a patch
to SGLang changes nothing here: an A/B of it against itself measures the trial's noise.

    python3 benchmarks/tiny_llama_server.py --port 30000 [--layers 16 --hidden 2048 ...]
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CONSONANTS = "bcdfghjklmnprstvwz"
VOWELS = "aeiou"


def word_list(size: int) -> list[str]:
    """`size` distinct pronounceable words: two syllables, then three."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    words = [a + b for a in syllables for b in syllables]
    words += [a + b + c for a in syllables[:12] for b in syllables for c in syllables]
    return words[:size]


class Tokenizer:
    SPECIAL = 3  # 0 pad, 1 begin, 2 end (never emitted: decoding runs to max_tokens)

    def __init__(self, vocab: int, length: int) -> None:
        self.words = word_list(vocab - self.SPECIAL)
        self.length = length

    def encode(self, text: str) -> list[int]:
        """Exactly `length` ids: the prompt's last words, the begin token in front."""
        ids = [self.SPECIAL + zlib.crc32(w.encode()) % len(self.words) for w in text.split()]
        ids = ids[-(self.length - 1) :] if self.length > 1 else []
        return [1] * (self.length - len(ids)) + ids

    def piece(self, token: int) -> str:
        return " " + self.words[token - self.SPECIAL] if token >= self.SPECIAL else ""


class Request:
    def __init__(self, ids: list[int], max_tokens: int) -> None:
        self.ids = ids
        self.max_tokens = max_tokens
        self.out: queue.Queue[tuple[int, float] | None] = queue.Queue()


class Engine:
    """One thread runs batches; handler threads submit requests and read their tokens."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        self.max_batch = args.max_batch
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=False,  # tied, a random model answers its input token back
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(args.seed)
        with torch.device("cuda"):
            self.model = LlamaForCausalLM(config).to(torch.float16).eval()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.tokenizer = Tokenizer(args.vocab, args.prompt_tokens)
        self.pending: queue.Queue[Request] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, prompt: str, max_tokens: int) -> Request:
        req = Request(self.tokenizer.encode(prompt), max(1, max_tokens))
        self.pending.put(req)
        return req

    def _loop(self) -> None:
        while True:
            batch = [self.pending.get()]
            # The rest of a round of clients: up to --max-batch, while each comes within
            # 20 ms of the one before (a batch of this model decodes for a second or more).
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.pending.get(timeout=0.02))
                except queue.Empty:
                    break
            try:
                self._run(batch)
            except Exception as exc:  # a failed batch ends its requests, not the server
                print(f"batch failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            finally:
                for req in batch:
                    req.out.put(None)

    def _run(self, batch: list[Request]) -> None:
        torch = self.torch
        ids = torch.tensor([r.ids for r in batch], device="cuda")  # all of one length
        positions = torch.arange(ids.shape[1], device="cuda").expand(len(batch), -1)
        steps = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True)
            for step in range(steps):
                logits = out.logits[:, -1].float()
                token = logits.argmax(-1)  # greedy: the top-1 token
                logprob = torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0]
                for i, (t, lp) in enumerate(zip(token.tolist(), logprob.tolist(), strict=True)):
                    if step < batch[i].max_tokens:
                        batch[i].out.put((t, lp))
                if step == steps - 1:
                    break
                positions = positions[:, -1:] + 1
                out = self.model(
                    input_ids=token[:, None],
                    position_ids=positions,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )


def serve(engine: Engine, port: int, model_name: str) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def _json(self, doc: object, code: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json({"ok": True})
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._json({"error": "not found"}, 404)
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = req["prompt"]
                if isinstance(prompt, list):
                    prompt = prompt[0]
                max_tokens = int(req.get("max_tokens") or 16)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                self._json({"error": {"message": f"bad request: {exc}"}}, 400)
                return
            job = engine.submit(str(prompt), max_tokens)
            if req.get("stream"):
                self._stream(job, bool((req.get("stream_options") or {}).get("include_usage")))
            else:
                self._whole(job, bool(req.get("logprobs")))

        def _tokens(self, job: Request) -> Any:
            while (item := job.out.get()) is not None:
                yield item

        def _whole(self, job: Request, logprobs: bool) -> None:
            pieces, lps = [], []
            for token, lp in self._tokens(job):
                pieces.append(engine.tokenizer.piece(token))
                lps.append(lp)
            choice: dict[str, Any] = {
                "index": 0,
                "text": "".join(pieces),
                "finish_reason": "length",
            }
            if logprobs:
                offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
                choice["logprobs"] = {
                    "tokens": pieces,
                    "token_logprobs": lps,
                    "top_logprobs": [{p: lp} for p, lp in zip(pieces, lps, strict=True)],
                    "text_offset": offsets,
                }
            usage = {"prompt_tokens": len(job.ids), "completion_tokens": len(pieces)}
            self._json({"object": "text_completion", "choices": [choice], "usage": usage})

        def _stream(self, job: Request, include_usage: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(doc: object) -> None:
                data = f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            count = 0
            for token, _ in self._tokens(job):
                count += 1
                chunk({"choices": [{"index": 0, "text": engine.tokenizer.piece(token)}]})
            if include_usage:
                usage = {"prompt_tokens": len(job.ids), "completion_tokens": count}
                chunk({"choices": [], "usage": usage})
            chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: object, client_address: object) -> None:
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", port), Handler)
    print(
        f"tiny llama server ready on port {port}: {engine.params / 1e9:.2f}B parameters, "
        f"{model_name}",
        flush=True,
    )
    server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    started = time.monotonic()
    print("building the model (random weights, fp16)", flush=True)
    engine = Engine(args)
    name = f"tiny-llama-{args.layers}x{args.hidden}-seed{args.seed}"
    print(f"model built in {time.monotonic() - started:.1f} s", flush=True)
    serve(engine, args.port, name)


if __name__ == "__main__":
    main()
