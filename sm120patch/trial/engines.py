"""The server a trial runs, per engine: what the trial reads of its command line (the port and
host it listens on, the model name its API serves, the TP size and the model directory the
known outcomes match on), where its readiness is, and the examples its hints show.

The engine is chosen from the profile, never guessed from the command: a profile whose
patches target vLLM (`Patch.target == "vllm"`) runs a vLLM server, any other an SGLang one.
Both serve the same OpenAI-compatible API (`/v1/models`, `/v1/completions`) and answer
`GET /health` with 200 once the engine is up, so the load, the probes and the readiness check
are one code; what differs is the command's spelling:

- SGLang (`python -m sglang.launch_server`): `--model-path`/`--model`, `--port` (default
  30000), `--host`, `--served-model-name`, `--tp`/`--tp-size`/`--tensor-parallel-size`;
- vLLM (`vllm serve MODEL`, `python -m vllm.entrypoints.openai.api_server --model MODEL`): the
  model positional after `serve` or `--model`, `--port` (default 8000), `--host`,
  `--served-model-name` (one or more names; the first is what `/v1/models` lists first),
  `--tensor-parallel-size`/`-tp`. vLLM's parser (FlexibleArgumentParser) also takes
  `--flag=value` and underscores for dashes (`--tensor_parallel_size`), read here the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sm120patch.plan.catalog import Catalog

from collections.abc import Sequence
from dataclasses import dataclass

# Addresses a server listens on that a client reaches as the loopback.
_ANY = ("0.0.0.0", "::", "[::]", "", "localhost")


@dataclass(frozen=True)
class Engine:
    kind: str  # the target kind its profiles patch: "sglang" or "vllm"
    name: str
    default_port: int
    model_flags: tuple[str, ...]
    tp_flags: tuple[str, ...]
    example: str  # a server command, for hints
    bench_example: str  # a --bench-cmd, for hints
    ready_line: str  # a line its server prints once it answers, for --ready-pattern hints
    # vLLM: the subcommand after which the model is the first positional argument
    positional_after: str | None = None
    health: str = "/health"

    def value(self, command: Sequence[str], *names: str) -> str | None:
        """The value of the last of `names` on the command line (`--flag VALUE` or
        `--flag=VALUE`; argparse keeps the last), dashes and underscores alike."""
        wanted = {_norm(n) for n in names}
        found = None
        for i, part in enumerate(command):
            flag, eq, rest = part.partition("=")
            if not flag.startswith("-") or _norm(flag) not in wanted:
                continue
            if eq:
                found = rest
            elif i + 1 < len(command):
                found = command[i + 1]
        return found

    def port(self, command: Sequence[str]) -> str:
        return self.value(command, "--port") or str(self.default_port)

    def host(self, command: Sequence[str]) -> str:
        """Where a client on this box reaches the server: the loopback where it listens on
        every address (the default of both engines), else the address it names."""
        host = self.value(command, "--host") or ""
        if host in _ANY:
            return "127.0.0.1"
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    def api(self, command: Sequence[str]) -> str:
        return f"http://{self.host(command)}:{self.port(command)}"

    def model_path(self, command: Sequence[str]) -> str | None:
        """The model the command serves (a directory or a hub name)."""
        if self.positional_after is not None:  # vLLM: `serve MODEL` wins over --model
            given = _positional_after(command, self.positional_after)
            if given:
                return given
        return self.value(command, *self.model_flags)

    def served_name(self, command: Sequence[str]) -> str | None:
        """The name the API serves the model under, as the command says it: the first
        `--served-model-name`, else the model path (both engines' default)."""
        return self.value(command, "--served-model-name") or self.model_path(command)

    def tp(self, command: Sequence[str]) -> str | None:
        return self.value(command, *self.tp_flags)


def _norm(flag: str) -> str:
    return flag.replace("_", "-")


def _positional_after(command: Sequence[str], word: str) -> str | None:
    """The first argument after `word` that is not an option (vLLM's `serve MODEL`)."""
    try:
        start = list(command).index(word) + 1
    except ValueError:
        return None
    rest = command[start:]
    return rest[0] if rest and not rest[0].startswith("-") else None


SGLANG = Engine(
    kind="sglang",
    name="SGLang",
    default_port=30000,
    model_flags=("--model-path", "--model"),
    tp_flags=("--tp", "--tp-size", "--tensor-parallel-size"),
    example="python -m sglang.launch_server --model-path MODEL --port 30000",
    bench_example="python -m sglang.bench_serving --backend sglang --port 30000 "
    "--num-prompts 200 --output-file {output}",
    ready_line="The server is fired up",
)
VLLM = Engine(
    kind="vllm",
    name="vLLM",
    default_port=8000,
    model_flags=("--model",),
    tp_flags=("--tensor-parallel-size", "-tp"),
    example="vllm serve MODEL --port 8000",
    # vLLM writes its result with --save-result, to --result-filename (one JSON document
    # with bench_serving's keys).
    bench_example="vllm bench serve --backend vllm --base-url {api} --num-prompts 200 "
    "--save-result --result-filename {output}",
    ready_line="Application startup complete",
    positional_after="serve",
)
ENGINES = {e.kind: e for e in (SGLANG, VLLM)}


def model_path(command: Sequence[str]) -> str | None:
    """The model of a server command of either engine (the known outcomes' matching, which
    has no profile to choose by): vLLM's `serve MODEL` or `--model`, else SGLang's."""
    return VLLM.model_path(command) or SGLANG.model_path(command)


def tp(command: Sequence[str]) -> str | None:
    """The TP size of a server command of either engine."""
    return SGLANG.tp(command) or VLLM.tp(command)


def quantization(command: Sequence[str]) -> str | None:
    """`--quantization` of either engine (vLLM also spells it `-q`)."""
    return VLLM.value(command, "--quantization", "-q")


def of_kinds(kinds: Sequence[str]) -> Engine:
    """The engine of a profile whose patches target `kinds`."""
    return VLLM if "vllm" in kinds else SGLANG


def of_profile(profile: str, cat: Catalog) -> Engine:
    """The engine the profile's patches (of the command's catalog, `cat`) run in (an unknown
    profile is a usage error)."""
    return of_kinds(cat.profile(profile).targets)
