"""`sm120patch explain` on a real release: the same probe as the rest of this tier, reached
through the CLI, on the pristine install and on the same install with `moe` applied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import envs
import pytest
from behave import NVFP4, Behaviour, write_model
from checks import GLM
from click.testing import CliRunner

from sm120patch.cli import main
from sm120patch.engine import apply

pytestmark = pytest.mark.behaviour

VERSION = "0.5.8"


def explain_json(behaviour: Behaviour, sglang: Path, model: Path, tp: int = 4) -> dict:
    result = CliRunner().invoke(main, [
        "explain", "--sglang", str(sglang), "--python", str(behaviour.python),
        "--simulate", "sm120", "--json", "--",
        "--model-path", str(model), "--tp", str(tp), "--random-seed", "0",
    ])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


@pytest.mark.parametrize("sglang_version", [VERSION])
def test_explain_pristine_vs_planned(behaviour: Behaviour, sglang_version: str,
                                     tmp_path: Path) -> None:
    model = write_model(tmp_path / "glm", GLM, NVFP4)
    # TP2: on SM120 the patched auto-enable turns fusion on at TP2 only.
    doc = explain_json(behaviour, envs.release_prefix("sglang", VERSION), model, tp=2)
    assert doc["applied"] is False
    assert doc["pristine"]["moe_runner_backend"] == "auto"
    assert doc["patched"]["moe_runner_backend"] == "flashinfer_cutlass"
    assert (doc["pristine"]["allreduce_fusion"], doc["patched"]["allreduce_fusion"]) == ("off", "on")
    assert doc["pristine"]["gate"].startswith("closed")
    assert doc["patched"]["gate"].startswith("passes")
    # The patch derives the quantization locally: the field is the same on both sides.
    assert doc["pristine"]["quantization"] == doc["patched"]["quantization"]


@pytest.mark.parametrize("sglang_version", [VERSION])
def test_explain_on_an_applied_install(behaviour: Behaviour, sglang_version: str,
                                       tmp_path: Path) -> None:
    """With `moe` applied, the files on disk are the patched side and the pristine copy the
    other: the same decisions as planned, the other way round in where they come from."""
    site = tmp_path / "site-packages"
    shutil.copytree(envs.release_prefix("sglang", VERSION), site, symlinks=True)
    report = apply.apply("moe", {"sglang": str(site), "flashinfer": None}, preconditions=None)
    assert report.action == "applied"
    doc = explain_json(behaviour, site, write_model(tmp_path / "glm", GLM, NVFP4))
    assert doc["applied"] is True
    assert doc["pristine"]["moe_runner_backend"] == "auto"
    assert doc["patched"]["moe_runner_backend"] == "flashinfer_cutlass"
    # moe touches no fusion site: both sides keep fusion off on SM120.
    assert doc["pristine"]["allreduce_fusion"] == doc["patched"]["allreduce_fusion"] == "off"
