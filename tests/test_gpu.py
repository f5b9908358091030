"""NVML mocked with pytest-mock: SM120, SM90 only, mixed, no driver, NVML errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from click.testing import CliRunner
from trees import make_tree, tree_hash

from sm120patch.cli import main
from sm120patch.errors import Refused
from sm120patch.trial import gpu

FIXTURE = Path(__file__).parent / "fixtures" / "nvml_h200.json"


class Memory:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used = total, used


def fake_nvml(mocker, devices: list[dict], driver: str = "580.65.06", cuda: int = 13000):
    mocker.patch.object(pynvml, "nvmlInit")
    mocker.patch.object(pynvml, "nvmlShutdown")
    mocker.patch.object(pynvml, "nvmlSystemGetDriverVersion", return_value=driver)
    mocker.patch.object(pynvml, "nvmlSystemGetCudaDriverVersion", return_value=cuda)
    mocker.patch.object(pynvml, "nvmlDeviceGetCount", return_value=len(devices))
    mocker.patch.object(pynvml, "nvmlDeviceGetHandleByIndex", side_effect=lambda i: i)
    mocker.patch.object(pynvml, "nvmlDeviceGetName", side_effect=lambda h: devices[h]["name"])
    mocker.patch.object(
        pynvml, "nvmlDeviceGetCudaComputeCapability", side_effect=lambda h: tuple(devices[h]["cc"])
    )
    mocker.patch.object(
        pynvml, "nvmlDeviceGetPowerUsage", side_effect=lambda h: devices[h]["power_mw"]
    )
    mocker.patch.object(
        pynvml, "nvmlDeviceGetEnforcedPowerLimit", side_effect=lambda h: devices[h]["limit_mw"]
    )
    mocker.patch.object(
        pynvml,
        "nvmlDeviceGetMemoryInfo",
        side_effect=lambda h: Memory(devices[h]["mem_total"], devices[h]["mem_used"]),
    )


RTX = {
    "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "cc": [12, 0],
    "power_mw": 240000,
    "limit_mw": 600000,
    "mem_total": 96 * 2**30,
    "mem_used": 2**30,
}
H200 = {
    "name": "NVIDIA H200",
    "cc": [9, 0],
    "power_mw": 75000,
    "limit_mw": 700000,
    "mem_total": 141 * 2**30,
    "mem_used": 0,
}


def test_sm120_found(mocker):
    fake_nvml(mocker, [RTX, RTX])
    found = gpu.read_gpus()
    assert found.has_sm120
    assert found.cuda_driver == "13.0"
    assert found.gpus[0].power_w == 240.0 and found.gpus[0].power_limit_w == 600.0
    assert gpu.require_sm120(found) is found


def test_sm90_only_refuses_naming_the_gpu(mocker):
    fake_nvml(mocker, [H200])
    with pytest.raises(Refused) as exc:
        gpu.require_sm120()
    assert "GPU 0: NVIDIA H200 is sm_90" in exc.value.message
    assert "--no-gpu-check" in exc.value.hint


def test_mixed_machine_passes(mocker):
    fake_nvml(mocker, [H200, RTX])
    assert gpu.read_gpus().has_sm120


def test_no_driver(mocker):
    mocker.patch.object(pynvml, "nvmlInit", side_effect=pynvml.NVMLError_LibraryNotFound())
    found = gpu.read_gpus()
    assert found.problem and "no NVIDIA driver found" in found.problem
    with pytest.raises(Refused) as exc:
        gpu.require_sm120(found)
    assert "no NVIDIA driver found" in exc.value.message


def test_nvml_error_while_reading(mocker):
    fake_nvml(mocker, [RTX])
    mocker.patch.object(
        pynvml, "nvmlDeviceGetCount", side_effect=pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    )
    found = gpu.read_gpus()
    assert found.problem and found.problem.startswith("NVML error")
    assert not found.has_sm120


def test_power_not_supported_is_none(mocker):
    fake_nvml(mocker, [RTX])
    mocker.patch.object(
        pynvml,
        "nvmlDeviceGetPowerUsage",
        side_effect=pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED),
    )
    assert gpu.read_gpus().gpus[0].power_w is None


def test_real_h200_reading_is_refused(mocker):
    """Values read on a real H200 machine (see the fixture) go through the same refusal."""
    doc = json.loads(FIXTURE.read_text())
    devices = [
        {
            "name": g["name"],
            "cc": [g["major"], g["minor"]],
            "power_mw": int(g["power_w"] * 1000),
            "limit_mw": int(g["power_limit_w"] * 1000),
            "mem_total": g["memory_total_mib"] * 2**20,
            "mem_used": g["memory_used_mib"] * 2**20,
        }
        for g in doc["gpus"]
    ]
    fake_nvml(mocker, devices, driver=doc["driver"])
    with pytest.raises(Refused) as exc:
        gpu.require_sm120()
    assert "NVIDIA H200 is sm_90" in exc.value.message


def test_apply_without_gpu_refuses_with_hint_and_changes_nothing(tmp_path, mocker):
    mocker.patch.object(pynvml, "nvmlInit", side_effect=pynvml.NVMLError_LibraryNotFound())
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    before = tree_hash(sg)
    result = CliRunner().invoke(main, ["apply", "moe", "--sglang", str(sg)])
    assert result.exit_code == 1
    assert "no NVIDIA driver found" in result.stderr and "--no-gpu-check" in result.stderr
    assert tree_hash(sg) == before


def test_dry_run_only_warns(tmp_path, mocker):
    fake_nvml(mocker, [H200])
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    result = CliRunner().invoke(main, ["apply", "moe", "--sglang", str(sg), "--dry-run"])
    assert result.exit_code == 0
    assert "warning: no SM120 GPU here" in result.stderr
    assert "+" in result.stdout


def test_doctor_json(tmp_path, mocker):
    fake_nvml(mocker, [RTX])
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    old = make_tree(tmp_path / "old", "flashinfer", "0.6.5", "git")  # the garbage report's release
    result = CliRunner().invoke(
        main, ["doctor", "--sglang", str(sg), "--flashinfer", str(fi), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["gpu"]["gpus"][0]["is_sm120"] is True
    profiles = {p["name"]: p for p in doc["profiles"]}
    assert profiles["moe"]["pinned"] is True
    # GLM-4 MoE and Qwen3 MoE apply on the 0.5.8 fixture; MiniMax-M2's site is from 0.5.18,
    # the NVFP4 MoE `auto` choice from 0.5.13.
    statuses = {o["patch"]: o["status"] for o in profiles["moe"]["outcomes"]}
    assert statuses == {"sglang.moe-backend": "applied", "sglang.moe-backend-qwen3": "applied",
                        "sglang.moe-backend-minimax": "not-applicable",
                        "sglang.moe-runner-auto": "not-applicable"}
    assert doc["recommendation"].startswith("recommended here: moe.")
    # With a FlashInfer the moe profile refuses, and a wrong-output entry about it matching
    # this SM120 box, doctor does not recommend it (its pins still hold).
    result = CliRunner().invoke(
        main, ["doctor", "--sglang", str(sg), "--flashinfer", str(old), "--json"]
    )
    doc = json.loads(result.stdout)
    moe = {p["name"]: p for p in doc["profiles"]}["moe"]
    assert moe["pinned"] is True and moe["refused"] and moe["condemned"]
    assert "moe is not recommended here: profile moe refuses FlashInfer 0.6.5" in (
        doc["recommendation"]
    )
    assert "recommended here: moe" not in doc["recommendation"]
    # One sentence each: the reason ends before the next begins.
    assert ". No profile is recommended on this box." in doc["recommendation"], (
        doc["recommendation"])


def test_probe_without_the_binding_says_what_pynvml_says(tmp_path):
    """The pre-check (no pynvml import when libnvidia-ml cannot load) reaches the verdict the
    binding reaches on this machine: the same problem line, or the same GPUs."""
    script = (
        "import json, sys\n"
        "from sm120patch.trial import gpu\n"
        "if sys.argv[1] == 'binding':\n"
        "    import pynvml\n"
        "p = gpu.read_gpus()\n"
        "print(json.dumps({'probe': p.to_dict(), 'imported': 'pynvml' in sys.modules}))\n"
    )
    out = {}
    for how in ("binding", "precheck"):
        run = subprocess.run([sys.executable, "-c", script, how], capture_output=True,
                             text=True, check=True)  # fmt: skip
        out[how] = json.loads(run.stdout)
    assert out["precheck"]["probe"]["problem"] == out["binding"]["probe"]["problem"]
    assert [g["name"] for g in out["precheck"]["probe"]["gpus"]] == [
        g["name"] for g in out["binding"]["probe"]["gpus"]
    ]
    # Without a driver the binding is never imported; with one, it does the work.
    assert out["precheck"]["imported"] == (out["binding"]["probe"]["problem"] != gpu.NO_LIBRARY)


@pytest.mark.parametrize("dry_run", [True, False])
def test_apply_starts_nvml_once(tmp_path, mocker, dry_run):
    """The known outcomes and the GPU check read one probe: NVML starts once per apply."""
    fake_nvml(mocker, [RTX])
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    args = ["apply", "moe", "--sglang", str(sg), *(["--dry-run"] if dry_run else [])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert pynvml.nvmlInit.call_count == 1
