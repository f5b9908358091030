"""`sm120patch explain --profile fp4-gemm` and `--profile attention` on SGLang 0.5.23 under a
simulated SM120, through the CLI: the FP4 GEMM line and the attention line say what changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import envs
import pytest
from click.testing import CliRunner

from sm120patch.cli import main
from sm120patch.maintain import dists, releases

pytestmark = pytest.mark.behaviour

VERSION = "0.5.23"


def explain_json(sglang: Path, profile: str, model: Path) -> dict:
    result = CliRunner().invoke(main, [
        "explain", "--sglang", str(sglang), "--python", str(envs.deps_python()),
        "--simulate", "sm120", "--profile", profile, "--json", "--",
        "--model-path", str(model), "--random-seed", "0",
    ])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The release installed by itself; the FlashInfer and transformers it pins reach the
    probe's interpreter through PYTHONPATH, as they would be installed beside it."""
    if not releases.pypi_reachable() and dists.cached("sglang", VERSION) is None:
        pytest.skip(f"PyPI is unreachable and SGLang {VERSION} is not cached")
    prefix, *beside = envs.sys_path_for("sglang", VERSION)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(beside))
    return Path(prefix)


def test_explain_fp4_gemm_and_attention(sglang: Path, tmp_path: Path) -> None:
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    fp4 = explain_json(sglang, "fp4-gemm", model)
    assert fp4["applied"] is False
    # SGLang 0.5.23 pins FlashInfer 0.7.2, whose b12x asks CUDA 12.9: the simulated CUDA.
    assert fp4["pristine"]["fp4_gemm_backend"] == "flashinfer_cutlass"
    assert fp4["patched"]["fp4_gemm_backend"] == "flashinfer_b12x"
    assert fp4["pristine"]["attention_backend"] == fp4["patched"]["attention_backend"]
    attention = explain_json(sglang, "attention", model)
    assert attention["pristine"]["attention_backend"] == "flashinfer"
    assert attention["patched"]["attention_backend"] == "trtllm_mha"
    assert attention["pristine"]["fp4_gemm_backend"] == attention["patched"]["fp4_gemm_backend"]
