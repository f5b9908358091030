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

import envs
import probes
import pytest
from behave import ARCHS, release_set

from sm120patch import targets
from sm120patch.explain import explain
from sm120patch.plan import catalog

pytestmark = pytest.mark.behaviour

PROFILE = "pcie-ipc"
VAR = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
SET = [f"pcie/{VAR}=1", f"nvlink/{VAR}=1"]  # upstream builds it wherever the variable says so


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
            return explain.run_probe(self.python, request)["pcie_ipc"]
        result = probes.SHARED.run(request, lambda r: explain.run_probe(self.python, r))
        self.results[key] = result["pcie_ipc"]
        return self.results[key]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Probe:
    return Probe(tmp_path_factory.mktemp("pcie-ipc"))


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
def test_sm120_on_by_default_without_nvlink_explicit_kept(probe: Probe, version: str) -> None:
    pristine = probe.run(version, "pristine", "sm120")
    patched = probe.run(version, "patched", "sm120")
    assert sm120_problems(pristine, patched) == []


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm120"])
@pytest.mark.parametrize("version", pinned())
def test_sm100_and_sm90_decide_as_released(probe: Probe, version: str, arch: str) -> None:
    pristine = probe.run(version, "pristine", arch)
    patched = probe.run(version, "patched", arch)
    assert on(pristine) == sorted(SET), pristine
    assert patched["decisions"] == pristine["decisions"]


def test_the_check_fails_a_no_op_and_a_wrong_patch(probe: Probe, tmp_path: Path) -> None:
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
