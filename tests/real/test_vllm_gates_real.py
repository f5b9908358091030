"""Three of the vLLM gates #32 names, read in every pinned vLLM release (the release cache's
`.py` files): the ones sm120patch must not patch, and why (docs/vllm.md).

- The FP8 CUTLASS MoE gate (`cutlass_group_gemm_supported`, vllm/_custom_ops.py): found and
  refused by `apply vllm-fp8-moe --dry-run`, with the reason, the tree untouched; the gate
  read here with `ast`, apart from the patch.
- The FlashInfer CUTLASS MoE device check (`FlashInferExperts._supports_current_device`):
  takes the SM120 family already (upstream).
- Marlin: its capability floor is SM75; the W4A8-FP8 check (`get_marlin_input_dtype`) takes the
  SM120 family in 0.30.0 to 0.33.0, and 0.34.0 removed it with VLLM_MARLIN_INPUT_DTYPE."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

from sm120patch.cli import main
from sm120patch.maintain import releases, sources

pytestmark = pytest.mark.real

PINNED = releases.DEFAULT_RELEASES["vllm"]
FP8_GATE = "cuda_device_capability < 90 or cuda_device_capability >= 110"


@pytest.fixture(scope="module")
def reachable() -> None:
    if not releases.index_reachable() and not all(
        (releases.cache_dir() / "trees" / f"vllm-{v}").is_dir() for v in PINNED
    ):
        pytest.skip(f"the index ({releases.index_sources()}) is unreachable: vLLM's sources "
                    "are fetched from it")  # fmt: skip


def _tree(version: str) -> Path:
    return sources.tree("vllm", version)


def _function(path: Path, qualname: str) -> ast.FunctionDef | None:
    scope: list[ast.stmt] = ast.parse(path.read_bytes()).body
    *owner, name = qualname.split(".")
    for cls in owner:
        scope = next(n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == cls)
    return next((n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name), None)


@pytest.mark.parametrize("version", PINNED)
def test_the_fp8_cutlass_moe_gate_is_found_and_refused_with_the_reason(
    version: str, reachable: None
) -> None:
    root = _tree(version)
    ops = root / "vllm" / "_custom_ops.py"
    func = _function(ops, "cutlass_group_gemm_supported")
    assert func is not None
    first = func.body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == FP8_GATE
    assert ast.unparse(first.body) == "return False"  # SM120 (120 >= 110) stops here
    assert "torch.ops._C.cutlass_group_gemm_supported" in ast.unparse(func)
    before = ops.read_bytes()

    out = CliRunner().invoke(main, ["apply", "vllm-fp8-moe", "--vllm", str(root), "--dry-run"])
    assert out.exit_code == 1, out.output
    [line] = [x for x in out.output.splitlines() if "vllm.fp8-cutlass-moe: refused" in x]
    assert "at vllm/_custom_ops.py::cutlass_group_gemm_supported" in line
    assert f"`if {FP8_GATE}: return False`" in line
    assert "cutlass_moe_mm" in line and "https://github.com/vllm-project/vllm/issues/32109" in line
    assert ops.read_bytes() == before


@pytest.mark.parametrize("version", PINNED)
def test_the_flashinfer_cutlass_moe_device_check_takes_sm120(version: str, reachable: None) -> None:
    path = _tree(version) / "vllm/model_executor/layers/fused_moe/experts/flashinfer_cutlass_moe.py"
    func = _function(path, "FlashInferExperts._supports_current_device")
    assert func is not None
    text = ast.unparse(func)
    assert "p.is_device_capability_family(120)" in text, text  # the family: SM120 and SM121
    assert "p.is_device_capability_family(100)" in text and "p.is_device_capability(90)" in text


@pytest.mark.parametrize("version", PINNED)
def test_marlin_leaves_sm120_in(version: str, reachable: None) -> None:
    root = _tree(version)
    utils = root / "vllm/model_executor/layers/quantization/utils/marlin_utils.py"
    floor = _function(utils, "query_marlin_supported_quant_types")
    assert floor is not None
    floors = [n for n in ast.walk(floor) if isinstance(n, ast.If)
              and ast.unparse(n.test) == "device_capability < 75"]  # fmt: skip
    assert [ast.unparse(n.body) for n in floors] == ["return []"]
    w4a8 = _function(utils, "get_marlin_input_dtype")
    if version < "0.34.0":  # pinned releases compare as strings of one width here
        assert w4a8 is not None
        text = ast.unparse(w4a8)
        assert (
            "not current_platform.is_device_capability(89) and "
            "(not current_platform.is_device_capability_family(120))"
        ) in text, text
    else:  # 0.34.0: W4A8 Marlin activations are gone, the variable listed as removed
        assert w4a8 is None
        envs = (root / "vllm" / "envs.py").read_text("utf-8")
        assert '"VLLM_MARLIN_INPUT_DTYPE": (\n        "Marlin no longer supports 8-bit' in envs
