"""vllm.allreduce-fusion-size and vllm.allreduce-fusion-oneshot on a fixture in the shape of
vLLM 0.30-0.34's allreduce_rms_fusion.py (both tables, one row and one entry per line),
before/after; refusals, upstream, already-applied; and the looked-up sizes and the one-shot
choice run on the patched tables for SM120, SM100 and SM90."""

from __future__ import annotations

import textwrap

import pytest
from patches_under_test import load_patch

from sm120patch.patchkit.model import Status
from sm120patch.patchkit.runner import transform_text

SIZE = load_patch("vllm.allreduce-fusion-size")
ONESHOT = load_patch("vllm.allreduce-fusion-oneshot")

TABLES = '''
FI_ALLREDUCE_FUSION_MAX_SIZE_MB: dict[int, dict[int, float]] = {
    90: {
        2: 64,  # 64MB
        4: 2,  # 2MB
        8: 0.5,  # 0.5MB
    },
    100: {
        2: 64,  # 64MB
        4: 32,  # 32MB
        8: 1,  # 1MB
        16: 64,  # 64MB (mnnvl multi-node)
    },
}

# OneShot max size is at most 64MB / world size (FlashInfer restriction)
_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB: dict[int, dict[int, float]] = {
    90: {
        2: 32,  # 32MB
        4: 2,  # 2MB
        8: 0.5,  # 0.5MB
    },
    100: {
        2: 32,  # 32MB
        4: 4,  # 4MB
        8: 1,  # 1MB
    },
}

MiB = 1024 * 1024


def _select_flashinfer_allreduce_use_oneshot(
    workspace_backend, device_capability, world_size, current_tensor_size
):
    if workspace_backend == "mnnvl":
        return None
    if device_capability is None:
        max_one_shot_size = None
    else:
        max_one_shot_size = _FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB.get(
            device_capability, {}
        ).get(world_size)
    return max_one_shot_size is None or current_tensor_size <= max_one_shot_size * MiB
'''

SIZE_ROW = '''        16: 64,  # 64MB (mnnvl multi-node)
    },
    # sm120patch vllm.allreduce-fusion-size: SM120, TP2 only (SM90's value, inferred)
    120: {
        2: 64,  # 64MB
    },
}
'''

ONESHOT_ROW = '''        8: 1,  # 1MB
    },
    # sm120patch vllm.allreduce-fusion-oneshot: SM120, TP2 only (SM90's value)
    120: {
        2: 32,  # 32MB
    },
}
'''


def one(res):
    [outcome] = res.outcomes
    return outcome


def both(text: str):
    """The profile's two table patches on one file, as the planner runs them (one parse)."""
    return transform_text([SIZE, ONESHOT], "allreduce_rms_fusion.py", textwrap.dedent(text))


def test_exact_diff_both_tables():
    res = both(TABLES)
    assert [o.status for o in res.outcomes] == [Status.APPLIED, Status.APPLIED], [
        o.describe() for o in res.outcomes
    ]
    want = textwrap.dedent(TABLES).replace(
        "        16: 64,  # 64MB (mnnvl multi-node)\n    },\n}\n", SIZE_ROW, 1
    ).replace("        8: 1,  # 1MB\n    },\n}\n", ONESHOT_ROW, 1)
    assert res.after == want
    again = both(res.after)
    assert [o.status for o in again.outcomes] == [Status.ALREADY_APPLIED] * 2
    assert again.after == res.after


@pytest.mark.parametrize("patch", [SIZE, ONESHOT], ids=lambda p: p.id)
def test_each_alone_touches_its_table_only(run_patch, patch):
    res = run_patch(patch, TABLES)
    assert one(res).status is Status.APPLIED, one(res).describe()
    added = [line for line in res.after.splitlines() if line not in res.before.splitlines()]
    assert added[0].startswith(f"    # sm120patch {patch.id}:") and added[1] == "    120: {"
    assert len(added) == 2  # `2: ...` and `},` lines exist in the release's rows already


def test_crlf_kept():
    res = both(textwrap.dedent(TABLES).replace("\n", "\r\n"))
    assert [o.status for o in res.outcomes] == [Status.APPLIED] * 2
    assert res.after.count("\n") == res.after.count("\r\n")


@pytest.mark.parametrize(
    ("edit", "status", "found"),
    [
        # one line per table: a layout the patch does not write rows into
        (lambda s: s.replace(
            "{\n    90: {\n        2: 64,  # 64MB\n        4: 2,  # 2MB\n        8: 0.5,  # 0.5MB\n"
            "    },\n    100: {\n        2: 64,  # 64MB\n        4: 32,  # 32MB\n        8: 1,  # 1MB\n"
            "        16: 64,  # 64MB (mnnvl multi-node)\n    },\n}",
            "{90: {2: 64, 4: 2, 8: 0.5}, 100: {2: 64, 4: 32, 8: 1, 16: 64}}"),
         Status.REFUSED, "one row and one entry per line"),
        (lambda s: s.replace("    90: {\n        2: 64,  # 64MB\n", "    90: {\n"),
         Status.REFUSED, "a 90 row with a world-size-2 entry"),
        (lambda s: s.replace("    90: {\n        2: 64,", "    89: {\n        2: 64,"),
         Status.REFUSED, "no 90 row"),
        (lambda s: s + "\nFI_ALLREDUCE_FUSION_MAX_SIZE_MB = {}\n", Status.REFUSED, "2 assignments"),
        (lambda s: s.replace("FI_ALLREDUCE_FUSION_MAX_SIZE_MB: dict[int, dict[int, float]] = {",
                             "FI_ALLREDUCE_FUSION_MAX_SIZE_MB = _load()\n_RAW = {"),
         Status.REFUSED, "a dict literal"),
        (lambda s: s.replace("    100: {\n        2: 64,", "    'x': {\n        2: 64,"),
         Status.REFUSED, "rows `<capability int>"),
        (lambda s: s.replace("FI_ALLREDUCE_FUSION_MAX_SIZE_MB", "OTHER_TABLE"),
         Status.NOT_APPLICABLE, "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"),
        # a release with its own SM120 row: upstream's numbers, nothing to add
        (lambda s: s.replace("        16: 64,  # 64MB (mnnvl multi-node)\n    },\n}",
                             "        16: 64,  # 64MB (mnnvl multi-node)\n    },\n"
                             "    120: {\n        2: 16,\n        4: 8,\n    },\n}"),
         Status.UPSTREAM, "its own SM120 row"),
    ],
    ids=["one-line", "no-tp2-in-90", "no-90-row", "two-tables", "not-a-dict", "string-key",
         "absent", "upstream-row"],
)
def test_refusals_and_upstream(run_patch, edit, status, found):
    res = run_patch(SIZE, edit(textwrap.dedent(TABLES)))
    assert one(res).status is status and found in one(res).reason, one(res).describe()
    assert res.after == res.before


def _tables(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "allreduce_rms_fusion.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize(
    ("cap", "world", "pristine", "patched"),
    [
        (120, 2, None, 64),  # the point: SM120 gets a size at TP2
        (120, 4, None, None),  # and only there: TP4 stays off (reported regression)
        (120, 8, None, None),
        (121, 2, None, None),  # SM121: not added
        (100, 2, 64, 64),
        (90, 4, 2, 2),
    ],
)
def test_looked_up_size(cap, world, pristine, patched):
    """What `PassConfig.default_fi_allreduce_fusion_max_size_mb().get(world)` returns."""
    before = _tables(textwrap.dedent(TABLES))["FI_ALLREDUCE_FUSION_MAX_SIZE_MB"]
    after = _tables(both(TABLES).after)["FI_ALLREDUCE_FUSION_MAX_SIZE_MB"]
    assert before.get(cap, {}).get(world) == pristine
    assert after.get(cap, {}).get(world) == patched


@pytest.mark.parametrize(
    ("cap", "mib", "pristine", "patched"),
    [
        (120, 1, True, True),
        (120, 40, True, False),  # past 64 MB / world size: two-shot once the row is there
        (90, 40, False, False),
        (100, 8, True, True),
    ],
)
def test_oneshot_choice_at_tp2(cap, mib, pristine, patched):
    choose_before = _tables(textwrap.dedent(TABLES))["_select_flashinfer_allreduce_use_oneshot"]
    choose_after = _tables(both(TABLES).after)["_select_flashinfer_allreduce_use_oneshot"]
    size = mib * 1024 * 1024
    assert choose_before("trtllm", cap, 2, size) is pristine
    assert choose_after("trtllm", cap, 2, size) is patched
    assert choose_after("mnnvl", cap, 2, size) is None  # MNNVL sizes itself: untouched


def test_profile_is_experimental_tp2_and_refuses_old_flashinfer():
    from packaging.version import Version

    from sm120patch.plan import catalog

    prof = catalog.load().profile("vllm-allreduce-fusion")
    assert prof.status == "experimental"
    assert prof.patches == (
        "vllm.allreduce-fusion-gate", "vllm.allreduce-fusion-size",
        "vllm.allreduce-fusion-oneshot",
    )
    [refusal] = prof.refuse
    assert refusal.kind.value == "flashinfer"
    assert Version("0.6.16.post4") in refusal.releases and Version("0.6.17") not in refusal.releases
    assert "pull/3903" in prof.known and "provisional" in prof.known and "TP4" in prof.known
