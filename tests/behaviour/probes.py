"""One probe cache for the whole behaviour tier, keyed by what each probe reads.

Every behaviour module asks the probe (`sm120patch/explain/probe.py`, or `vllm_probe.py`) for
requests it builds itself, and several build the same one: the pristine (release, simulated GPU)
run of `test_moe_runner_auto`, `test_gdn_prefill` and `test_pcie_ipc` is one request, since the
probe answers every reader in one process. The cache runs each distinct request once per
session, whichever module asks first.

The key is the content the probe reads, never the per-module temporary paths a request names:
- `sys_path`: each entry by the digest of its installed files (the dist-info RECORDs, which
  carry every file's sha256), or by path where the entry has none (the shared environment,
  fixed for the session);
- `overlay`: each module's overlay file by its bytes (the patch's planned text);
- `launches`: each argv with the `--model-path` directory replaced by its config.json's bytes;
- `env`: a path that does not exist (CUDA_HOME pointing nowhere) as `absent`, wherever it is;
- the simulated GPU, the CUDA version (12.9 where the request leaves the probe's default),
  every other field as it is, and the bytes of the probe and of the patches it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sm120patch.explain import explain

WORKERS_ENV = "SM120PATCH_BEHAVIOUR_WORKERS"
DEFAULT_CUDA = "12.9"  # probe.py's default for `cuda_version`
MODEL_FLAGS = ("--model-path", "--model")
Runner = Callable[[dict[str, Any]], dict[str, Any]]
_ROOT = Path(__file__).resolve().parents[2]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_TREES: dict[str, str] = {}


def tree_id(entry: str) -> str:
    """A sys.path entry by its installed files: the digest of its RECORDs (sorted by name),
    which list every file with its sha256; the path where it has none."""
    if entry not in _TREES:
        records = sorted(Path(entry).glob("*.dist-info/RECORD"))
        _TREES[entry] = ("record:" + _sha(b"".join(r.name.encode() + r.read_bytes()
                                                   for r in records))
                         if records else "path:" + entry)
    return _TREES[entry]


def _argv_key(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if arg in MODEL_FLAGS:
            config = Path(argv[i + 1]) / "config.json"
            out[i + 1] = "config:" + (_sha(config.read_bytes()) if config.is_file()
                                      else "absent")
    return out


def _env_key(env: dict[str, str]) -> dict[str, str]:
    return {k: ("absent" if os.path.isabs(v) and not os.path.exists(v) else v)
            for k, v in env.items()}


_CODE: dict[str, str] = {}


def code_id(probe: str) -> str:
    """The bytes the probe runs of this repository: the probe file, and the patches whose
    readers it imports."""
    if probe not in _CODE:
        files = [Path(probe), *sorted((_ROOT / "patches").rglob("*.py"))]
        _CODE[probe] = _sha(b"".join(str(f).encode() + f.read_bytes() for f in files
                                     if f.is_file()))
    return _CODE[probe]


def key(request: dict[str, Any], probe: str = str(explain.PROBE)) -> str:
    """The content key of one request to `probe` (the module docstring says what it covers)."""
    canon = dict(request)
    canon["sys_path"] = [tree_id(p) for p in request.get("sys_path", [])]
    canon["overlay"] = {m: _sha(Path(f).read_bytes())
                        for m, f in sorted(request.get("overlay", {}).items())}
    canon["launches"] = {n: _argv_key(a) for n, a in sorted(request.get("launches", {}).items())}
    canon["env"] = _env_key(request.get("env", {}))
    if request.get("simulate"):
        canon["cuda_version"] = request.get("cuda_version", DEFAULT_CUDA)
    canon["__code__"] = code_id(probe)
    return _sha(json.dumps(canon, sort_keys=True, default=str).encode())


def workers() -> int:
    return max(1, int(os.environ.get(WORKERS_ENV, 0)) or (os.cpu_count() or 1))


class ProbeCache:
    """Results by content key; `asked` counts requests, `ran` the probe processes started."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self.asked = 0
        self.ran = 0

    def run_all(self, requests: list[dict[str, Any]], runner: Runner,
                probe: str = str(explain.PROBE)) -> list[dict[str, Any]]:
        """Each request's result, in order; the distinct ones not yet run run in parallel
        processes. `runner` runs one request (the probe in its own interpreter)."""
        keys = [key(r, probe) for r in requests]
        todo = {k: r for k, r in zip(keys, requests, strict=True) if k not in self.results}
        self.asked += len(requests)
        self.ran += len(todo)
        with ThreadPoolExecutor(max_workers=workers()) as pool:
            self.results.update(zip(todo, pool.map(runner, todo.values()), strict=True))
        return [self.results[k] for k in keys]

    def run(self, request: dict[str, Any], runner: Runner,
            probe: str = str(explain.PROBE)) -> dict[str, Any]:
        return self.run_all([request], runner, probe)[0]


SHARED = ProbeCache()  # the session's: every module's fixtures use this one
