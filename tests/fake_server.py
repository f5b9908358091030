"""A small OpenAI-compatible server for trial tests: /health, /v1/models, /v1/completions
(streaming or not), on 127.0.0.1 only, for at most --lifetime seconds.

It reads --watch at start-up and compares its sha256 with --pristine-sha: the tree is patched
when they differ. What it does then comes from the options for that side, so an A/B trial run
by the real trial code sees exactly the difference the patch made:
  --delay-ms-patched / --delay-ms-pristine  per-token delay; a comma list is taken in turn by
                                            successive start-ups (counted in --counter FILE)
  --noise F --seed N                        each start's delay times 1 + uniform(-F, F), drawn
                                            from (seed, side, start): run-to-run noise
  --degenerate-when-patched                 answer "!!!!..." when patched
  --crash-when-patched                      print FlashInfer's arch error and exit 1 when patched
  --log-line TEXT / --log-when-patched TEXT print TEXT at start (always / when patched): the
                                            lines a patch's wiring evidence is read from
  --logprobs                                send OpenAI logprobs (the greedy tokens) on request
  --flip-first-when-patched                 patched answers start with another word
  --drift-when-patched K                    patched answers go another way from word K on
  --eval-wrong-when-patched                 answer prompts starting "EVAL:" wrongly when patched
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()


def greedy_answer(prompt: str, n: int) -> list[str]:
    """Deterministic per prompt, as greedy decoding is."""
    seed = int(hashlib.sha256(prompt.encode()).hexdigest(), 16)
    return [" " + WORDS[(seed >> (3 * i)) % len(WORDS)] for i in range(n)]


def pick(spec: str, turn: int) -> float:
    values = [float(v) for v in spec.split(",")]
    return values[turn % len(values)] / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--watch", required=True)
    ap.add_argument("--pristine-sha", required=True)
    ap.add_argument("--delay-ms-pristine", default="4")
    ap.add_argument("--delay-ms-patched", default="4")
    ap.add_argument("--degenerate-when-patched", action="store_true")
    ap.add_argument("--crash-when-patched", action="store_true")
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--seed", default="0")
    ap.add_argument("--log-line", action="append", default=[])
    ap.add_argument("--log-when-patched", action="append", default=[])
    ap.add_argument("--logprobs", action="store_true")
    ap.add_argument("--flip-first-when-patched", action="store_true")
    ap.add_argument("--drift-when-patched", type=int, default=None)
    ap.add_argument("--eval-wrong-when-patched", action="store_true")
    ap.add_argument("--counter", default=None)
    ap.add_argument("--lifetime", type=float, default=60.0)
    ap.add_argument("--pidfile", default=None)
    args = ap.parse_args()
    if args.pidfile:
        Path(args.pidfile).write_text(str(os.getpid()))

    patched = hashlib.sha256(Path(args.watch).read_bytes()).hexdigest() != args.pristine_sha
    side = "patched" if patched else "pristine"
    turn = 0
    if args.counter:
        counter = Path(f"{args.counter}.{side}")
        turn = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(turn + 1))
    delay = pick(args.delay_ms_patched if patched else args.delay_ms_pristine, turn)
    if args.noise:
        delay *= 1 + random.Random(f"{args.seed}:{side}:{turn}").uniform(-args.noise, args.noise)
    degenerate = patched and args.degenerate_when_patched
    print(f"fake server: {side}, {delay * 1000:.1f} ms per token", flush=True)
    for line in args.log_line + (args.log_when_patched if patched else []):
        print(line, flush=True)

    def answer(prompt: str, n: int) -> list[str]:
        if prompt.startswith("EVAL:"):
            wrong = patched and args.eval_wrong_when_patched
            return ([" wrong"] if wrong else [" right"]) + [" ."] * (n - 1)
        if degenerate:
            return ["!!!!"] * n
        words = greedy_answer(prompt, n)
        if patched and args.flip_first_when_patched:
            words[0] = " elsewhere"
        if patched and args.drift_when_patched is not None:
            k = args.drift_when_patched
            words[k:] = greedy_answer("drift:" + prompt, n)[k:]
        return words

    if patched and args.crash_when_patched:
        print("loading model", flush=True)
        print(
            "RuntimeError: No supported CUDA architectures found for major versions [9, 10].",
            flush=True,
        )
        sys.exit(1)

    # Bounded run: a test that forgets the server cannot leave it behind.
    threading.Timer(args.lifetime, lambda: os._exit(0)).start()

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
                self._json({"data": [{"id": "fake-model"}]})
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._json({"error": "not found"}, 404)
                return
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = int(req.get("max_tokens", 16))
            words = answer(req["prompt"], n)
            if not req.get("stream"):  # the probes: only the streamed load is timed
                choice: dict[str, object] = {"text": "".join(words)}
                if args.logprobs and req.get("logprobs"):
                    choice["logprobs"] = {
                        "tokens": words,
                        "token_logprobs": [-0.1] * n,
                        "top_logprobs": [{w: -0.1} for w in words],
                        "text_offset": [sum(map(len, words[:i])) for i in range(n)],
                    }
                self._json({"choices": [choice], "usage": {"completion_tokens": n}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(doc: object) -> None:
                data = f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            for word in words:
                time.sleep(delay)
                chunk({"choices": [{"text": word}]})
            if (req.get("stream_options") or {}).get("include_usage"):
                chunk({"choices": [], "usage": {"completion_tokens": n}})
            chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: object, client_address: object) -> None:
            # A client closing a keep-alive connection is not news; anything else is.
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", args.port), Handler)
    print("fake server ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
