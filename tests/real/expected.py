"""What each patch must do on each real release: the patches' facts, as a table.

The facts live with the patches (`FACTS` in each module under patches/, see sm120patch.patchkit.facts);
this module gathers them for the real-release tier. Every fact names the releases it covers (a
PEP 440 specifier on the release, so 0.5.9.post1 counts as 0.5.9), the outcome, the file holding
the site (relative to the package's parent) and the function around it. `source` says where the
fact comes from: the released files it was read off (the site letters are those of
docs/compatibility.md).

A release no fact covers has no recorded expectation. Outside every pin of the profiles holding
the patch its outcome is reported but not judged; inside one, `judged` fails the test: a patch
cannot pass the real tier on missing facts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog
from sm120patch.plan.catalog import Profile

__all__ = ["FACTS", "OBSERVED", "Fact", "Status", "fact", "judged", "pinned_by"]

FACTS: tuple[Fact, ...] = tuple(f for p in catalog.load().patches.values() for f in p.facts)


# Details read off the released files that no fact states on its own (kept here so a reader of
# a failing test knows them):
OBSERVED = (
    "SGLang 0.5.21 to 0.5.23 no longer ship sglang/srt/layers/communicator.py: flags and gate "
    "live only in add_norm.py.",
    "The auto-enable block (site C) is in ServerArgs._handle_model_specific_adjustments in "
    "0.5.7 to 0.5.14; the Glm4MoeForCausalLM branch (site D) too, in 0.5.8 to 0.5.14.",
    "SGLang 0.5.4 has no unified auto-enable block: only per-model blocks gated on "
    "is_sm100_supported() (DeepseekV3 with is_cuda(), GptOss bare); no fact records an outcome "
    "for it (see the 0.5.4 fact).",
    "SGLang 0.5.2 and 0.5.3 define no is_sm120_supported (utils/common.py defines it from "
    "0.5.4); no fact records an sm120-flag outcome for them.",
    "is_sm120_supported is imported in arg_groups/overrides.py in 0.5.15 to 0.5.18, and in "
    "server_args.py from 0.5.4 to 0.5.18.",
    "FlashInfer 0.3.1 ships only flashinfer/comm/trtllm_ar.py; 0.4.0 also keeps "
    "comm/trtllm_ar.py but defines gen_trtllm_comm_module in jit/comm.py.",
    "FlashInfer 0.6.16 still passes [9, 10] to gen_trtllm_comm_module (applied, like 0.6.15).",
    "FlashInfer 0.2.8 to 0.3.0 have no supported_major_versions list in gen_trtllm_comm_module "
    "(0.2.8 reads the device capability, 0.3.0 filters _get_cuda_arch_flags() for SM100): a "
    "shape the patch does not know, outside the pins: its fact says refused.",
    "SGLang 0.4.6 has none of the site files; 0.4.7 to 0.5.1 import is_sm100_supported from "
    "sglang.srt.layers.utils and gate on `_is_sm100_supported` alone: outside every pin; no "
    "fact recorded.",
    "FlashInfer 0.6.15 to 0.7.4 keep [9, 10] for gen_trtllm_mnnvl_comm_module and "
    "gen_mixed_comm_module and [9, 10, 11, 12] for another module; only "
    "gen_trtllm_comm_module differs between 0.6.15 ([9, 10]) and 0.6.17 ([9, 10, 12]).",
)


def fact(patch_id: str, version: str, facts: Iterable[Fact] = FACTS) -> Fact | None:
    """The fact covering `patch_id` on `version`, or None where nothing is recorded."""
    hits = [f for f in facts if f.patch == patch_id and f.covers(version)]
    if len(hits) > 1:
        raise AssertionError(f"overlapping facts for {patch_id} {version}: {hits}")
    return hits[0] if hits else None


def pinned_by(
    patch_id: str, kind: str, version: str, profiles: Mapping[str, Profile] | None = None
) -> list[str]:
    """The profiles holding `patch_id` whose pins on `kind` take `version`."""
    profiles = catalog.load().profiles if profiles is None else profiles
    return sorted(
        name for name, p in profiles.items()
        if patch_id in p.patches and kind in p.pins and p.pinned(kind, version)
    )


def judged(
    patch_id: str,
    kind: str,
    version: str,
    facts: Iterable[Fact] = FACTS,
    profiles: Mapping[str, Profile] | None = None,
) -> Fact | None:
    """`fact`, failing (AssertionError) where no fact covers a release a profile pins."""
    found = fact(patch_id, version, facts)
    if found is None:
        pins = pinned_by(patch_id, kind, version, profiles)
        if pins:
            raise AssertionError(
                f"no fact covers {patch_id} on {kind} {version}, which profile(s) "
                f"{', '.join(pins)} pin: add one to the patch's FACTS"
            )
    return found
