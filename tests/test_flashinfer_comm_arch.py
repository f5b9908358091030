from __future__ import annotations

import textwrap

from patches_under_test import load_patch

from sm120patch.patchkit.model import Status

PATCH = load_patch("flashinfer.comm-arch")

BEFORE = '''
def gen_vllm_comm_module() -> JitSpec:
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10]
    )
    return gen_jit_spec("vllm_comm", [], extra_cuda_cflags=nvcc_flags)


def gen_trtllm_comm_module() -> JitSpec:
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10]
    )
    return gen_jit_spec("trtllm_comm", [], extra_cuda_cflags=nvcc_flags)
'''

AFTER = BEFORE.replace(
    '''gen_trtllm_comm_module() -> JitSpec:
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10]''',
    '''gen_trtllm_comm_module() -> JitSpec:
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10, 12]''',
)


def test_applies_to_trtllm_module_only(run_patch):
    res = run_patch(PATCH, BEFORE)
    assert [o.status for o in res.outcomes] == [Status.APPLIED]
    assert res.after == textwrap.dedent(AFTER)
    # The sibling module keeps its list.
    assert res.after.count("[9, 10]\n") == 1


def test_second_run_is_already_applied(run_patch):
    first = run_patch(PATCH, BEFORE)
    second = run_patch(PATCH, first.after)
    assert [o.status for o in second.outcomes] == [Status.ALREADY_APPLIED]
    assert second.after == first.after


def test_missing_function_is_not_applicable(run_patch):
    res = run_patch(PATCH, "def gen_vllm_comm_module():\n    return 1\n")
    assert res.outcomes[0].status is Status.NOT_APPLICABLE
    assert not res.changed


def test_refuses_twice_defined(run_patch):
    twice = BEFORE + BEFORE.split("\n\n\n")[1]
    res = run_patch(PATCH, twice)
    assert res.outcomes[0].status is Status.REFUSED
    assert "2 definitions" in res.outcomes[0].reason
    assert not res.changed


def test_refuses_changed_list(run_patch):
    res = run_patch(PATCH, BEFORE.replace("[9, 10]\n    )\n    return gen_jit_spec(\"trtllm", "[8, 9]\n    )\n    return gen_jit_spec(\"trtllm"))
    assert res.outcomes[0].status is Status.REFUSED
    assert "supported_major_versions=[8, 9]" in res.outcomes[0].reason
    assert "gen_trtllm_comm_module" in res.outcomes[0].site


def test_refuses_non_literal(run_patch):
    src = BEFORE.replace("gen_trtllm_comm_module() -> JitSpec:\n    nvcc_flags = current_compilation_context.get_nvcc_flags_list(\n        supported_major_versions=[9, 10]",
                         "gen_trtllm_comm_module() -> JitSpec:\n    nvcc_flags = current_compilation_context.get_nvcc_flags_list(\n        supported_major_versions=MAJORS")
    res = run_patch(PATCH, src)
    assert res.outcomes[0].status is Status.REFUSED


def test_one_line_list_keeps_spacing(run_patch):
    res = run_patch(PATCH, "def gen_trtllm_comm_module():\n    f(supported_major_versions=[9,10])\n")
    assert res.after == "def gen_trtllm_comm_module():\n    f(supported_major_versions=[9,10,12])\n"
