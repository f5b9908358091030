"""fp4-gemm and attention on upstream's own code under simulated SM120, SM100 and SM90.

Each release of the session inside a profile's pins is imported pristine and with that profile's
planned text (module overlays, as `explain --profile` does), in fresh probe processes:
- fp4-gemm: `--fp4-gemm-backend auto` resolves, on simulated SM120 with CUDA 13.0, to
  flashinfer_b12x where the FlashInfer that release pins offers b12x (pristine: flashinfer_cutlass
  from 0.5.13, flashinfer_cudnn in 0.5.10 to 0.5.12, FlashInfer's own auto before); with CUDA 12.9
  only where that FlashInfer names 12.9 as b12x's minimum; `--fp4-gemm-backend flashinfer_b12x`
  parses only when patched; no server argument of any launch changes; SM100 and SM90 decide as
  pristine.
- attention: SM120's default for an MHA model, and GPT-OSS's, becomes trtllm_mha (pristine:
  flashinfer, triton), with an fp8 KV cache, a quantized checkpoint's `auto` KV cache or a
  skip-softmax threshold it stays upstream's; only the attention backend and the page size it
  needs change; SM100 and SM90 decide as pristine.
FlashInfer's CUDA version comes from the simulated torch (CUDA_HOME points nowhere, so no nvcc of
this machine answers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envs
import forkserver
import probes
import pytest
from behave import ARCHS, SEED, release_set
from checks import field_problems
from packaging.version import Version

from sm120patch.explain import explain
from sm120patch.maintain import dists, releases
from sm120patch.plan import catalog
from sm120patch.targets import finding

pytestmark = pytest.mark.behaviour

FP4, ATTENTION = "fp4-gemm", "attention"
SKIP_SOFTMAX = "SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
NVFP4 = {"quant_method": "modelopt_fp4"}
MODELS = {
    "llama": LLAMA,
    "llama-nvfp4": {**LLAMA, "quantization_config": NVFP4},
    "gpt-oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "quantization_config": {"quant_method": "mxfp4"}},
}
LAUNCHES = {
    "mha": ("llama", ()),
    "mha-fp8-kv": ("llama", ("--kv-cache-dtype", "fp8_e4m3")),
    "mha-nvfp4": ("llama-nvfp4", ()),
    "mha-nvfp4-bf16-kv": ("llama-nvfp4", ("--kv-cache-dtype", "bfloat16")),
    "gpt-oss": ("gpt-oss", ()),
    "fp4-b12x": ("llama", ("--fp4-gemm-backend", "flashinfer_b12x")),
}
# The launch only the patched fp4-gemm parses; every other launch resolves on every side.
B12X_LAUNCH = "fp4-b12x"
# What choosing trtllm_mha changes beside the backend: its page size (16 to 128, 64 chosen).
ATTENTION_FIELDS = {"attention_backend", "page_size"}


def pinned(profile: str) -> list[str]:
    prof = catalog.load().profile(profile)
    return [v for v in release_set("sglang") if prof.pinned("sglang", v)]


@dataclass(frozen=True)
class Run:
    version: str
    side: str  # "pristine" or the profile whose planned text is overlaid
    arch: str
    cuda: str = "13.0"
    env: tuple[tuple[str, str], ...] = ()


def runs_for(version: str) -> list[Run]:
    out = [Run(version, "pristine", a) for a in ARCHS]
    if version in pinned(FP4):
        out += [Run(version, FP4, a) for a in ARCHS]
        if upstream_auto(version) != "auto":
            out.append(Run(version, FP4, "sm120", cuda="12.9"))
    if version in pinned(ATTENTION):
        out += [Run(version, ATTENTION, a) for a in ARCHS]
        out.append(Run(version, ATTENTION, "sm120", env=((SKIP_SOFTMAX, "0.5"),)))
    return out


class Runs:
    """Session cache of the probe results, computed in parallel processes."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.python = forkserver.python(envs.deps_python())
        self.results: dict[Run, dict[str, Any]] = {}
        self._overlays: dict[tuple[str, str], dict[str, str]] = {}
        self.launches: dict[str, list[str]] = {}
        for name, config in MODELS.items():
            directory = tmp / "models" / name
            directory.mkdir(parents=True)
            (directory / "config.json").write_text(json.dumps(config))
        for name, (model, flags) in LAUNCHES.items():
            self.launches[name] = ["--model-path", str(tmp / "models" / model), *SEED, *flags]

    def overlay(self, version: str, profile: str) -> dict[str, str]:
        key = (version, profile)
        if key not in self._overlays:
            target = finding.find("sglang", envs.release_prefix("sglang", version))
            texts = explain.patched_texts(target, profile)
            self._overlays[key] = explain.write_overlay(
                texts, self.tmp / "overlays" / f"{profile}-{version}"
            )
        return self._overlays[key]

    def request(self, run: Run) -> dict[str, Any]:
        return {
            "simulate": run.arch,
            "cuda_version": run.cuda,
            "sys_path": envs.sys_path_for("sglang", run.version),
            "overlay": {} if run.side == "pristine" else self.overlay(run.version, run.side),
            "launches": self.launches,
            "sglang": True,
            "flashinfer": False,
            "env": {"CUDA_HOME": str(self.tmp / "no-cuda"), **dict(run.env)},
        }

    def warm(self, runs: list[Run]) -> None:
        todo = [r for r in dict.fromkeys(runs) if r not in self.results]
        requests = [self.request(r) for r in todo]  # overlays and prefixes first, serially
        done = probes.SHARED.run_all(requests, lambda req: explain.run_probe(self.python, req))
        self.results.update(zip(todo, done, strict=True))

    def get(self, run: Run) -> dict[str, Any]:
        if run not in self.results:
            self.warm([run])
        return self.results[run]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Runs:
    # Only the items that use this fixture: other modules (the vLLM tier) name vLLM
    # releases under the same parameter name.
    wanted = sorted({item.callspec.params["version"] for item in request.session.items
                     if "runs" in getattr(item, "fixturenames", ())
                     and "version" in getattr(getattr(item, "callspec", None), "params", {})},
                    key=Version)
    if not releases.pypi_reachable():
        missing = [v for v in wanted if dists.cached("sglang", v) is None]
        if missing or not envs.root().is_dir():
            pytest.skip(f"PyPI is unreachable and the cache {releases.cache_dir()} lacks what "
                        "the behaviour tier needs")
    cache = Runs(tmp_path_factory.mktemp("new-profiles"))
    cache.warm([r for v in wanted for r in runs_for(v)])
    return cache


def backend(result: dict[str, Any]) -> str | None:
    res = result["fp4_gemm"]
    assert "backends" in res, res
    auto = res["backends"]["auto"]
    assert "value" in auto, auto
    return auto["value"]


def args_of(result: dict[str, Any], launch: str) -> dict[str, Any]:
    run = result["launches"][launch]
    assert "server_args" in run, (launch, run.get("error"), run.get("where"))
    return run["server_args"]


def pinned_flashinfer(version: str) -> Version:
    found = envs.pinned("sglang", version, releases.PROJECT["flashinfer"])
    assert found, f"SGLang {version} pins no FlashInfer"
    return Version(Version(found).base_version)


def upstream_auto(version: str) -> str:
    """What pristine `auto` resolves to on SM120, by release (fp4_utils.py as released)."""
    release = Version(version)
    if release < Version("0.5.10"):
        return "auto"  # handed to FlashInfer's own auto
    if release < Version("0.5.13"):
        return "flashinfer_cudnn"
    return "flashinfer_cutlass"


# ---- fp4-gemm ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", pinned(FP4))
def test_fp4_gemm_auto_on_sm120(runs: Runs, version: str) -> None:
    pristine = runs.get(Run(version, "pristine", "sm120"))
    patched = runs.get(Run(version, FP4, "sm120"))
    assert backend(pristine) == upstream_auto(version)
    flashinfer = pinned_flashinfer(version)
    offers = flashinfer >= Version("0.6.9")  # mm_fp4's b12x backend
    want = "flashinfer_b12x" if offers and upstream_auto(version) != "auto" else (
        upstream_auto(version))
    assert backend(patched) == want, (version, str(flashinfer))
    # CUDA 12.9: b12x only where FlashInfer names 12.9 its minimum (0.7.0 on)
    if upstream_auto(version) != "auto":
        older = runs.get(Run(version, FP4, "sm120", cuda="12.9"))
        want = "flashinfer_b12x" if flashinfer >= Version("0.7.0") else upstream_auto(version)
        assert backend(older) == want, (version, str(flashinfer))


@pytest.mark.parametrize("version", pinned(FP4))
def test_fp4_gemm_cli_choice_and_no_other_argument(runs: Runs, version: str) -> None:
    for arch in ARCHS:
        pristine = runs.get(Run(version, "pristine", arch))
        patched = runs.get(Run(version, FP4, arch))
        assert "error" in pristine["launches"][B12X_LAUNCH], "the pristine CLI took flashinfer_b12x"
        assert args_of(patched, B12X_LAUNCH)["fp4_gemm_runner_backend"] == "flashinfer_b12x"
        others = {**pristine, "launches": {k: v for k, v in pristine["launches"].items()
                                           if k != B12X_LAUNCH}}
        assert field_problems(others, patched | {"launches": {
            k: v for k, v in patched["launches"].items() if k != B12X_LAUNCH}}, set()) == []


@pytest.mark.parametrize("version", pinned(FP4))
@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_fp4_gemm_off_sm120_unchanged(runs: Runs, version: str, arch: str) -> None:
    pristine = runs.get(Run(version, "pristine", arch))
    patched = runs.get(Run(version, FP4, arch))
    assert backend(patched) == backend(pristine)
    assert patched["predicates"] == pristine["predicates"]


# ---- attention -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", pinned(ATTENTION))
def test_attention_default_on_sm120(runs: Runs, version: str) -> None:
    pristine = runs.get(Run(version, "pristine", "sm120"))
    patched = runs.get(Run(version, ATTENTION, "sm120"))
    before = {n: args_of(pristine, n)["attention_backend"] for n in LAUNCHES if n != B12X_LAUNCH}
    after = {n: args_of(patched, n)["attention_backend"] for n in LAUNCHES if n != B12X_LAUNCH}
    assert (before["mha"], before["gpt-oss"]) == ("flashinfer", "triton")  # the control
    assert after == {
        "mha": "trtllm_mha",
        "gpt-oss": "trtllm_mha",
        "mha-nvfp4-bf16-kv": "trtllm_mha",
        "mha-fp8-kv": before["mha-fp8-kv"],  # the hook refuses fp8_e4m3 prefill on SM120
        "mha-nvfp4": before["mha-nvfp4"],  # a quantized checkpoint's KV cache may be FP8
    }
    for name in ("mha", "gpt-oss", "mha-nvfp4-bf16-kv"):
        assert args_of(patched, name)["page_size"] in (16, 32, 64, 128)
    assert field_problems(
        {**pristine, "launches": {k: v for k, v in pristine["launches"].items()
                                  if k != B12X_LAUNCH}},
        {**patched, "launches": {k: v for k, v in patched["launches"].items()
                                 if k != B12X_LAUNCH}},
        ATTENTION_FIELDS,
    ) == []
    skip = runs.get(Run(version, ATTENTION, "sm120", env=((SKIP_SOFTMAX, "0.5"),)))
    assert args_of(skip, "mha")["attention_backend"] == before["mha"]  # the hook refuses it


@pytest.mark.parametrize("version", pinned(ATTENTION))
@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_attention_off_sm120_unchanged(runs: Runs, version: str, arch: str) -> None:
    pristine = runs.get(Run(version, "pristine", arch))
    patched = runs.get(Run(version, ATTENTION, arch))
    assert field_problems(pristine, patched, set()) == []
