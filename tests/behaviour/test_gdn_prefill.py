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

import overlay_probe
import pytest
from behave import ARCHS
from overlay_probe import OverlayProbe

pytestmark = pytest.mark.behaviour

PROFILE = "gdn-prefill"
OURS = "fp32/chunk 8192/cuda 13.0/kernel loaded"


def pinned() -> list[str]:
    return overlay_probe.pinned(PROFILE)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> OverlayProbe:
    probe = OverlayProbe(PROFILE, "gdn_prefill", tmp_path_factory.mktemp("gdn"))
    probe.prefetch(pinned())
    return probe


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
def test_sm120_takes_flashinfer_in_the_validated_domain(probe: OverlayProbe, version: str) -> None:
    pristine = probe.run(version, "pristine", "sm120")
    patched = probe.run(version, "patched", "sm120")
    assert sm120_problems(pristine, patched) == []


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm120"])
@pytest.mark.parametrize("version", pinned())
def test_sm100_and_sm90_decide_as_released(probe: OverlayProbe, version: str, arch: str) -> None:
    pristine = probe.run(version, "pristine", arch)
    patched = probe.run(version, "patched", arch)
    assert "error" not in pristine, pristine
    assert patched["decisions"] == pristine["decisions"]
    if arch == "sm100":  # upstream's own SM100 row: bf16, chunk <= 8192, CUDA 13
        assert any(k.startswith("bf16/chunk 8192/cuda 13.0") for k in picks(pristine)), pristine


def test_the_check_fails_a_no_op_and_a_wrong_patch(probe: OverlayProbe, tmp_path: Path) -> None:
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
