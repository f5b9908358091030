"""gdn-prefill on upstream's own code under simulated SM120, SM100 and SM90.

Each release of the session inside the profile's pins runs the patch's explain reader (upstream's
`flashinfer_gdn_prefill_default` with a GDN model, no explicit backend and static chunking held)
pristine and with the profile's planned text overlaid, in fresh probe processes without launches
(cheap). The reader varies the state dtype, chunk size, CUDA version and FlashInfer's SM120
kernel (loaded, None where its import failed, absent before FlashInfer 0.6.14):
- pristine SM120 picks FlashInfer nowhere (the control);
- patched SM120 picks it exactly in fp32 state, chunk <= 8192, CUDA 13, kernel loaded;
- SM100 and SM90 decide as pristine in every domain, and pristine SM100 does pick FlashInfer in
  its own domain (so a reader that never reaches the FlashInfer return cannot pass).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import envs
import probes
import pytest
from behave import ARCHS, release_set

from sm120patch import targets
from sm120patch.explain import explain
from sm120patch.plan import catalog

pytestmark = pytest.mark.behaviour

PROFILE = "gdn-prefill"
OURS = "fp32/chunk 8192/cuda 13.0/kernel loaded"


def pinned() -> list[str]:
    prof = catalog.load().profile(PROFILE)
    return [v for v in release_set("sglang") if prof.pinned("sglang", v)]


class Probe:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.python = envs.deps_python()
        self.results: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.overlays: dict[str, dict[str, str]] = {}

    def overlay(self, version: str) -> dict[str, str]:
        if version not in self.overlays:
            target = targets.find("sglang", envs.release_prefix("sglang", version))
            texts = explain.patched_texts(target, PROFILE)
            self.overlays[version] = explain.write_overlay(texts, self.tmp / version)
        return self.overlays[version]

    def request(self, version: str, side: str, arch: str,
                overlay: dict[str, str] | None = None) -> dict[str, Any]:
        return {
            "simulate": arch,
            "sys_path": envs.sys_path_for("sglang", version),
            "overlay": overlay if overlay is not None else (
                self.overlay(version) if side == "patched" else {}),
            "launches": {},
            "sglang": True,
            "flashinfer": False,
            "env": {"CUDA_HOME": str(self.tmp / "no-cuda")},
        }

    def run(self, version: str, side: str, arch: str,
            overlay: dict[str, str] | None = None) -> dict[str, Any]:
        key = (version, side, arch)
        if overlay is None and key in self.results:
            return self.results[key]
        request = self.request(version, side, arch, overlay)
        if overlay is not None:  # a negative test's own overlay: run it, keep nothing
            return explain.run_probe(self.python, request)["gdn_prefill"]
        result = probes.SHARED.run(request, lambda r: explain.run_probe(self.python, r))
        self.results[key] = result["gdn_prefill"]
        return self.results[key]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Probe:
    return Probe(tmp_path_factory.mktemp("gdn"))


def picks(result: dict[str, Any]) -> list[str]:
    assert "error" not in result, result
    assert not any(str(v).startswith("error") for v in result["decisions"].values()), result
    return sorted(k for k, v in result["decisions"].items() if v == "flashinfer")


def sm120_problems(pristine: dict[str, Any], patched: dict[str, Any]) -> list[str]:
    problems = []
    if picks(pristine):
        problems.append(f"pristine SM120 picks FlashInfer: {picks(pristine)}")
    if picks(patched) != [OURS]:
        problems.append(f"patched SM120 picks FlashInfer for {picks(patched)}, expected {[OURS]}")
    if picks(patched) and "Defaulting SM120 GDN prefill backend to FlashInfer." not in (
            patched["log"]):
        problems.append(f"patched SM120 log: {patched['log']}")
    return problems


@pytest.mark.parametrize("version", pinned())
def test_sm120_takes_flashinfer_in_the_validated_domain(probe: Probe, version: str) -> None:
    pristine = probe.run(version, "pristine", "sm120")
    patched = probe.run(version, "patched", "sm120")
    assert sm120_problems(pristine, patched) == []


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm120"])
@pytest.mark.parametrize("version", pinned())
def test_sm100_and_sm90_decide_as_released(probe: Probe, version: str, arch: str) -> None:
    pristine = probe.run(version, "pristine", arch)
    patched = probe.run(version, "patched", arch)
    assert "error" not in pristine, pristine
    assert patched["decisions"] == pristine["decisions"]
    if arch == "sm100":  # upstream's own SM100 row: bf16, chunk <= 8192, CUDA 13
        assert any(k.startswith("bf16/chunk 8192/cuda 13.0") for k in picks(pristine)), pristine


def test_the_check_fails_a_no_op_and_a_wrong_patch(probe: Probe, tmp_path: Path) -> None:
    version = pinned()[-1]
    pristine = probe.run(version, "pristine", "sm120")
    assert sm120_problems(pristine, pristine) != []  # no patch at all
    module = "sglang.srt.layers.attention.linear.gdn_backend"
    overlay = dict(probe.overlay(version))
    text = Path(overlay[module]).read_text(encoding="utf-8")
    ours = "        max_chunk = 8192\n        expected_state_dtype = torch.float32\n    else:"
    assert ours in text
    wrong = tmp_path / "gdn_backend.py"
    wrong.write_text(text.replace(ours, ours.replace("torch.float32", "torch.bfloat16")),
                     encoding="utf-8")
    result = probe.run(version, "patched", "sm120", overlay={**overlay, module: str(wrong)})
    assert sm120_problems(pristine, result) != []
