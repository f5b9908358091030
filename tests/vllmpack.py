"""A test pack with one vLLM patch (target "vllm") and its profile `vmoe-test`, for the tests
of trial, explain and doctor with vLLM: its transform widens the fixture tree's
`use_cutlass_moe` gate (tests/trees.py VLLM_FILES), its wiring reads vLLM's real NvFp4 MoE
line (`Using <BACKEND> NvFp4 MoE backend out of potential backends: [...]`,
vllm/model_executor/layers/fused_moe/oracle/base.py `make_log_backend`) anchored on vLLM's
record prefix (vllm/logger.py `_FORMAT`), and its explain reader calls the gate with the
platform vLLM decides by."""

from __future__ import annotations

from pathlib import Path

PATCH = '''
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Status, Wiring, already_applied, applied, not_applicable
from sm120patch.patchkit.readers import Explain

FACTS = (Fact(releases=">=0.30", status=Status.APPLIED, shape="capability 100 -> family",
              function="use_cutlass_moe"),)
OLD = "is_device_capability(100)"
NEW = "is_device_capability_family(100) or current_platform.is_device_capability(120)"


def transform(module):
    import libcst as cst

    if NEW in module.code:
        return already_applied("use_cutlass_moe", NEW)
    if OLD not in module.code:
        return not_applicable("use_cutlass_moe", "no gate")
    return applied("use_cutlass_moe", cst.parse_module(module.code.replace(OLD, NEW)), NEW)


def explain_read(site):
    import importlib

    platforms = importlib.import_module("vllm.platforms")
    gates = importlib.import_module(site.modules[0])
    fn = getattr(gates, site.functions[0])
    return {"cutlass": bool(fn(platforms.current_platform)), "gpu": site.simulate}


def explain_row(answer):
    if "error" in answer:
        return answer["error"]
    return "cutlass MoE" if answer["cutlass"] else "no cutlass MoE"


# Anchored on vLLM's record prefix: only a line that reaches the matcher intact (no colour
# codes, the prefix whole) matches.
PREFIX = r"^\\((?:EngineCore_DP|Worker_TP)\\d+ pid=\\d+\\) INFO \\d\\d-\\d\\d [\\d:]{8} \\[[\\w.]+:\\d+\\] "
PATCH = Patch(id="vllm.test-moe", target="vllm", title="t", why="w", files=("vllm/platforms/gates.py",),
              marker="def use_cutlass_moe", transform=transform, facts=FACTS,
              wiring=Wiring(ran=(PREFIX + r"Using FLASHINFER_B12X NvFp4 MoE backend",),
                            skipped=(PREFIX + r"Using (?!FLASHINFER_B12X)\\w+ NvFp4 MoE backend",)),
              explain=Explain(name="vllm_test_moe", label="cutlass MoE gate", read=explain_read,
                              row=explain_row))
'''
PROFILES = """
schema = 1

[profiles.vmoe-test]
patches = ["vllm.test-moe"]

[profiles.vmoe-test.pins]
vllm = ">=0.30"
"""


def write_pack(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "vllm_test_moe.py").write_text(PATCH)
    (root / "profiles.toml").write_text(PROFILES)
    return root
