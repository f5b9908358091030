"""`sm120patch scan` on small fixtures written for these tests: the arch words, which tests are
gates and what each is, the regions the parser reads, the classes, the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from trees import make_tree

from sm120patch.cli import main
from sm120patch.patchkit import arch as words
from sm120patch.scan import classify, evaluate, filescan, gates, report, run


def scan(text: str, file: str = "sglang/srt/layers/x.py") -> list[gates.Gate]:
    found = filescan.scan_text(file, textwrap.dedent(text))
    assert not found.problem, found.problem
    return found.gates


def one(text: str, **kwargs: str) -> gates.Gate:
    found = scan(text, **kwargs)
    assert len(found) == 1, found
    return found[0]


# ----------------------------------------------------------------------------- the words


@pytest.mark.parametrize(
    ("spelled", "majors"),
    [
        ("is_sm100_supported()", {10}),
        ("get_platform().is_sm100", {10}),
        ("_is_sm100_supported", {10}),
        ("self._is_sm90", {9}),
        ("is_sm100a_supported()", {10}),
        ("get_platform().is_sm100_or_sm110", {10, 11}),
        ("is_sm12x_supported()", {12}),
        ("is_blackwell()", {10, 11, 12}),
        ("get_platform().is_hopper_with_cuda_12_3", {9}),
        ("_is_sm100_or_newer()", {10, 11, 12}),
    ],
)
def test_arch_predicates_in_any_spelling(spelled: str, majors: set[int]) -> None:
    caps = words.arch_predicate(spelled)
    assert caps is not None and {c[0] for c in caps} == majors


@pytest.mark.parametrize(
    "spelled", ["is_cuda()", "is_sm100_or_greener()", "is_blackwell_msa_device()", "x.is_hip"]
)
def test_other_checks_are_no_arch_words(spelled: str) -> None:
    assert words.arch_predicate(spelled) is None


def test_words_can_mean_something_else_under_a_path() -> None:
    # The diffusion runtime's platform says is_blackwell() for major 10 alone.
    caps = words.arch_predicate("current_platform.is_blackwell()", "sglang/multimodal_gen/x.py")
    assert caps is not None and {c[0] for c in caps} == {10}


@pytest.mark.parametrize(
    ("spelled", "kind"),
    [
        ("sm_major", "major"),
        ("cap.major", "major"),
        ("torch.cuda.get_device_capability()[0]", "major"),
        ("get_compute_capability()", "capability"),
        ("device_capability", "capability"),
        ("get_device_sm()", "sm"),
        ("self.device_sm", "sm"),
        ("torch_version.major", None),
        ("num_sm", None),
        ("max_cap", None),
    ],
)
def test_arch_quantities(spelled: str, kind: str | None) -> None:
    assert words.arch_quantity(spelled) == kind


@pytest.mark.parametrize(
    ("text", "caps", "specific"),
    [
        ("sm_100a", {(10, 0)}, True),
        ("compute_90a", {(9, 0)}, True),
        ("10.3a", {(10, 3)}, True),
        ("-gencode=arch=compute_100a,code=sm_100a", {(10, 0)}, True),
        ("sm_120f", {(12, 0), (12, 1)}, False),
    ],
)
def test_compile_targets(text: str, caps: set, specific: bool) -> None:
    assert words.arch_string(text) == (frozenset(caps), specific)


def test_a_kernel_name_or_a_version_is_no_compile_target() -> None:
    assert words.arch_string("gemm.sm100_sm103.dense") is None
    assert words.arch_string("12.8") is None


def test_the_sglang_spelling_is_the_same_word_list() -> None:
    assert words.sglang_arch_spelled("get_platform().is_sm100") == ("sm100", "platform")
    assert words.sglang_arch_spelled("self._is_sm100") is None  # the patches stay strict


# ----------------------------------------------------------------------------- gates


def test_a_check_for_sm100_leaves_sm120_out_and_says_what_it_sets() -> None:
    gate = one(
        """
        def pick(cfg):
            if cfg.backend == "auto":
                if is_sm100_supported():
                    cfg.backend = "fast_sm100_kernel"
        """
    )
    assert (gate.verdict, gate.kind, gate.function, gate.line) == (
        evaluate.LEAVES_OUT,
        "if",
        "pick",
        4,
    )
    assert gate.favoured == ("sm100", "sm103")
    assert gate.gates == "sets cfg.backend = 'fast_sm100_kernel'"
    assert gate.choices == ("backend=fast_sm100_kernel",)
    assert gate.expression == "is_sm100_supported()"


@pytest.mark.parametrize(
    ("test", "verdict"),
    [
        ("sm_major not in (9, 10)", evaluate.LEAVES_OUT),
        ("major == 10", evaluate.LEAVES_OUT),
        ("not get_platform().is_sm100", evaluate.LEAVES_OUT),
        ("(_is_sm90 or _is_sm100) and enabled", evaluate.LEAVES_OUT),
        ("get_device_sm() in (100, 103)", evaluate.LEAVES_OUT),
        ("torch.cuda.get_device_capability() == (10, 0)", evaluate.LEAVES_OUT),
        ("major == 9", evaluate.LEAVES_OUT),  # Hopper alone: SM120 goes where SM100 goes
        ("major >= 10", evaluate.ADMITS),
        ("is_blackwell()", evaluate.ADMITS),
        ("(10, 0) > get_device_capability() >= (8, 0)", evaluate.ADMITS),
        ("major >= 10 and major != 12", evaluate.EXCLUDES),
    ],
)
def test_verdicts(test: str, verdict: str) -> None:
    gate = one(f"def f():\n    if {test}:\n        return 1\n")
    assert gate.verdict == verdict


@pytest.mark.parametrize(
    "test",
    [
        "is_sm120_supported()",
        "is_sm100_supported() or is_sm120_supported()",
        "major in (9, 10, 12)",
        "major == 8",
        "major < 9",
        "is_cuda()",
        "torch_version.major >= 2",
        "num_layers == 10",
    ],
)
def test_sm120_aware_and_other_tests_are_no_gates(test: str) -> None:
    assert scan(f"def f():\n    if {test}:\n        return 1\n") == []


def test_returns_assignments_keywords_asserts_and_choices() -> None:
    found = scan(
        """
        def ok(x):
            return x and get_platform().is_sm100

        class K:
            def __init__(self, sm_major):
                self.verify = sm_major in (9, 10)
                self.tile = 128 if is_sm100_supported() else 64
                assert get_platform().is_sm90, "needs Hopper"
                run(fast=get_platform().is_sm100)
        """
    )
    assert [(g.kind, g.function, g.gates) for g in found] == [
        ("return", "ok", "returned by ok"),
        ("assign", "K.__init__", "sets self.verify"),
        ("ifexp", "K.__init__", "sets self.tile = 128"),
        ("assert", "K.__init__", "asserts: needs Hopper"),
        ("argument", "K.__init__", "argument fast= of run()"),
    ]


def test_lists_of_majors_and_compile_targets() -> None:
    found = scan(
        """
        def gen_comm_module():
            flags = ctx.get_nvcc_flags_list(supported_major_versions=[9, 10])
            return spec("comm", flags)

        def gen_other_module():
            return spec("other", ctx.get_nvcc_flags_list(supported_major_versions=[9, 10, 12]))

        SM100_FLAGS = ["-O3", "-gencode=arch=compute_100a,code=sm_100a"]
        TARGETS = ("sm_100a", "sm_120a")

        @supported_compute_capability([100, 103])
        def _requirement(a):
            return True
        """,
        file="flashinfer/jit/x.py",
    )
    assert [(g.kind, g.expression, g.arch_specific) for g in found] == [
        ("argument", "[9, 10]", ()),
        ("list", '["-O3", "-gencode=arch=compute_100a,code=sm_100a"]',
         ("-gencode=arch=compute_100a,code=sm_100a",)),
        ("decorator", "[100, 103]", ()),
    ]  # fmt: skip


def test_definitions_of_the_words_are_no_gates() -> None:
    assert (
        scan(
            """
        _is_sm100_supported = _is_cuda and is_sm100_supported()
        is_sm100_supported = lru_cache(partial(check, device_capability_majors=[10]))

        def is_sm90a_supported(device):
            major, _ = get_compute_capability(device)
            return major == 9

        class Platform:
            @property
            def is_sm100(self):
                return self.major == 10
        """
        )
        == []
    )


def test_comments_docstrings_and_strings_name_archs_without_gates() -> None:
    assert (
        scan(
            '''
        """Runs fast on is_sm100_supported() machines (major == 10)."""
        # if major == 10: the old way
        MESSAGE = "set major == 10 to try it"
        '''
        )
        == []
    )


def test_a_sibling_that_gives_sm120_a_path_is_noted() -> None:
    found = scan(
        """
        def pick():
            if get_platform().is_sm100:
                return "a"
            elif get_platform().is_sm120:
                return "b"

        def pick_again(x):
            if major == 10:
                x = "c"
            if major == 12:
                x = "d"
            return x
        """
    )
    assert [(g.line, bool(g.sibling)) for g in found] == [(3, True), (9, True)]
    assert found[0].sibling == "line 5: get_platform().is_sm120"


def test_an_sm120_twin_function_is_a_sibling() -> None:
    found = scan(
        """
        def gen_fmha_sm100a_module():
            return build(supported_major_versions=[10])

        def gen_fmha_sm120a_module():
            return build(supported_major_versions=[12])
        """
    )
    assert [g.sibling for g in found] == ["def gen_fmha_sm120a_module"]


def test_gates_sm120_never_reaches_are_left_out() -> None:
    found = scan(
        """
        def prefill_default(sm_major, cfg):
            if cfg.other or sm_major not in (9, 10):
                return None
            if sm_major == 10:
                return "x"

        def inner():
            if is_sm100_supported():
                if major == 10:
                    return 1
        """
    )
    assert [g.line for g in found] == [3, 9]


def test_a_region_that_does_not_parse_alone_sends_the_file_to_the_parser() -> None:
    # The docstring's second line at column 0 ends the def as text reads it.
    found = scan(
        '''
        def f():
            x = """
        at column 0
            """
            if is_sm100_supported():
                return x
        '''
    )
    assert [(g.line, g.function) for g in found] == [(6, "f")]


def test_class_level_statements_and_nested_defs_get_their_qualified_names() -> None:
    found = scan(
        """
        class A:
            archs = [9, 10]

            class B:
                def m(self):
                    def inner():
                        return is_sm100_supported()
                    return inner
        """
    )
    assert [(g.function, g.kind) for g in found] == [("A", "list"), ("A.B.m.inner", "return")]


def test_a_file_that_does_not_parse_is_said_so() -> None:
    found = filescan.scan_text("sglang/x.py", "if is_sm100_supported(:\n    pass\n")
    assert found.problem.startswith("does not parse")


def test_the_key_of_a_gate_survives_lines_moving() -> None:
    a = one("def f():\n    if get_platform().is_sm100:\n        return 1\n")
    b = one("\n\n# moved\ndef f():\n    if get_platform().is_sm100:  # same\n        return 1\n")
    assert a.key == b.key and a.line != b.line


# ----------------------------------------------------------------------------- classes


FAMILIES = classify.load_kernels(
    """
    schema = 1
    [[family]]
    id = "gen"
    reason = "gen kernels: SM100 cubins"
    match = ['trtllm_gen', 'gen_mla']
    [[family]]
    id = "moe"
    reason = "fused MoE cubins for SM100"
    match = ['fast_moe']
    sm120 = "cutlass_moe"
    [[family]]
    id = "hopper"
    reason = "Hopper alone"
    archs = ["sm90"]
    """
)


def cls(text: str) -> classify.Classified:
    return classify.classify(one(text), FAMILIES)


def test_a_choice_of_kernels_sm120_lacks_is_kernel_and_of_anything_else_candidate() -> None:
    assert cls("def f():\n    if is_sm100_supported():\n        b = 'gen_mla'\n").cls == "kernel"
    mixed = cls(
        "def f():\n    if is_sm100_supported():\n        b = 'gen_mla' if x else 'flashinfer'\n"
    )
    assert mixed.cls == "candidate"


def test_a_choice_with_an_sm120_counterpart_is_a_candidate_a_guard_a_kernel() -> None:
    choice = cls("def f():\n    if is_sm100_supported():\n        b = 'fast_moe'\n")
    assert choice.cls == "candidate" and "cutlass_moe" in choice.reason
    guard = cls(
        "def f(b):\n    if b == 'fast_moe' and not is_sm100_supported():\n        raise E()\n"
    )
    assert guard.cls == "kernel"


# SGLang 0.5.23's NVFP4 MoE `auto` (ModelOptNvFp4FusedMoEMethod.create_moe_runner), reduced.
AUTO_MOE = """
def create_moe_runner(self):
    backend = get_moe_runner_backend()
    if backend.is_auto():
        if is_cuda() and (8, 0) <= get_device_capability() < (10, 0):
            backend = MoeRunnerBackend.MARLIN
        else:
            backend = MoeRunnerBackend.FAST_MOE
"""


def test_a_gate_that_admits_sm120_into_a_kernel_it_cannot_run_is_a_gap_naming_it() -> None:
    gate = one(AUTO_MOE)
    assert gate.verdict == evaluate.ADMITS  # SM120 takes SM100's `else`...
    assert gate.choices == ("backend=marlin",) and gate.sm120_choices == ("backend=fast_moe",)
    found = classify.classify(gate, FAMILIES)
    # ... which ends in a kernel SM120 cannot run: a gap, not upstream's.
    assert (found.cls, found.family) == ("candidate", "moe")
    assert "SM120 goes the way sm100/sm103/sm110 goes, to backend=fast_moe" in found.reason
    assert "fused MoE cubins for SM100" in found.reason and "cutlass_moe" in found.reason
    assert classify.leaves_out(gate, FAMILIES) and not classify.leaves_out(gate)
    # SM120 taking the `if` itself, and an `x if test else y`.
    taken = cls("def f():\n    if major >= 10:\n        b = 'gen_mla'\n    return b\n")
    assert (taken.cls, taken.family) == ("candidate", "gen")
    ifexp = cls("def f():\n    return 'trtllm_gen' if is_blackwell() else 'fa3'\n")
    assert ifexp.cls == "candidate" and "to trtllm_gen" in ifexp.reason


def test_a_patch_giving_the_dead_end_an_sm120_branch_covers_it() -> None:
    """The coverage run counts a dead end as a gate to change: the profile's patch that adds
    `elif is_sm120_supported():` makes create_moe_runner's `auto` read covered."""
    from types import SimpleNamespace

    import libcst as cst

    from sm120patch.patchkit.model import Patch, already_applied, applied

    rel = "sglang/srt/layers/quantization/modelopt_quant.py"
    text = textwrap.dedent(AUTO_MOE)
    branch = (
        "        elif is_sm120_supported():\n            backend = MoeRunnerBackend.CUTLASS_MOE\n"
    )

    def transform(module: cst.Module) -> Any:
        if "is_sm120_supported" in module.code:
            return already_applied("create_moe_runner", "SM120 branch")
        new = module.code.replace("        else:\n", branch + "        else:\n")
        return applied("create_moe_runner", cst.parse_module(new), "SM120 branch")

    patch = Patch(id="t.moe-auto", target="sglang", title="t", why="w", files=(rel,),
                  marker="create_moe_runner", transform=transform)  # fmt: skip
    profile = SimpleNamespace(name="moe", targets=("sglang",), patches=[patch.id],
                              pinned=lambda kind, version: True)  # fmt: skip
    cat = SimpleNamespace(profiles={"moe": profile}, patches={patch.id: patch})
    found = run.scan_files("sglang", "0.5.23", [(rel, text.encode())], catalog=cat,
                           families=FAMILIES)  # fmt: skip
    [gate] = found.gates
    assert gate.cls == "covered" and [c.patch for c in gate.covered_by] == ["t.moe-auto"]
    # Without the kernel table the same gate reads upstream and no patch covers it.
    plain = run.scan_files("sglang", "0.5.23", [(rel, text.encode())], catalog=cat,
                           families=())  # fmt: skip
    assert [x.cls for x in plain.gates] == ["upstream"]


@pytest.mark.parametrize(
    "text",
    [
        # an SM120 branch of its own (what a patch writes): no gate there any more
        AUTO_MOE.replace(
            "        else:",
            "        elif is_sm120_supported():\n"
            "            backend = MoeRunnerBackend.CUTLASS_MOE\n        else:",
        ),
        # a path to something SM120 runs, or to a value no family knows
        AUTO_MOE.replace("FAST_MOE", "CUTLASS_MOE"),
        AUTO_MOE.replace("MoeRunnerBackend.FAST_MOE", "pick(x)"),
        # the path depends on more than the GPU
        AUTO_MOE.replace(
            "        else:", "        elif other:\n            backend = 'x'\n        else:"
        ),
        # a family read off names names no value ("sm100", a plan table's name)
        "def f(major):\n    if major >= 10:\n        return 'sm100_tile'\n    return 'x'\n",
    ],
)
def test_a_path_sm120_runs_or_one_the_gpu_alone_does_not_decide_is_no_gap(text: str) -> None:
    families = (*FAMILIES, *classify.load_kernels(
        'schema = 1\n[[family]]\nid = "t"\nreason = "r"\nmatch = ["_tile"]\nwhere = "names"\n'
    ))  # fmt: skip
    for gate in scan(text):
        found = classify.classify(gate, families)
        assert found.cls != "candidate", (gate.expression, found.reason)


def test_the_comment_above_a_test_and_its_message_name_the_kernel() -> None:
    shipped = classify.load_kernels()
    said = """
    def init(self):
        # This kernel uses tcgen05 + TMEM: datacenter Blackwell only.
        self.fast = get_device_capability()[0] == 10
    """
    found = classify.classify(one(said), shipped)
    assert (found.cls, found.family) == ("kernel", "tcgen05")
    unsaid = said.replace("# This kernel uses tcgen05 + TMEM: datacenter Blackwell only.", "x = 1")
    assert classify.classify(one(unsaid), shipped).cls == "candidate"
    refusal = """
    def init(major):
        if major != 9:
            raise ValueError("hpc_ops needs Hopper (the kernels ship sm90a only)")
    """
    found = classify.classify(one(refusal), shipped)
    assert (found.cls, found.family) == ("kernel", "built-for-an-arch")
    plain = refusal.replace("(the kernels ship sm90a only)", "for now")
    assert classify.classify(one(plain), shipped).cls == "candidate"


def test_classes_from_the_verdict_the_sibling_and_the_arch() -> None:
    assert cls("def f():\n    if major >= 10:\n        return 1\n").cls == "upstream"
    assert cls("def f():\n    if major != 12 and major >= 10:\n        return 1\n").cls == "kernel"
    assert cls("def f():\n    if is_sm90_supported():\n        use_x()\n").cls == "kernel"
    assert cls("X = ['sm_100a']\n").cls == "kernel"
    sibling = cls(
        "def f():\n    if is_sm100():\n        return 1\n    if is_sm120():\n        return 2\n"
    )
    assert sibling.cls == "upstream" and "line 4" in sibling.reason


def test_what_the_release_itself_refuses_on_sm120_is_kernel() -> None:
    text = textwrap.dedent(
        """
        class Args:
            def defaults(self):
                if is_sm100_supported():
                    self.attention_backend = "fast"
                if is_sm100_supported():
                    self.moe_backend = "fast"

            def check(self):
                if self.attention_backend == "fast":
                    if not is_sm100_supported():
                        raise ValueError("fast needs SM100")
                if self.moe_backend == "fast" and self.nodes > 1 and not is_sm100_supported():
                    raise ValueError("fast across nodes needs SM100")
        """
    )
    found = filescan.scan_text("sglang/srt/server_args.py", text).gates
    refused = classify.required(found)
    assert list(refused) == ["attention_backend=fast"]  # the other check has a condition more
    classes = [classify.classify(x, FAMILIES, (), refused) for x in found]
    assert [(x.gate.line, x.cls) for x in classes] == [
        (4, "kernel"),
        (6, "candidate"),
        (11, "candidate"),
        (13, "candidate"),
    ]
    assert "this release refuses attention_backend=fast on SM120" in classes[0].reason
    assert "server_args.py:11" in classes[0].reason


def test_the_labelled_sample_is_large_honest_in_shape_and_holds_a_floor_per_class() -> None:
    """tests/data/scan_labels.toml (measured in tests/real/test_scan_real.py): at least 60
    gates of both targets, each with its label and the reason for it."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    doc = tomllib.loads((Path(__file__).parent / "data" / "scan_labels.toml").read_text())
    gates = doc["gate"]
    assert len(gates) >= 60 and {g["target"] for g in gates} == {"sglang", "flashinfer"}
    assert {(g["target"], g["version"]) for g in gates} == {
        ("sglang", "0.5.23"),
        ("flashinfer", "0.7.4"),
    }
    assert {g["label"] for g in gates} <= {*classify.CLASSES, "no-gate"}
    assert all(len(g["reason"]) > 20 and g["expression"] and g["function"] for g in gates)
    idents = {
        (g["file"], g["function"], g["kind"], g["expression"], g["occurrence"]) for g in gates
    }
    assert len(idents) == len(gates)
    assert set(doc["precision"]) == set(classify.CLASSES)
    assert all(0 < v <= 1 for v in doc["precision"].values())


def test_the_shipped_kernel_table_loads() -> None:
    families = classify.load_kernels()
    assert {"trtllm-gen", "fa3", "capability-declaration"} <= {f.id for f in families}
    assert all(f.reason and (f.match or f.archs or f.paths) for f in families)


# ----------------------------------------------------------------------------- a target


@pytest.fixture
def sglang_tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path, "sglang", "0.5.8", "installed")


@pytest.fixture
def flashinfer_tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path, "flashinfer", "0.6.8", "installed")


def test_covered_sites_come_from_the_profiles_own_patches(sglang_tree: Path) -> None:
    from sm120patch.targets import finding

    found = run.scan_target(finding.find("sglang", sglang_tree))
    covered = {(x.gate.function, c.patch) for x in found.of("covered") for c in x.covered_by}
    assert covered == {
        ("apply_flashinfer_allreduce_fusion", "sglang.fusion-gate"),
        ("ServerArgs._handle_model_specific_adjustments", "sglang.fusion-autoenable"),
        ("ServerArgs._handle_model_specific_adjustments", "sglang.moe-backend"),
        # the fixture's Qwen3 MoE branch is SM100-only too: the moe profile's second patch
        ("ServerArgs._handle_model_specific_adjustments", "sglang.moe-backend-qwen3"),
    }
    profiles = {c.profile for x in found.of("covered") for c in x.covered_by}
    assert profiles == {"fusion", "moe", "all"}
    assert all(c.outcome == "applied" and c.pinned for x in found.gates for c in x.covered_by)


def test_cli_text_json_and_the_exit_code(sglang_tree: Path, flashinfer_tree: Path) -> None:
    args = ["scan", "--sglang", str(sglang_tree), "--flashinfer", str(flashinfer_tree)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # Candidates first: FlashInfer's other comm module keeps [9, 10].
    assert "candidate (1)" in lines
    cand = lines.index("candidate (1)")
    assert "gen_vllm_comm_module" in lines[cand + 1]
    assert lines[cand + 2].strip() == "argument [9, 10]"
    assert lines[-1] == "summary: 1 candidate, 5 covered, 0 upstream, 0 kernel"
    failing = CliRunner().invoke(main, [*args, "--fail-on-candidate"])
    assert failing.exit_code == 1
    doc = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert doc["counts"] == {"candidate": 1, "covered": 5, "upstream": 0, "kernel": 0}
    gate = next(g for t in doc["targets"] for g in t["gates"] if g["class"] == "candidate")
    assert (gate["file"], gate["function"]) == ("flashinfer/jit/comm.py", "gen_vllm_comm_module")


def test_known_candidates_are_not_new(
    sglang_tree: Path, flashinfer_tree: Path, tmp_path: Path
) -> None:
    args = ["scan", "--sglang", str(sglang_tree), "--flashinfer", str(flashinfer_tree)]
    baseline = tmp_path / "known.json"
    baseline.write_text(CliRunner().invoke(main, [*args, "--json"]).output)
    again = CliRunner().invoke(main, [*args, "--known", str(baseline), "--fail-on-candidate"])
    assert again.exit_code == 0, again.output
    assert "(known)" in again.output
    assert again.output.splitlines()[-1].endswith("(0 candidates not known before)")
    # A new candidate in the next release: the same comm list in another module.
    comm = flashinfer_tree / "flashinfer" / "jit" / "comm.py"
    comm.write_text(
        comm.read_text()
        + (
            "\n\ndef gen_nvshmem_module():\n"
            "    return spec(ctx.get_nvcc_flags_list(supported_major_versions=[10]))\n"
        )
    )
    failing = CliRunner().invoke(main, [*args, "--known", str(baseline), "--fail-on-candidate"])
    assert failing.exit_code == 1
    doc = json.loads(CliRunner().invoke(main, [*args, "--known", str(baseline), "--json"]).output)
    assert doc["new_candidates"] == 1
    new = [g for t in doc["targets"] for g in t["gates"] if g.get("known") is False]
    assert [g["function"] for g in new] == ["gen_nvshmem_module"]
    bad = CliRunner().invoke(main, [*args, "--known", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and "--known" in bad.output


def test_a_patched_tree_says_what_is_already_applied(
    sglang_tree: Path, flashinfer_tree: Path
) -> None:
    where = {"sglang": str(sglang_tree), "flashinfer": str(flashinfer_tree)}
    args = [f"--{k}={v}" for k, v in where.items()]
    result = CliRunner().invoke(main, ["apply", "fusion", *args, "--no-gpu-check"])
    assert result.exit_code == 0, result.output
    found = run.scan(where)
    t = found.targets[0]
    assert {o.patch for o in t.already_applied()} >= {"sglang.fusion-gate"}
    assert not any(x.gate.function == "apply_flashinfer_allreduce_fusion" for x in t.gates)
    assert "already applied here: sglang.fusion-gate" in report.text(found)


def test_skipped_paths() -> None:
    assert run.skipped("flashinfer/data/csrc/x.py")
    assert run.skipped("sglang/test/runners.py")
    assert not run.skipped("sglang/srt/layers/x.py")
    assert run.skipped("sglang/srt/layers/test_x.py")


def test_the_target_is_read_never_imported(tmp_path: Path) -> None:
    import subprocess
    import sys

    tree = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    (tree / "sglang" / "__init__.py").write_text("raise SystemExit('imported')\n")
    probe = (
        "import sys; from sm120patch.scan import run; "
        f"found = run.scan({{'sglang': {str(tree)!r}}}); "
        "assert found.targets[0].gates; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'flashinfer')))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_only_the_kinds_given_are_scanned(sglang_tree: Path) -> None:
    found = run.scan({"sglang": str(sglang_tree), "flashinfer": None})
    assert [t.kind for t in found.targets] == ["sglang"]
