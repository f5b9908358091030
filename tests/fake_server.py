"""A small OpenAI-compatible server for trial tests: /health, /v1/models, /v1/completions
(streaming or not), on 127.0.0.1 only, for at most --lifetime seconds.

It reads --watch at start-up and compares its CRC-32 with --pristine-crc: the tree is patched
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

vLLM's flavour: a command line starting `serve MODEL` (as `vllm serve MODEL ...`) takes vLLM's
flags too (--host, --served-model-name, --tensor-parallel-size/-tp, --max-model-len, ...),
lists the served name (the first --served-model-name, else MODEL) at /v1/models and answers a
completion for another model with vLLM's 404 ("The model `x` does not exist."). Its log lines
are in vLLM's format (vllm/logger.py: `(PROCESS pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg`,
the --log-* lines from the engine core process, `--workers N` times from Worker_TP0...N-1
where vLLM logs them per worker), coloured as vLLM's ColoredFormatter colours them with
--color, and --multiline-when-patched TEXT logs TEXT with a second line after it, continued as
vLLM's NewLineFormatter continues one (`\r\n` and the prefix again).
"""

from __future__ import annotations

import json
import os
import random
import socketserver
import sys
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()


def greedy_answer(prompt: str, n: int) -> list[str]:
    """Deterministic per prompt, as greedy decoding is (a str seed is hashed the same in
    every process)."""
    rng = random.Random(prompt)
    return [" " + rng.choice(WORDS) for _ in range(n)]


def crc(path: str) -> str:
    return f"{zlib.crc32(Path(path).read_bytes()):08x}"


# option -> default; a bool default is a flag, a list one repeats. Parsed by hand: argparse's
# import was a fifth of a start-up on a busy test machine, and the trials start hundreds.
OPTIONS: dict[str, object] = {
    "port": None, "watch": None, "pristine-crc": None, "delay-ms-pristine": "4",
    "delay-ms-patched": "4", "degenerate-when-patched": False, "crash-when-patched": False,
    "noise": "0", "seed": "0", "log-line": [], "log-when-patched": [], "logprobs": False,
    "flip-first-when-patched": False, "drift-when-patched": None,
    "eval-wrong-when-patched": False, "counter": None, "lifetime": "60", "pidfile": None,
    "color": False, "workers": "0", "multiline-when-patched": [],
}  # fmt: skip
# vLLM's flags the stand-in takes and, but for the served name, ignores.
VLLM_OPTIONS: dict[str, object] = {
    "host": None, "served-model-name": None, "tensor-parallel-size": None, "tp": None,
    "max-model-len": None, "quantization": None, "model": None,
}  # fmt: skip


def parse(argv: list[str]) -> SimpleNamespace:
    options = dict(OPTIONS)
    served = None
    if argv[:1] == ["serve"]:  # vLLM's flavour: `serve MODEL [options]`
        options.update(VLLM_OPTIONS)
        served, argv = argv[1], argv[2:]
    values = {k: list(v) if isinstance(v, list) else v for k, v in options.items()}
    # `--flag=value` as two arguments (vLLM's parser takes both forms)
    argv = [p for a in argv for p in (a.split("=", 1) if a.startswith("--") and "=" in a
                                      else [a])]
    it = iter(argv)
    for arg in it:
        name = "tp" if arg == "-tp" else arg.removeprefix("--").replace("_", "-")
        if not arg.startswith("-") or name not in options:
            sys.exit(f"fake server: unknown argument {arg}")
        if isinstance(options[name], bool):
            values[name] = True
        elif isinstance(options[name], list):
            values[name].append(next(it))  # type: ignore[union-attr]
        else:
            values[name] = next(it)
    missing = [k for k in ("port", "watch", "pristine-crc") if values[k] is None]
    if missing:
        sys.exit(f"fake server: --{missing[0]} is required")
    values["vllm"] = served is not None
    values["served"] = values.get("served-model-name") or served
    return SimpleNamespace(**{k.replace("-", "_"): v for k, v in values.items()})


def vllm_line(process: str, message: str, where: str, color: bool) -> str:
    """One record as vLLM's formatter prints it (vllm/logger.py's _FORMAT and _DATE_FORMAT;
    ColoredFormatter's colours with `color`)."""
    when = time.strftime("%m-%d %H:%M:%S")
    prefix = f"({process} pid={os.getpid()})"
    if color:
        return (f"\033[0;36m{prefix}\033[0;0m \033[32mINFO\033[0m \033[90m{when}\033[0m "
                f"\033[90m[{where}]\033[0m {message}")
    return f"{prefix} INFO {when} [{where}] {message}"


def pick(spec: str, turn: int) -> float:
    values = [float(v) for v in spec.split(",")]
    return values[turn % len(values)] / 1000.0


def main() -> None:
    args = parse(sys.argv[1:])
    if args.pidfile:
        Path(args.pidfile).write_text(str(os.getpid()))

    patched = crc(args.watch) != args.pristine_crc
    side = "patched" if patched else "pristine"
    turn = 0
    if args.counter:
        counter = Path(f"{args.counter}.{side}")
        turn = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(turn + 1))
    delay = pick(args.delay_ms_patched if patched else args.delay_ms_pristine, turn)
    noise = float(args.noise)
    if noise:
        delay *= 1 + random.Random(f"{args.seed}:{side}:{turn}").uniform(-noise, noise)
    degenerate = patched and args.degenerate_when_patched
    print(f"fake server: {side}, {delay * 1000:.1f} ms per token", flush=True)
    for line in args.log_line + (args.log_when_patched if patched else []):
        if not args.vllm:
            print(line, flush=True)
            continue
        workers = [f"Worker_TP{i}" for i in range(int(args.workers))] or ["EngineCore_DP0"]
        for process in workers:
            print(vllm_line(process, line, "base.py:237", args.color), flush=True)
    for text in args.multiline_when_patched if patched else []:
        first = vllm_line("EngineCore_DP0", text, "nvfp4.py:480", args.color)
        head = first[: first.index(text)]
        # NewLineFormatter: msg.replace("\n", "\r\n" + prefix)
        sys.stdout.write(f"{first}\r\n{head}second line of the message\n")
        sys.stdout.flush()

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
            k = int(args.drift_when_patched)
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
    threading.Timer(float(args.lifetime), lambda: os._exit(0)).start()

    class Handler(socketserver.StreamRequestHandler):
        """HTTP/1.1 with keep-alive, just what the trial's client sends: a request line,
        headers, a Content-Length body. Hand-written: http.server's imports (email, ssl) took
        more than the rest of a start-up on a busy test machine."""

        def handle(self) -> None:
            try:
                while self._one():
                    pass
            except ConnectionError:
                pass  # a client closing a keep-alive connection is not news

        def _one(self) -> bool:
            line = self.rfile.readline()
            if not line.strip():
                return False
            method, path = line.decode("latin-1").split()[:2]
            headers = {}
            while (header := self.rfile.readline().decode("latin-1").strip()) != "":
                name, _, value = header.partition(":")
                headers[name.strip().lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", "0") or 0))
            if method == "GET" and path == "/health":
                self._json({"ok": True})
            elif method == "GET" and path == "/v1/models":
                self._json({"data": [{"id": args.served or "fake-model"}]})
            elif method == "POST" and path == "/v1/completions":
                req = json.loads(body)
                if args.vllm and req.get("model") != args.served:  # vLLM's answer
                    message = f"The model `{req.get('model')}` does not exist."
                    self._json({"error": {"message": message, "type": "NotFoundError",
                                          "code": 404}}, 404)
                else:
                    self._complete(req)
            else:
                self._json({"error": "not found"}, 404)
            return True

        def _head(self, code: int, **headers: str) -> None:
            reason = {200: "OK", 404: "Not Found"}.get(code, "Error")
            lines = [f"HTTP/1.1 {code} {reason}"] + [
                f"{k.replace('_', '-')}: {v}" for k, v in headers.items()
            ]
            self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

        def _json(self, doc: object, code: int = 200) -> None:
            body = json.dumps(doc).encode()
            self._head(code, Content_Type="application/json", Content_Length=str(len(body)))
            self.wfile.write(body)
            self.wfile.flush()

        def _complete(self, req: dict) -> None:
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
            self._head(200, Content_Type="text/event-stream", Transfer_Encoding="chunked")

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

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", int(args.port)), Handler)
    if args.vllm:
        address = f"http://{args.host or '0.0.0.0'}:{args.port}"
        print(vllm_line("APIServer", f"Starting vLLM server on {address}", "entry.py:139",
                        args.color), flush=True)
    print("fake server ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
