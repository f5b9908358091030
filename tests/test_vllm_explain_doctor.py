"""`explain --vllm PATH` and `doctor --vllm PATH` at the fixture level: no torch and no vLLM
release importable on the test machine, so the probe runs here (the real script, by path, in
this interpreter) against a stand-in torch and the fixture vLLM tree, which carries a
`vllm.platforms` with vLLM's shape (a `current_platform` the probe sets, a `cuda` module whose
`NonNvmlCudaPlatform` asks torch, as vllm/platforms/cuda.py's does). The vLLM patch and its
reader are a test pack's; the real tiers read real releases."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from trees import make_tree
from trialkit import run_cli
from vllmpack import write_pack

from sm120patch.config import Config
from sm120patch.plan import catalog

GATES = "vllm/platforms/gates.py"


# What the probe reads of torch, as torch spells it; the probe's simulation replaces the rest.
TORCH = """\
import types
__version__ = "0.0+stand-in"
cuda = types.SimpleNamespace(is_available=lambda: False)
version = types.SimpleNamespace(cuda=None)
library = types.SimpleNamespace()
"""
# vLLM's shape (vllm/platforms/__init__.py, cuda.py), written by us: the platform is chosen
# lazily and can be set; the torch-asking CUDA platform answers from torch's capability.
PLATFORMS_INIT = "current_platform = None  # chosen by NVML in vLLM; the probe sets it\n"
PLATFORMS_CUDA = """\
import torch


class NonNvmlCudaPlatform:
    def get_device_capability(self, device_id=0):
        return torch.cuda.get_device_capability(device_id)

    def is_device_capability(self, capability):
        major, minor = self.get_device_capability()
        return major * 10 + minor == capability

    def is_device_capability_family(self, capability):
        return self.get_device_capability()[0] == capability // 10
"""


@pytest.fixture
def pack(tmp_path):
    return write_pack(tmp_path / "pack")


@pytest.fixture
def site(tmp_path) -> Path:
    root = make_tree(tmp_path, "vllm", "0.34.0", "installed")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(TORCH)
    (root / "vllm" / "platforms" / "__init__.py").write_text(PLATFORMS_INIT)
    (root / "vllm" / "platforms" / "cuda.py").write_text(PLATFORMS_CUDA)
    (root / "vllm" / "__init__.py").write_text('__version__ = "0.34.0"\n')
    return root


def explain(pack: Path, site: Path, *extra: str) -> tuple[int, dict | None, str]:
    import sys

    # --profile: the library may hold vLLM profiles of its own beside the pack's
    code, out, err = run_cli("--patches", str(pack), "explain", "--vllm", str(site),
                             "--python", sys.executable, "--simulate", "sm120", "--json",
                             *(extra if "--profile" in extra else ("--profile", "vmoe-test",
                                                                   *extra)))
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def test_explain_runs_the_vllm_reader_on_both_sides(pack, site, tmp_path, monkeypatch):
    # An SGLang this Python would find by default: with --vllm it is not looked for.
    monkeypatch.syspath_prepend(str(make_tree(tmp_path, "sglang", "0.5.8", "installed")))
    code, doc, err = explain(pack, site)
    assert code == 0, err
    assert [t["kind"] for t in doc["targets"]] == ["vllm"]  # no SGLang looked for beside it
    assert doc["applied"] is False
    assert doc["pristine"]["vllm_test_moe"] == "no cutlass MoE"  # capability 100 only
    assert doc["patched"]["vllm_test_moe"] == "cutlass MoE"  # the planned text, SM120 passes
    assert doc["notes"] == []  # no launch given, none needed for vLLM
    # The SGLang launch rows are not shown for vLLM.
    assert "moe_runner_backend" not in {k for k, v in doc["pristine"].items() if v is not None}


def test_explain_on_an_applied_vllm_reads_the_pristine_copy(pack, site):
    code, out, err = run_cli("--patches", str(pack), "apply", "vmoe-test", "--vllm", str(site),
                             "--no-gpu-check")
    assert code == 0, err
    code, doc, err = explain(pack, site, "--", "--model", "/m")
    assert code == 0, err
    assert doc["applied"] is True
    assert (doc["pristine"]["vllm_test_moe"], doc["patched"]["vllm_test_moe"]) == (
        "no cutlass MoE", "cutlass MoE")
    assert doc["launch"] == []
    assert doc["notes"][0].startswith("launch arguments not resolved: the probe resolves SGLang's")


def test_the_probe_reports_vllm_and_its_simulated_platform(pack, site):
    import sys

    from sm120patch.explain import explain as explaining

    readers = explaining.reader_requests(["vllm"], catalog.load(Config((str(pack),))))
    result = explaining.run_probe(sys.executable, {
        "simulate": "sm120", "sys_path": [str(site)], "sglang": False, "vllm": True,
        "readers": readers})
    assert result["vllm"]["version"] == "0.34.0"
    assert result["vllm"]["platform"] == "NonNvmlCudaPlatform"
    assert result["vllm"]["capability"] == [12, 0]
    assert result["vllm_test_moe"] == {"cutlass": False, "gpu": "sm120"}


def test_explain_refuses_a_profile_that_patches_nothing_named(pack, site):
    code, doc, err = explain(pack, site, "--profile", "moe")
    assert code == 2 and "profile moe patches nothing of vLLM" in err


def test_doctor_with_vllm_shows_it_and_its_profiles(pack, site):
    code, out, err = run_cli("--patches", str(pack), "doctor", "--vllm", str(site))
    assert code == 0, err
    assert f"vllm: 0.34.0 (installed) at {site}" in out
    assert "profile vmoe-test [experimental]: would apply" in out
    assert "looked for only with --vllm" not in out


def test_doctor_says_whether_b12x_is_installed_beside_vllm(pack, site, tmp_path):
    """vllm-moe's B12X backend (and vllm-fp4-gemm's kernel) runs only with the b12x package: doctor reads whether it is in
    vLLM's site-packages from the dist-info name, importing nothing of it (its __init__ would
    leave a mark)."""
    mark = tmp_path / "imported"
    (site / "b12x").mkdir()
    (site / "b12x" / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    code, out, err = run_cli("--patches", str(pack), "doctor", "--vllm", str(site))
    assert code == 0, err
    assert ("  b12x: not installed: vllm-moe's B12X MoE backend (and vllm-fp4-gemm's B12X "
            "NVFP4 GEMM) falls through (`pip install 'vllm[b12x]'`)") in out
    (site / "b12x-1.5.1.dist-info").mkdir()
    code, out, err = run_cli("--patches", str(pack), "doctor", "--vllm", str(site), "--json")
    assert code == 0, err
    [target] = [t for t in json.loads(out)["targets"] if t["kind"] == "vllm"]
    assert target["beside"] == [{"package": "b12x", "version": "1.5.1",
                                 "state": "installed (1.5.1)",
                                 "used_by": "vllm-moe's B12X MoE backend (and "
                                            "vllm-fp4-gemm's B12X NVFP4 GEMM)"}]
    assert not mark.exists()


def test_doctor_without_vllm_says_where_it_is_looked_for(pack):
    code, out, err = run_cli("--patches", str(pack), "doctor")
    assert code == 0, err
    assert re.search(r"^vLLM: looked for only with --vllm PATH \(profiles that patch it: "
                     r"(.*, )?vmoe-test\)$", out, re.M), out
    assert "profile vmoe-test [experimental]: not checked: vLLM is looked for only with " \
           "--vllm PATH" in out


def test_doctor_says_it_only_where_a_profile_patches_vllm():
    """Without a pack: the line is there exactly when the library has a vLLM profile."""
    code, out, err = run_cli("doctor")
    assert code == 0, err
    library = [p.name for p in catalog.load().profiles.values() if "vllm" in p.targets]
    assert ("vLLM: looked for only with --vllm PATH" in out) == bool(library)


def test_explain_without_profile_takes_the_one_that_patches_vllm(pack, site, monkeypatch):
    """The pack's profile, when it is the only one that patches vLLM; more: name one."""
    import sys

    library = [n for n, p in catalog.load(Config((str(pack),))).profiles.items()
               if "vllm" in p.targets]
    code, out, err = run_cli("--patches", str(pack), "explain", "--vllm", str(site),
                             "--python", sys.executable, "--simulate", "sm120", "--json")
    if library == ["vmoe-test"]:
        assert code == 0, err
        assert json.loads(out)["patched"]["vllm_test_moe"] == "cutlass MoE"
    else:
        assert code == 2 and "profiles patch vLLM" in err and "--profile PROFILE" in err


# ---- the reader of vllm.moe-b12x, on vLLM's selection in the shape of 0.30/0.31 -------------


ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"


@pytest.mark.parametrize("shape", ["0.30-list", "0.32-humming"])
@pytest.mark.parametrize(("arch", "b12x", "pristine", "patched"), [
    ("sm120", True, "MARLIN, no B12X/FLASHINFER_B12X", "B12X, FLASHINFER_B12X before MARLIN"),
    # exactly 12.0 only; the target's Python without the b12x package says so
    ("sm100", False, "MARLIN, no B12X/FLASHINFER_B12X (no b12x package)",
     "MARLIN, no B12X/FLASHINFER_B12X (no b12x package)"),
])
def test_explain_reads_the_nvfp4_moe_order(site, arch, b12x, pristine, patched, shape):
    """The library's vllm-moe profile: pristine, auto walks MARLIN with neither b12x backend;
    patched on SM120, B12X then FLASHINFER_B12X first; whether the target's Python has the b12x
    package (read there, with vLLM's own test, `find_spec`). The fixture's loop needs a field
    the reader does not give (`config.supported`): what the function does past its list is not
    the answer. In the 0.32 shape `prioritize_humming` returns a new list: the reader follows
    the name."""
    import sys

    if b12x:
        (site / "b12x").mkdir()
        (site / "b12x" / "__init__.py").write_text("")

    from test_vllm_moe_b12x import HUMMING, LIST

    (site / ORACLE).parent.mkdir(parents=True)
    (site / ORACLE).write_text(LIST if shape == "0.30-list" else HUMMING)
    humming = site / "vllm/model_executor/layers/quantization/utils/humming.py"
    humming.parent.mkdir(parents=True)
    humming.write_text("def prioritize_humming(kernels):\n    return [*kernels]\n")
    (site / "vllm" / "logger.py").write_text(
        "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n")
    code, out, err = run_cli("explain", "--vllm", str(site), "--python", sys.executable,
                             "--simulate", arch, "--profile", "vllm-moe", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["pristine"]["nvfp4_moe_order"] == pristine
    assert doc["patched"]["nvfp4_moe_order"] == patched
    code, out, err = run_cli("explain", "--vllm", str(site), "--python", sys.executable,
                             "--simulate", arch, "--profile", "vllm-moe")
    assert "NVFP4 MoE auto order" in out
