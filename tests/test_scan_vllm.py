"""vLLM's architecture vocabulary: its capability checks in the kit (`patchkit/arch.py`) and the
gates `scan` finds with them, on small fixtures written for these tests (vLLM's spellings as
vllm/platforms/interface.py defines them; no upstream code copied)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sm120patch.patchkit import arch
from sm120patch.scan import classify, filescan, gates, run

SM100_FAMILY = frozenset({arch.SM100, arch.SM103})
FROM_SM100 = frozenset({arch.SM100, arch.SM103, arch.SM110, arch.SM120, arch.SM121})


@pytest.mark.parametrize(
    ("spelled", "argument", "caps"),
    [
        # exactly that capability: an int `major * 10 + minor`, or a tuple
        ("current_platform.is_device_capability()", 100, {arch.SM100}),
        ("current_platform.is_device_capability()", (10, 3), {arch.SM103}),
        ("current_platform.is_device_capability()", 90, {arch.SM90}),
        ("cls.is_device_capability()", (12, 0), {arch.SM120}),
        # a family is the major: 100 is 10.x, 120 is 12.x
        ("current_platform.is_device_capability_family()", 100, SM100_FAMILY),
        ("current_platform.is_device_capability_family()", 120, {arch.SM120, arch.SM121}),
        ("current_platform.is_device_capability_family()", 103, SM100_FAMILY),
        # at least that capability
        ("current_platform.has_device_capability()", 100, FROM_SM100),
        ("current_platform.has_device_capability()", (9, 0), {arch.SM90} | FROM_SM100),
        ("current_platform.has_device_capability()", 121, {arch.SM121}),
        # a GPU the scan does not evaluate: a check no point passes
        ("current_platform.is_device_capability()", 107, set()),
    ],
)
def test_vllm_capability_checks_select_their_gpus(
    spelled: str, argument: object, caps: set[arch.Capability]
) -> None:
    assert arch.capability_check(spelled, argument) == caps


@pytest.mark.parametrize(
    ("spelled", "argument"),
    [
        ("current_platform.has_device_capability()", 60),  # no arch the scan knows
        ("current_platform.is_device_capability_family()", (10, 0)),  # the family takes an int
        ("current_platform.is_device_capability()", "100"),
        ("current_platform.get_device_capability()", 100),
        ("current_platform.is_cuda()", 100),
    ],
)
def test_other_calls_are_no_vllm_capability_checks(spelled: str, argument: object) -> None:
    assert arch.capability_check(spelled, argument) is None


def test_capability_to_int_is_an_sm_number() -> None:
    assert arch.arch_quantity("capability.to_int()") == "sm"
    assert arch.arch_quantity("current_platform.get_device_capability().to_int()") == "sm"
    assert arch.arch_quantity("config.to_int()") is None


def test_a_dotted_capability_is_a_table_key_only() -> None:
    assert arch.arch_string("12.0", dotted=True) == (frozenset({arch.SM120}), False)
    assert arch.arch_string("10.7", dotted=True) == (frozenset(), False)
    assert arch.arch_string("12.0") is None  # a CUDA version as often
    assert arch.arch_string("0.12.0", dotted=True) is None


def test_vllm_blackwell_is_major_ten() -> None:
    # vLLM's own `_is_blackwell()` is `is_device_capability_family(100)`
    assert arch.arch_predicate("_is_blackwell()", "vllm/model_executor/x.py") == SM100_FAMILY
    assert arch.arch_predicate("_is_blackwell()", "sglang/srt/x.py") == frozenset(
        c for c in arch.ARCH_POINTS if c[0] in (10, 11, 12)
    )


# ----------------------------------------------------------------------------- the gates


def scan(text: str, file: str = "vllm/model_executor/layers/x.py") -> list[gates.Gate]:
    found = filescan.scan_text(file, textwrap.dedent(text))
    assert not found.problem, found.problem
    return found.gates


@pytest.mark.parametrize(
    ("test", "verdict", "favoured"),
    [
        ("current_platform.is_device_capability_family(100)", "leaves-out", ("sm100", "sm103")),
        ("current_platform.is_device_capability(100)", "leaves-out", ("sm100",)),
        ("current_platform.is_device_capability((10, 3))", "leaves-out", ("sm103",)),
        ("current_platform.is_device_capability(90)", "leaves-out", ("sm90",)),
        ("current_platform.has_device_capability(100)", "admits", ("sm90",)),
        ("current_platform.get_device_capability() == (10, 0)", "leaves-out", ("sm100",)),
        ("capability.to_int() in (100, 103)", "leaves-out", ("sm100", "sm103")),
        (
            "current_platform.is_device_capability_family(100) and not "
            "current_platform.is_device_capability_family(120)",
            "excludes",  # names SM120 to leave it out
            ("sm100", "sm103"),
        ),
    ],
)
def test_vllm_gates_are_read_per_gpu(test: str, verdict: str, favoured: tuple[str, ...]) -> None:
    found = scan(f"""
        def select(x):
            if {test}:
                return "fast"
            return "slow"
    """)
    assert [(g.verdict, g.favoured) for g in found] == [(verdict, favoured)]


@pytest.mark.parametrize(
    "test",
    [
        "current_platform.is_device_capability_family(120)",
        "current_platform.is_device_capability((12, 0))",
        "current_platform.is_device_capability_family(100) or "
        "current_platform.is_device_capability_family(120)",
        "current_platform.has_device_capability(80)",  # every GPU the scan evaluates
        "current_platform.is_device_capability(device)",  # no arch in the text
    ],
)
def test_sm120_aware_or_archless_vllm_tests_are_no_gate(test: str) -> None:
    assert scan(f"""
        def select(x):
            if {test}:
                return "fast"
            return "slow"
    """) == []


def test_a_capability_tuple_argument_is_no_list_of_majors() -> None:
    # `(10, 7)` is one capability (Rubin), not the majors 10 and 7
    assert scan("""
        def _is_sm107() -> bool:
            return current_platform.is_device_capability((10, 7))
    """) == []


def test_a_table_keyed_by_capability_strings_without_12_0_leaves_sm120_out() -> None:
    found = scan("""
        MAX_SIZES = {
            "9.0": {2: 1, 4: 2},
            "10.0": {2: 4, 4: 8},
            "10.7": {2: 4},
        }
    """)
    assert [(g.kind, g.verdict, g.favoured) for g in found] == [
        ("list", "leaves-out", ("sm90", "sm100"))
    ]
    with_sm120 = scan("""
        MAX_SIZES = {"9.0": {2: 1}, "10.0": {2: 4}, "12.0": {2: 4}}
    """)
    assert with_sm120 == []


def test_a_table_keyed_by_sm_numbers_is_read_by_the_comment_above_it() -> None:
    table = """
        {comment}
        FUSION_MAX_MB: dict[int, dict[int, float]] = {{
            90: {{2: 64, 4: 2}},
            100: {{2: 64, 4: 32}},
            103: {{2: 64}},
        }}
    """
    found = scan(table.format(comment="# Max size per world size per device capability"))
    assert [(g.kind, g.verdict, g.favoured) for g in found] == [
        ("list", "leaves-out", ("sm90", "sm100", "sm103"))
    ]
    # the same numbers with nothing saying they are archs are world sizes, batch sizes...
    assert scan(table.format(comment="# Max size per world size")) == []


def test_a_vllm_helper_named_for_an_arch_is_a_word() -> None:
    found = scan("""
        def _is_sm12x() -> bool:
            return current_platform.is_device_capability_family(120)

        def _is_hopper() -> bool:
            return current_platform.is_device_capability((9, 0))

        def block_m(n):
            if _is_hopper():
                return 64
            if _is_sm12x():
                return 32
            return 128
    """)
    # the definitions are words, `_is_sm12x()` names SM120, `_is_hopper()` leaves it out
    assert [(g.function, g.expression, g.verdict) for g in found] == [
        ("block_m", "_is_hopper()", "leaves-out")
    ]


def test_scan_directory_reads_a_plain_vllm_tree(tmp_path: Path) -> None:
    pkg = tmp_path / "vllm" / "model_executor"
    pkg.mkdir(parents=True)
    (pkg / "moe.py").write_text(
        textwrap.dedent("""
        from vllm.platforms import current_platform

        def select_gemm():
            if current_platform.is_device_capability_family(100):
                return "deep_gemm"
            return "triton"

        def select_chunk():
            if current_platform.is_device_capability_family(100):
                return 64
            return 32
        """)
    )
    (tmp_path / "vllm" / "tests").mkdir()
    (tmp_path / "vllm" / "tests" / "test_moe.py").write_text(
        "if current_platform.is_device_capability_family(100):\n    pass\n"
    )
    out = run.scan_directory("vllm", tmp_path / "vllm", "0.34.0")
    assert (out.kind, out.version, out.files_read) == ("vllm", "0.34.0", 1)
    assert [(x.gate.file, x.gate.function, x.cls) for x in out.gates] == [
        ("vllm/model_executor/moe.py", "select_gemm", classify.KERNEL),
        ("vllm/model_executor/moe.py", "select_chunk", classify.CANDIDATE),
    ]


def test_scan_vllm_path_classes_an_installed_vllms_gates(tmp_path: Path) -> None:
    """`sm120patch scan --vllm PATH`: the vLLM named is found as a target and its gates classed
    (a candidate here: no patch covers it, no kernel family needs it); SGLang and FlashInfer,
    not named, are not scanned."""
    import json

    from click.testing import CliRunner
    from trees import make_tree

    from sm120patch.cli import main

    site = make_tree(tmp_path, "vllm", "0.34.0", "installed")
    result = CliRunner().invoke(main, ["scan", "--vllm", str(site), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [t["kind"] for t in report["targets"]] == ["vllm"]
    (gate,) = report["targets"][0]["gates"]
    assert (gate["file"], gate["class"]) == ("vllm/platforms/gates.py", "candidate"), gate
