"""The behaviour tier: each release's own code, pristine and patched, under simulated GPUs.

A case is one release, one side (pristine or patched) and one simulated GPU; each runs the
shipped probe (`sm120patch/probe.py`, the one `sm120patch explain` runs) in a fresh process of
the shared dependency environment (`envs.py`). The patched side is this repository's planner
output for profile `all` on that release, served to the probe as module overlays.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envs
import forkserver
import probes
from checks import GLM, MOE_MODELS, moe_launch

from sm120patch import targets
from sm120patch.explain import explain
from sm120patch.maintain import releases
from sm120patch.targets import finding

FULL_ENV = "SM120PATCH_FULL_BEHAVIOUR"
WORKERS_ENV = "SM120PATCH_BEHAVIOUR_WORKERS"
DEFAULT = {
    "sglang": ("0.5.8", "0.5.13", "0.5.14", "0.5.19", "0.5.23"),
    "flashinfer": ("0.6.1", "0.6.15"),
}
# The releases the patches are pinned on (profiles.toml): the full run takes each, and the
# latest .postN of each.
FULL_SPEC = {"sglang": ">=0.5.8,<0.5.24", "flashinfer": ">=0.5.0,<0.7.5"}
ARCHS = explain.ARCHS
SIDES = ("pristine", "patched")
# Fusion on only with more than one GPU (0.5.14 on): every fusion launch is --tp 2.
FUSION_TP = "2"
# SM120 auto-enables fusion at TP2 only: one fusion model also launches at TP4, plain and with
# the user's explicit flag (which the patch leaves to the user). Named `fusion4-...` so that
# the TP2 checks (`fusion-` launches) do not take them.
TP4_MODEL = "Qwen3MoeForCausalLM"
TP4_LAUNCHES = {"fusion4-plain": (), "fusion4-flag": ("--enable-flashinfer-allreduce-fusion",)}
# Fixed, so that two resolutions of one launch compare equal field by field.
SEED = ("--random-seed", "0")
# architecture -> transformers model_type, for the config.json of each listed architecture;
# transformers fills the rest of the config with its defaults.
MODEL_TYPES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
}
# The MoE launches of each model of MOE_MODELS: (name after the model's prefix,
# quantization_config in config.json, extra flags).
NVFP4 = {"quant_method": "modelopt_fp4"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}
MOE_LAUNCHES = (
    ("nvfp4-config", NVFP4, ()),
    ("nvfp4-flag", NVFP4, ("--quantization", "modelopt_fp4")),
    ("bf16", None, ()),
    ("fp8", FP8, ()),
)


def moe_patch_of(model: str) -> str:
    """The moe profile's patch for one of MOE_MODELS (the one whose marker is the model)."""
    from sm120patch.plan import catalog

    cat = catalog.load()
    return next(p for p in cat.profile("moe").patches if cat.patches[p].marker == model)


def moe_models(version: str) -> tuple[str, ...]:
    """The MoE models whose patch applies on `version` (its facts say so)."""
    from sm120patch.patchkit.model import Status
    from sm120patch.plan import catalog

    patches = catalog.load().patches
    return tuple(m for m in MOE_MODELS if any(
        f.status is Status.APPLIED for f in patches[moe_patch_of(m)].facts_at(version)))


def full_run() -> bool:
    return os.environ.get(FULL_ENV, "") not in ("", "0")


def release_set(kind: str) -> tuple[str, ...]:
    if not full_run():
        return DEFAULT[kind]
    finals = releases.available(kind, FULL_SPEC[kind])
    posts = releases.available(kind, FULL_SPEC[kind], posts=True)
    latest: dict[str, str] = {}
    from packaging.version import Version

    for v in posts:  # oldest first: the last post of each release wins
        latest[Version(v).base_version] = v
    return tuple(dict.fromkeys([*finals, *(p for p in latest.values() if p not in finals)]))


@dataclass(frozen=True)
class Case:
    kind: str
    version: str
    side: str
    arch: str

    def __str__(self) -> str:
        return f"{self.kind}-{self.version}-{self.side}-{self.arch}"


def write_model(directory: Path, arch: str, quantization: dict | None = None) -> Path:
    """A model directory with only a config.json, as a checkpoint of `arch` has it."""
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"architectures": [arch], "model_type": MODEL_TYPES[arch]}
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def fusion_archs(prefix: Path) -> list[str]:
    """The architectures the release's own fusion auto-enable lists, from its source."""
    for rel in ("sglang/srt/arg_groups/overrides.py", "sglang/srt/server_args.py"):
        path = prefix / rel
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") == "_FLASHINFER_ALLREDUCE_FUSION_ARCHS"
                        for t in node.targets)
            ):
                return sorted(_strings(node.value))
            if isinstance(node, ast.If) and _sets_fusion(node):
                found = [
                    s for sub in ast.walk(node.test)
                    if isinstance(sub, (ast.List, ast.Set, ast.Tuple))
                    for s in _strings(sub) if s.endswith(("ForCausalLM", "Generation"))
                ]
                if found:
                    return sorted(set(found))
    return []


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def _sets_fusion(node: ast.If) -> bool:
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute):
            attr = stmt.targets[0].attr
            if attr == "enable_flashinfer_allreduce_fusion" or (
                attr == "flashinfer_allreduce_fusion_backend"
            ):
                return True
    return False


class Behaviour:
    """Session cache: release prefixes, patched overlays, and every case's probe result."""

    def __init__(self, models: Path, overlays: Path) -> None:
        self.models = models
        self.overlays = overlays
        self.results: dict[Case, dict[str, Any]] = {}
        self.python = forkserver.python(envs.deps_python())
        self._overlays: dict[tuple[str, str], dict[str, str]] = {}

    def target(self, kind: str, version: str) -> targets.Target:
        return finding.find(kind, envs.release_prefix(kind, version))

    def overlay(self, kind: str, version: str) -> dict[str, str]:
        texts = explain.patched_texts(self.target(kind, version))
        return explain.write_overlay(texts, self.overlays / f"{kind}-{version}")

    def launches(self, version: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        # GLM-4 MoE's launches everywhere (0.5.8 on); another MoE model's where its patch
        # applies (before that, the release's transformers may not read its config).
        for arch in (GLM, *(m for m in moe_models(version) if m != GLM)):
            for kind, quant, flags in MOE_LAUNCHES:
                name = moe_launch(arch, kind)
                model = write_model(self.models / name, arch, quant)
                out[name] = ["--model-path", str(model), "--tp", "4", *SEED, *flags]
        for arch in self.fusion_archs(version):
            if arch in MODEL_TYPES:
                model = write_model(self.models / f"fusion-{arch}", arch)
                out[f"fusion-{arch}"] = ["--model-path", str(model), "--tp", FUSION_TP, *SEED]
        if TP4_MODEL in self.fusion_archs(version):
            model = write_model(self.models / f"fusion-{TP4_MODEL}", TP4_MODEL)
            for name, flags in TP4_LAUNCHES.items():
                out[name] = ["--model-path", str(model), "--tp", "4", *SEED, *flags]
        return out

    def fusion_archs(self, version: str) -> list[str]:
        return fusion_archs(envs.release_prefix("sglang", version))

    def request(self, case: Case) -> dict[str, Any]:
        key = (case.kind, case.version)
        if case.side == "patched" and key not in self._overlays:
            self._overlays[key] = self.overlay(*key)
        sglang = case.kind == "sglang"
        return {
            "simulate": case.arch,
            "sys_path": envs.sys_path_for(case.kind, case.version),
            "overlay": self._overlays[key] if case.side == "patched" else {},
            "launches": self.launches(case.version) if sglang else {},
            "sglang": sglang,
            "flashinfer": not sglang,
        }

    def run(self, case: Case, overlay: dict[str, str] | None = None) -> dict[str, Any]:
        """One case in a fresh process; `overlay` replaces the side's own (negative tests)."""
        request = self.request(case)
        if overlay is not None:
            request["overlay"] = overlay
        return explain.run_probe(self.python, request)

    def warm(self, cases: list[Case]) -> None:
        """Run every case not yet run, in parallel processes (each its own interpreter)."""
        todo = [c for c in cases if c not in self.results]
        # prefixes and overlays here, serially; the tier's shared cache runs what is new
        requests = [self.request(case) for case in todo]
        done = probes.SHARED.run_all(requests, lambda r: explain.run_probe(self.python, r))
        self.results.update(zip(todo, done, strict=True))

    def result(self, case: Case) -> dict[str, Any]:
        if case not in self.results:
            self.warm([case])
        return self.results[case]
