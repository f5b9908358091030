"""vllm.fp8-cutlass-moe on sources in the shapes of vLLM's `_custom_ops.py` (written here): the
released gate is found and refused with why, never written; a release whose gate lets SM120 on
reads upstream; a shape it does not know is refused as such; and the operator's one line from
`apply vllm-fp8-moe --vllm PATH --dry-run`."""

from __future__ import annotations

import ast

import pytest
from click.testing import CliRunner
from patches_under_test import load_patch
from trees import make_tree

from sm120patch.cli import main
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Outcome, Status
from sm120patch.patchkit.runner import FileResult, transform_text

PATCH = load_patch("vllm.fp8-cutlass-moe")
FILE = "vllm/_custom_ops.py"


def custom_ops(gate: str = "if cuda_device_capability < 90 or cuda_device_capability >= 110:") -> str:
    """`_custom_ops.py` as vLLM 0.30.0 to 0.34.0 write the function, with `gate` as its test."""
    return f'''import torch


def cutlass_scaled_mm_supports_fp8(cuda_device_capability: int) -> bool:
    return torch.ops._C.cutlass_scaled_mm_supports_fp8(cuda_device_capability)


def cutlass_group_gemm_supported(cuda_device_capability: int) -> bool:
    {gate}
        return False
    try:
        return torch.ops._C.cutlass_group_gemm_supported(cuda_device_capability)
    except AttributeError:
        # Return False on non-CUDA platforms where it is not available
        return False
'''


def run(text: str) -> tuple[FileResult, Outcome]:
    result = transform_text([PATCH], FILE, text)
    [outcome] = result.outcomes
    return result, outcome


def test_the_released_gate_is_refused_with_the_reason_and_its_sources():
    result, outcome = run(custom_ops())
    assert outcome.status is Status.REFUSED
    assert outcome.site == "cutlass_group_gemm_supported"
    for words in (
        "cutlass_moe_mm",  # the kernel SM120 has no build of
        "SM90 and SM100 only",
        "No compiled cutlass_scaled_mm for CUDA device capability: 120",
        "https://github.com/vllm-project/vllm/issues/32109",
        "https://github.com/vllm-project/vllm/pull/43814 (open)",
        "`if cuda_device_capability < 90 or cuda_device_capability >= 110: return False`",
    ):
        assert words in outcome.reason, (words, outcome.reason)
    assert result.after == result.before and not result.steps  # it never writes


def test_a_release_that_lets_sm120_through_is_upstream():
    # the bound PR 43814 proposes, with its SM120 kernel
    _, outcome = run(custom_ops("if cuda_device_capability < 90 or cuda_device_capability >= 130:"))
    assert outcome.status is Status.UPSTREAM, outcome.describe()
    assert ">= 130" in outcome.reason


@pytest.mark.parametrize(
    "gate",
    [
        "if cuda_device_capability not in (90, 100):",  # another test
        "if cuda_device_capability < 90 or cuda_device_capability > 110:",  # another operator
        "if cuda_device_capability < 90 or cuda_device_capability >= 110 or x:",  # more
        "if cuda_device_capability < 90 or other >= 110:",  # two quantities
    ],
)
def test_a_gate_of_another_shape_is_refused_as_a_shape_it_does_not_know(gate):
    result, outcome = run(custom_ops(gate))
    assert outcome.status is Status.REFUSED
    assert outcome.reason.startswith("expected first `if <capability> < 90 or <capability> >= N")
    assert gate.removeprefix("if ").rstrip(":") in outcome.reason
    assert "cutlass_moe_mm" not in outcome.reason  # not the released gate's reason
    assert result.after == result.before


def test_a_gate_that_no_longer_returns_false_first_is_refused():
    text = custom_ops().replace("        return False\n    try", "        pass\n    try", 1)
    _, outcome = run(text)
    assert outcome.status is Status.REFUSED and "found `if" in outcome.reason


def test_no_such_function_is_not_applicable_without_a_parse():
    _, outcome = run("import torch\n\ndef cutlass_scaled_mm_supports_fp8(c):\n    return c\n")
    assert outcome.status is Status.NOT_APPLICABLE
    assert "no `cutlass_group_gemm_supported`" in outcome.reason  # the sieve's words


def test_two_definitions_are_refused():
    text = custom_ops() + "\n\n" + custom_ops().split("\n\n\n")[-1]
    _, outcome = run(text)
    assert outcome.status is Status.REFUSED and "2 definitions" in outcome.reason


def _fact(status: Status) -> Fact:
    return Fact(releases="", status=status, shape="", file=FILE,
                function="cutlass_group_gemm_supported")  # fmt: skip


def test_the_check_reads_the_gate_on_its_own():
    check = PATCH.check
    assert check is not None
    refused = ast.parse(custom_ops())
    check(refused, refused, _fact(Status.REFUSED))
    opened = ast.parse(custom_ops("if cuda_device_capability < 90 or cuda_device_capability >= 130:"))
    check(opened, opened, _fact(Status.UPSTREAM))
    with pytest.raises(AssertionError):  # a release that lets SM120 on is no refusal
        check(opened, opened, _fact(Status.REFUSED))
    with pytest.raises(AssertionError):  # and one that keeps it out is no upstream
        check(refused, refused, _fact(Status.UPSTREAM))


def test_the_facts_say_refused_on_every_pinned_release():
    for version in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"):
        [fact] = PATCH.facts_at(version)
        assert fact.status is Status.REFUSED and fact.file == FILE


def test_apply_dry_run_answers_why_not_in_one_line(tmp_path):
    site = make_tree(tmp_path, "vllm", "0.34.0", "installed")
    (site / FILE).write_text(custom_ops())
    before = (site / FILE).read_bytes()
    out = CliRunner().invoke(main, ["apply", "vllm-fp8-moe", "--vllm", str(site), "--dry-run"])
    assert out.exit_code == 1, out.output
    [line] = [x for x in out.output.splitlines() if "vllm.fp8-cutlass-moe" in x]
    assert "refused at vllm/_custom_ops.py::cutlass_group_gemm_supported" in line
    assert "cutlass_moe_mm" in line and "issues/32109" in line
    assert (site / FILE).read_bytes() == before
    # --force passes pins and a profile's refusals, never a patch's: the gate stays
    forced = CliRunner().invoke(main, ["apply", "vllm-fp8-moe", "--vllm", str(site), "--force"])
    assert forced.exit_code == 1 and "cutlass_moe_mm" in forced.output, forced.output
    assert (site / FILE).read_bytes() == before
