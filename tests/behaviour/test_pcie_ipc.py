"""pcie-ipc on upstream's own code under simulated SM120, SM100 and SM90.

Each release of the session inside the profile's pins runs the patch's explain reader (upstream's
`eligible_group` for a TP4 group, NVML's NVLink answer held to none or full, the variable unset,
"0" or "1") pristine and with the profile's planned text overlaid, in fresh probe processes:
- pristine SM120 builds the PCIe-IPC allreduce only where the variable says 1 (the control);
- patched SM120 also builds it with the variable unset on PCIe (no NVLink), and nowhere else: an
  explicit "0" stays off, full NVLink stays as upstream;
- SM100 and SM90 decide as pristine everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import overlay_probe
import pytest
from behave import ARCHS
from overlay_probe import OverlayProbe

pytestmark = pytest.mark.behaviour

PROFILE = "pcie-ipc"
VAR = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
SET = [f"pcie/{VAR}=1", f"nvlink/{VAR}=1"]  # upstream builds it wherever the variable says so


def pinned() -> list[str]:
    return overlay_probe.pinned(PROFILE)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> OverlayProbe:
    probe = OverlayProbe(PROFILE, "pcie_ipc", tmp_path_factory.mktemp("pcie-ipc"))
    probe.prefetch(pinned())
    return probe


def on(result: dict[str, Any]) -> list[str]:
    assert "error" not in result, result
    assert not any(str(v).startswith("error") for v in result["decisions"].values()), result
    return sorted(k for k, v in result["decisions"].items() if v is True)


def sm120_problems(pristine: dict[str, Any], patched: dict[str, Any]) -> list[str]:
    problems = []
    if on(pristine) != sorted(SET):
        problems.append(f"pristine SM120 builds it for {on(pristine)}, expected {sorted(SET)}")
    want = sorted([*SET, f"pcie/{VAR}=unset"])
    if on(patched) != want:
        problems.append(f"patched SM120 builds it for {on(patched)}, expected {want}")
    return problems


@pytest.mark.parametrize("version", pinned())
def test_sm120_on_by_default_without_nvlink_explicit_kept(probe: OverlayProbe, version: str) -> None:
    pristine = probe.run(version, "pristine", "sm120")
    patched = probe.run(version, "patched", "sm120")
    assert sm120_problems(pristine, patched) == []


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm120"])
@pytest.mark.parametrize("version", pinned())
def test_sm100_and_sm90_decide_as_released(probe: OverlayProbe, version: str, arch: str) -> None:
    pristine = probe.run(version, "pristine", arch)
    patched = probe.run(version, "patched", arch)
    assert on(pristine) == sorted(SET), pristine
    assert patched["decisions"] == pristine["decisions"]


def test_the_check_fails_a_no_op_and_a_wrong_patch(probe: OverlayProbe, tmp_path: Path) -> None:
    version = pinned()[-1]
    pristine = probe.run(version, "pristine", "sm120")
    assert sm120_problems(pristine, pristine) != []  # no patch at all
    module = "sglang.srt.distributed.device_communicators.pcie_ipc_ar"
    overlay = dict(probe.overlay(version))
    text = Path(overlay[module]).read_text(encoding="utf-8")
    ours = "        not envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.is_set()\n"
    assert ours in text
    wrong = tmp_path / "pcie_ipc_ar.py"  # one that overrides an explicit 0
    wrong.write_text(text.replace(ours, "        True\n"), encoding="utf-8")
    result = probe.run(version, "patched", "sm120", overlay={**overlay, module: str(wrong)})
    assert sm120_problems(pristine, result) != []
