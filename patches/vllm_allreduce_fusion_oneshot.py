"""vllm.allreduce-fusion-oneshot: an SM120 row, world size 2 only, in vLLM's one-shot size table.

`_select_flashinfer_allreduce_use_oneshot` (vllm/compilation/passes/fusion/allreduce_rms_fusion.py)
looks the capability up in `_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB` and, for a capability with no row,
returns True for every tensor: with `vllm.allreduce-fusion-size` letting SM120 fuse up to 64 MB at
TP2, tensors between 32 and 64 MB would then be forced one-shot, past the limit the table's own
comment gives ("OneShot max size is at most 64MB / world size (FlashInfer restriction)"). This
patch adds `120: {2: <the SM90 row's world-size-2 value>}` (32 MB in every row of every pinned
release), so larger tensors take the two-shot kernel as on every other GPU. Inferred, not measured.
"""

from __future__ import annotations

import ast

import libcst as cst

from sm120patch.patchkit import sitecheck as sc
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Result, Sought, Status

from .vllm_allreduce_fusion_size import FUSION, FUSION_WIRING, WORLD, table_transform
from .vllm_allreduce_fusion_size import check as table_check

TABLE = "_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB"
COMMENT = f"# sm120patch vllm.allreduce-fusion-oneshot: SM120, TP{WORLD} only (SM90's value)"

FACTS = (
    Fact(releases=">=0.30.0,<0.35", status=Status.APPLIED,
         shape=f"`{TABLE}: dict[int, dict[int, float]] = {{90: ..., 100: ..., 103: ..., "
         "107: ...}`, one row per line, no 120 row; world size 2 is 32 MB in every row; a "
         "missing row makes `_select_flashinfer_allreduce_use_oneshot` return True",
         file=FUSION, form=TABLE, source="real files"),
)


def transform(module: cst.Module) -> Result:
    return table_transform(module, TABLE, COMMENT)


def check(before: ast.Module, after: ast.Module, fact: Fact) -> sc.Spans:
    """`_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB` gains `120: {2: 32}` (row 90's world-size-2 value)
    as its last row, and nothing else in the file changes: the size table's check, which reads
    the table named by the fact's form."""
    return table_check(before, after, fact)


PATCH = Patch(
    id="vllm.allreduce-fusion-oneshot",
    check=check,
    target="vllm",
    title="An SM120 row (TP2 only) in vLLM's FlashInfer one-shot allreduce size table",
    why=(
        "vLLM picks FlashInfer's one-shot or two-shot fused allreduce by "
        "_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB, keyed by capability; for a capability without a "
        "row it asks for one-shot at every size. With the SM120 size row of "
        "vllm.allreduce-fusion-size (64 MB at TP2), tensors above 32 MB would be forced "
        "one-shot, past the limit the table's comment states ('OneShot max size is at most "
        "64MB / world size (FlashInfer restriction)'). The patch adds `120: {2: 32}`, the SM90 "
        "row's world-size-2 value, the same in every row of every pinned release: inferred, "
        "not measured on SM120 (no public source gives SM120 sizes)."
    ),
    marker=TABLE,
    transform=transform,
    facts=FACTS,
    upstream="https://github.com/vllm-project/vllm/pull/49647 (the same kind of row, for SM107)",
    sought=Sought(TABLE, (TABLE,)),
    wiring=FUSION_WIRING,
)
