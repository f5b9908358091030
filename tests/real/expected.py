"""What each patch must do on each real release: the facts of DESIGN.md s4, as a table.

Every fact names the releases it covers (a PEP 440 specifier on the release, so 0.5.9.post1
counts as 0.5.9), the outcome, the file holding the site (relative to the package's parent) and
the function around it. `source` says where the fact comes from: "DESIGN s4 <site>" when the
design states it, "real files" when DESIGN is silent on that detail and it was read off the
released files (the file and function names of most sites, confirmed on SGLang 0.5.2..0.5.23
and FlashInfer 0.3.1, 0.6.1, 0.6.15, 0.6.17, 0.7.4). A release no fact covers has no recorded
expectation: its outcome is reported (tests/real, benchmarks/compat_table.py) but not judged.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sm120patch.transform import Status

A, U, N, R = Status.APPLIED, Status.UPSTREAM, Status.NOT_APPLICABLE, Status.REFUSED

COMMUNICATOR = "sglang/srt/layers/communicator.py"
ADD_NORM = "sglang/srt/layers/layer_boundary/residual/add_norm.py"
SERVER_ARGS = "sglang/srt/server_args.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
GLM4_MOE = "sglang/srt/arg_groups/model_overrides/glm4_moe.py"
COMM_FUSION = "sglang/srt/layers/flashinfer_comm_fusion.py"
FI_TRTLLM_AR = "flashinfer/comm/trtllm_ar.py"
FI_JIT_COMM = "flashinfer/jit/comm.py"


@dataclass(frozen=True)
class Fact:
    patch: str
    releases: str  # PEP 440 specifier on the release
    status: Status
    file: str | None = None  # None: no file to name (the site is absent)
    function: str | None = None  # qualified name of the function holding the site
    form: str = ""  # the shape of the code at the site, where the checks depend on it
    source: str = "DESIGN s4"
    note: str = ""

    def covers(self, version: str) -> bool:
        release = Version(Version(version).base_version)
        return SpecifierSet(self.releases).contains(release, prereleases=True)


FACTS: tuple[Fact, ...] = (
    # --- A. the SM120 module flag, next to the SM100 one.
    Fact("sglang.sm120-flag", ">=0.5.2,<0.5.4", R, COMMUNICATOR, None, "import",
         "DESIGN s4 A", note="the import it adds does not exist before 0.5.4: the planner "
         "refuses every patch of the file"),
    Fact("sglang.sm120-flag", ">=0.5.4,<0.5.19", A, COMMUNICATOR, None, "import",
         "DESIGN s4 A"),
    Fact("sglang.sm120-flag", ">=0.5.19,<0.5.21", A, COMMUNICATOR, None, "platform",
         "DESIGN s4 A"),
    Fact("sglang.sm120-flag", ">=0.5.21,<0.5.24", A, ADD_NORM, None, "platform", "DESIGN s4 A"),
    # --- B. the runtime allreduce-fusion gate.
    Fact("sglang.fusion-gate", ">=0.5.2,<0.5.4", R, COMMUNICATOR,
         "CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual",
         source="DESIGN s4 A", note="refused with the flag patch of the same file"),
    Fact("sglang.fusion-gate", ">=0.5.4,<0.5.8", A, COMMUNICATOR,
         "CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual",
         source="DESIGN s4 B"),
    Fact("sglang.fusion-gate", ">=0.5.8,<0.5.21", A, COMMUNICATOR,
         "apply_flashinfer_allreduce_fusion", source="DESIGN s4 B"),
    Fact("sglang.fusion-gate", "==0.5.21", A, ADD_NORM, "apply_flashinfer_allreduce_fusion",
         source="DESIGN s4 B"),
    Fact("sglang.fusion-gate", ">=0.5.22,<0.5.24", A, ADD_NORM, "flashinfer_ar_fusion_applies",
         source="DESIGN s4 B"),
    # --- C. auto-enable of fusion in the server arguments.
    Fact("sglang.fusion-autoenable", "==0.5.4", A, SERVER_ARGS,
         "ServerArgs._handle_model_specific_adjustments", "bare", "real files",
         note="DESIGN is silent on 0.5.4. Its GptOss block gates on a bare `if "
              "is_sm100_supported():`, the test 0.5.5 widened upstream to "
              "is_blackwell_supported(); widening it the same way is the 0.5.5 behaviour. The "
              "DeepseekV3 block (`is_cuda() and is_sm100_supported()`) also picks SM100-only "
              "trtllm_mla attention and stays as it is."),
    Fact("sglang.fusion-autoenable", ">=0.5.5,<0.5.8", U, SERVER_ARGS,
         source="DESIGN s4 C",
         note="is_blackwell_supported() (majors 10 and 12) already covers SM120"),
    Fact("sglang.fusion-autoenable", ">=0.5.8,<0.5.15", A, SERVER_ARGS,
         "ServerArgs._handle_model_specific_adjustments", "utils", "DESIGN s4 C"),
    Fact("sglang.fusion-autoenable", ">=0.5.15,<0.5.19", A, OVERRIDES,
         "_flashinfer_allreduce_fusion_auto_enable", "utils", "DESIGN s4 C"),
    Fact("sglang.fusion-autoenable", ">=0.5.19,<0.5.24", A, OVERRIDES,
         "_flashinfer_allreduce_fusion_auto_enable", "platform", "DESIGN s4 C"),
    # --- X. the backend resolution that raises on anything but SM90/SM10X.
    Fact("sglang.fusion-backend", "<0.5.14", N, source="DESIGN s4 X",
         note="_resolve_backend exists from 0.5.14 on"),
    Fact("sglang.fusion-backend", ">=0.5.14,<0.5.19", A, COMM_FUSION, "_resolve_backend",
         "utils", "DESIGN s4 X"),
    Fact("sglang.fusion-backend", ">=0.5.19,<0.5.24", A, COMM_FUSION, "_resolve_backend",
         "platform", "DESIGN s4 X"),
    # --- D. the MoE runner backend for Glm4MoeForCausalLM.
    Fact("sglang.moe-backend", "<0.5.8", N, source="DESIGN s4 D",
         note="no Glm4MoeForCausalLM branch before 0.5.8"),
    Fact("sglang.moe-backend", ">=0.5.8,<0.5.15", A, SERVER_ARGS,
         "ServerArgs._handle_model_specific_adjustments", "utils", "DESIGN s4 D"),
    Fact("sglang.moe-backend", ">=0.5.15,<0.5.19", A, OVERRIDES, "_glm4_moe_overrides", "utils",
         "DESIGN s4 D",
         note="server_args.py keeps an empty `elif model_arch in [\"Glm4MoeForCausalLM\"]: pass` "
              "pointing at overrides.py (real files): the site is in overrides.py"),
    Fact("sglang.moe-backend", ">=0.5.19,<0.5.24", A, GLM4_MOE, "_glm4_moe_overrides",
         "platform", "DESIGN s4 D"),
    # --- F. FlashInfer's TRT-LLM comm module arch list.
    Fact("flashinfer.comm-arch", ">=0.3.1,<0.4.0", A, FI_TRTLLM_AR, "gen_trtllm_comm_module",
         source="DESIGN s4 F"),
    Fact("flashinfer.comm-arch", ">=0.4.0,<0.6.16", A, FI_JIT_COMM, "gen_trtllm_comm_module",
         source="DESIGN s4 F"),
    Fact("flashinfer.comm-arch", "==0.6.16", A, FI_JIT_COMM, "gen_trtllm_comm_module",
         source="real files",
         note="DESIGN names 0.4.0 to 0.6.15 and 0.6.17 on; 0.6.16 still passes [9, 10]"),
    Fact("flashinfer.comm-arch", ">=0.6.17", U, FI_JIT_COMM, "gen_trtllm_comm_module",
         source="DESIGN s4 F"),
)

# Details DESIGN does not state, read off the released files (kept here so a reader of a
# failing test knows which facts are the design's and which were observed):
OBSERVED = (
    "SGLang 0.5.21 to 0.5.23 no longer ship sglang/srt/layers/communicator.py: flags and gate "
    "live only in add_norm.py.",
    "The auto-enable block (site C) is in ServerArgs._handle_model_specific_adjustments in "
    "0.5.7 to 0.5.14; the Glm4MoeForCausalLM branch (site D) too, in 0.5.8 to 0.5.14.",
    "SGLang 0.5.4 has no unified auto-enable block: only per-model blocks gated on "
    "is_sm100_supported() (DeepseekV3 with is_cuda(), GptOss bare); DESIGN records no outcome "
    "for it (see the 0.5.4 fact).",
    "SGLang 0.5.2 and 0.5.3 define no is_sm120_supported (utils/common.py defines it from "
    "0.5.4); DESIGN records no sm120-flag outcome for them.",
    "is_sm120_supported is imported in arg_groups/overrides.py in 0.5.15 to 0.5.18, and in "
    "server_args.py from 0.5.4 to 0.5.18.",
    "FlashInfer 0.3.1 ships only flashinfer/comm/trtllm_ar.py; 0.4.0 also keeps "
    "comm/trtllm_ar.py but defines gen_trtllm_comm_module in jit/comm.py.",
    "FlashInfer 0.6.16 still passes [9, 10] to gen_trtllm_comm_module (applied, like 0.6.15).",
    "FlashInfer 0.2.8 to 0.3.0 have no supported_major_versions list in gen_trtllm_comm_module "
    "(0.2.8 reads the device capability, 0.3.0 filters _get_cuda_arch_flags() for SM100): a "
    "shape the patch does not know, outside the pins; no fact recorded.",
    "SGLang 0.4.6 has none of the site files; 0.4.7 to 0.5.1 import is_sm100_supported from "
    "sglang.srt.layers.utils and gate on `_is_sm100_supported` alone: outside every pin; no "
    "fact recorded.",
    "FlashInfer 0.6.15 to 0.7.4 keep [9, 10] for gen_trtllm_mnnvl_comm_module and "
    "gen_mixed_comm_module and [9, 10, 11, 12] for another module; only "
    "gen_trtllm_comm_module differs between 0.6.15 ([9, 10]) and 0.6.17 ([9, 10, 12]).",
)


def fact(patch_id: str, version: str) -> Fact | None:
    """The fact covering `patch_id` on `version`, or None where nothing is recorded."""
    hits = [f for f in FACTS if f.patch == patch_id and f.covers(version)]
    if len(hits) > 1:
        raise AssertionError(f"overlapping facts for {patch_id} {version}: {hits}")
    return hits[0] if hits else None
