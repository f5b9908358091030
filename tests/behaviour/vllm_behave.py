"""The behaviour tier for vLLM: its own selection code, pristine and patched, under simulated GPUs.

A case is one vLLM release (every pinned one, `releases.DEFAULT_RELEASES["vllm"]`), one side
and one simulated GPU; each runs `vllm_probe.py` in a fresh process of the shared dependency
environment with vLLM's source tree from the cache and `envs.VLLM_DEPS` first on sys.path.
The patched side is this repository's planner output for every vLLM profile (each profile's
files, from `explain.patched_texts`, on the release's pristine tree), served as overlays.

What every case asks (`REQUEST`):
- `moe`: `select_nvfp4_moe_backend` for a W4A16 NVFP4 MoE layer (weight key kNvfp4Static, no
  activation key): `w4a16` without expert parallelism, `w4a16-ep` with EP over 4 GPUs, as the
  probe's environment has it (no `b12x` package); the same with the `b12x` package stood in
  (`-b12x`), and with it and an explicit `--moe-backend marlin` (`w4a16-b12x-explicit`);
- `linear`: `init_nvfp4_linear_kernel` for a W4A4 NVFP4 linear layer, without the `b12x`
  package (`w4a4`), with it stood in (`w4a4-b12x`), with it and an explicit
  `--linear-backend marlin` (`w4a4-b12x-explicit`), and for a W4A16 layer with it
  (`w4a16-b12x`);
- `fusion`: `enable_allreduce_rms_fusion` (vLLM's default for the all-reduce + RMSNorm pass)
  at TP 2;
- `allreduce`: CustomAllreduce's set-up on one node of 2 and of 4 GPUs, and of 4 GPUs with
  SM120PATCH_PCIE_ALLREDUCE=0 (the patch's run-time off switch).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envs
import forkserver
import probes

from sm120patch.explain import explain
from sm120patch.maintain import releases, sources
from sm120patch.targets import finding

PROBE = Path(__file__).with_name("vllm_probe.py")
RELEASES = releases.DEFAULT_RELEASES["vllm"]
ARCHS = explain.ARCHS
SIDES = ("pristine", "patched")
WORKERS_ENV = "SM120PATCH_BEHAVIOUR_WORKERS"
TIMEOUT_S = 300.0
REQUEST: dict[str, Any] = {
    "moe": {"w4a16": {"tp": 1}, "w4a16-ep": {"tp": 4, "ep": True},
            "w4a16-b12x": {"tp": 1, "b12x": True},
            "w4a16-ep-b12x": {"tp": 4, "ep": True, "b12x": True},
            "w4a16-b12x-explicit": {"tp": 1, "b12x": True, "moe_backend": "marlin"}},
    "linear": {"w4a4": {}, "w4a4-b12x": {"b12x": True},
               "w4a4-b12x-explicit": {"b12x": True, "linear_backend": "marlin"},
               "w4a16-b12x": {"b12x": True, "a16": True}},
    "fusion": {"tp2": {"tp": 2}},
    "fusion_tables": {"tp2": {"tp": 2}, "tp4": {"tp": 4}},
    "allreduce": {
        "world2": {"world": 2},
        "world4": {"world": 4},
        "world4-off": {"world": 4, "env": {"SM120PATCH_PCIE_ALLREDUCE": "0"}},
    },
}


@dataclass(frozen=True)
class Case:
    version: str
    side: str
    arch: str

    def __str__(self) -> str:
        return f"vllm-{self.version}-{self.side}-{self.arch}"


def vllm_profiles() -> list[str]:
    """The catalog's profiles whose patches all patch vLLM and that write: a `refused`
    profile (vllm-fp8-moe) never writes, its patch refuses at the gate (the real tier holds
    that on every pinned release), so it has no patched side to import."""
    from sm120patch.plan import catalog

    cat = catalog.load()
    return [name for name, prof in cat.profiles.items()
            if prof.patches and prof.status != "refused"
            and all(cat.patches[p].target == "vllm" for p in prof.patches)]


def patched_texts(version: str) -> dict[str, str]:
    """file -> text of every vLLM profile's plan on the pristine release; two profiles that
    write one file would make the combined side ambiguous, so that is an error here."""
    target = finding.find("vllm", sources.tree("vllm", version))
    texts: dict[str, str] = {}
    for profile in vllm_profiles():
        for file, text in explain.patched_texts(target, profile).items():
            if file in texts:
                raise AssertionError(f"two vLLM profiles write {file}; plan them together")
            texts[file] = text
    return texts


def extensions(version: str) -> list[str]:
    """The compiled modules the release's wheel ships (its RECORD's `.so` members): the probe
    serves placeholders for them."""
    tree = sources.tree("vllm", version)
    record = next(tree.glob("vllm-*.dist-info/RECORD")).read_text(encoding="utf-8")
    names = set()
    for line in record.splitlines():
        path = line.split(",", 1)[0]
        if path.endswith(".so"):
            names.add(path.split(".", 1)[0].replace("/", "."))
    return sorted(names)


def run_probe(request: dict[str, Any], *, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """The probe in the dependency environment; its result. Bytecode goes to a cache of its own
    (PYTHONPYCACHEPREFIX), never into the release trees, which hold exactly their files."""
    python = forkserver.python(envs.deps_python())
    with tempfile.TemporaryDirectory(prefix="sm120patch-vllm-probe-") as tmp:
        req, res = Path(tmp, "request.json"), Path(tmp, "result.json")
        req.write_text(json.dumps(request), encoding="utf-8")
        env = {**os.environ, "PYTHONWARNINGS": "ignore",
               "PYTHONPYCACHEPREFIX": str(envs.root() / "pycache-vllm")}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        proc = subprocess.run([str(python), str(PROBE), str(req), str(res)],
                              capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
        try:
            result: dict[str, Any] = json.loads(res.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
            raise AssertionError(f"the vLLM probe stopped (exit {proc.returncode}):\n{tail}"
                                 ) from None
    if "fatal" in result:
        raise AssertionError(f"the vLLM probe could not import vLLM: {result}")
    return result


class VllmBehaviour:
    """Session cache: patched overlays, and every case's probe result."""

    def __init__(self, overlays: Path) -> None:
        self.overlays = overlays
        self.results: dict[Case, dict[str, Any]] = {}
        self._overlays: dict[str, dict[str, str]] = {}

    def overlay(self, version: str) -> dict[str, str]:
        if version not in self._overlays:
            self._overlays[version] = explain.write_overlay(
                patched_texts(version), self.overlays / version)
        return self._overlays[version]

    def request(self, case: Case) -> dict[str, Any]:
        return {
            **REQUEST,
            "probe": str(explain.PROBE),
            "simulate": case.arch,
            "devices": 8,
            "sys_path": envs.vllm_sys_path(case.version),
            "extensions": extensions(case.version),
            "flashinfer": True,
            "overlay": self.overlay(case.version) if case.side == "patched" else {},
        }

    def run(self, case: Case, overlay: dict[str, str] | None = None) -> dict[str, Any]:
        """One case in a fresh process; `overlay` replaces the side's own (negative tests)."""
        request = self.request(case)
        if overlay is not None:
            request["overlay"] = overlay
        return run_probe(request)

    def warm(self, cases: list[Case]) -> None:
        todo = [c for c in cases if c not in self.results]
        requests = [self.request(c) for c in todo]  # trees, prefix, overlays: serially
        done = probes.SHARED.run_all(requests, run_probe, str(PROBE))
        self.results.update(zip(todo, done, strict=True))

    def result(self, case: Case) -> dict[str, Any]:
        if case not in self.results:
            self.warm([case])
        return self.results[case]


def all_cases(versions: tuple[str, ...] = RELEASES) -> list[Case]:
    return [Case(v, side, arch) for v in versions for side in SIDES for arch in ARCHS]
