"""sglang.moe-runner-auto on upstream's own code under simulated SM120, SM100 and SM90.

Each release of the session inside the moe profile's pins is imported pristine and with the
moe profile's planned text (module overlays, as `explain --profile moe` does), in fresh probe
processes, and the probe runs upstream's `ModelOptNvFp4FusedMoEMethod.create_moe_runner` with
`--moe-runner-backend auto` for a layer without expert parallelism (the patch's `explain_read`):
- where the patch applies (its facts say so), SM120 gets flashinfer_trtllm pristine (the
  TRT-LLM-gen runner SM120 cannot run, weights not prepared for CUTLASS) and flashinfer_cutlass
  patched, with `enable_flashinfer_cutlass_moe` then true, so the weights are prepared for it;
- SM100 (flashinfer_trtllm) and SM90 (marlin) decide as pristine;
- where the patch does not apply, both sides decide alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import envs
import forkserver
import probes
import pytest
from behave import ARCHS, release_set
from packaging.version import Version

from sm120patch.explain import explain
from sm120patch.maintain import dists, releases
from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog
from sm120patch.targets import finding

pytestmark = pytest.mark.behaviour

PROFILE = "moe"
PATCH = "sglang.moe-runner-auto"
SIDES = ("pristine", PROFILE)
# What upstream's `auto` picks off SM120 on the releases with the choice (0.5.13 on).
UPSTREAM = {"sm100": "flashinfer_trtllm", "sm90": "marlin"}


def pinned() -> list[str]:
    prof = catalog.load().profile(PROFILE)
    return [v for v in release_set("sglang") if prof.pinned("sglang", v)]


def applies(version: str) -> bool:
    return any(f.status is Status.APPLIED
               for f in catalog.load().patches[PATCH].facts_at(version))


def request(tmp: Path, version: str, arch: str, overlay: dict[str, str]) -> dict[str, Any]:
    return {
        "simulate": arch,
        "cuda_version": "12.9",
        "sys_path": envs.sys_path_for("sglang", version),
        "overlay": overlay,
        "launches": {},
        "sglang": True,
        "flashinfer": False,
        "env": {"CUDA_HOME": str(tmp / "no-cuda")},
    }


class Results:
    """The probe's `moe_runner` answer per (release, side, arch), computed in parallel."""

    def __init__(self, tmp: Path, versions: list[str]) -> None:
        self.python = forkserver.python(envs.deps_python())
        cases = [(v, side, arch) for v in versions for side in SIDES for arch in ARCHS]
        overlays = {v: self.overlay(tmp, v) for v in versions}  # serially, before the pool
        requests = [request(tmp, v, arch, {} if side == "pristine" else overlays[v])
                    for v, side, arch in cases]
        done = probes.SHARED.run_all(requests, lambda r: explain.run_probe(self.python, r))
        self.by_case = dict(zip(cases, done, strict=True))

    @staticmethod
    def overlay(tmp: Path, version: str) -> dict[str, str]:
        target = finding.find("sglang", envs.release_prefix("sglang", version))
        texts = explain.patched_texts(target, PROFILE)
        return explain.write_overlay(texts, tmp / "overlays" / version)

    def get(self, version: str, side: str, arch: str) -> dict[str, Any]:
        res = self.by_case[(version, side, arch)]["moe_runner"]
        assert "error" not in res, (version, side, arch, res)
        return res


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    versions = sorted(pinned(), key=Version)
    if not releases.pypi_reachable():
        missing = [v for v in versions if dists.cached("sglang", v) is None]
        if missing or not envs.root().is_dir():
            pytest.skip(f"PyPI is unreachable and the cache {releases.cache_dir()} lacks what "
                        "the behaviour tier needs")
    return Results(tmp_path_factory.mktemp("moe-runner-auto"), versions)


@pytest.mark.parametrize("version", pinned())
def test_sm120_auto_picks_flashinfer_cutlass(results: Results, version: str) -> None:
    pristine = results.get(version, "pristine", "sm120")
    patched = results.get(version, PROFILE, "sm120")
    if not applies(version):
        assert patched == pristine
        return
    assert pristine == {"backend": "flashinfer_trtllm", "cutlass_weights": False}
    assert patched == {"backend": "flashinfer_cutlass", "cutlass_weights": True}


@pytest.mark.parametrize("version", pinned())
@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_off_sm120_unchanged(results: Results, version: str, arch: str) -> None:
    pristine = results.get(version, "pristine", arch)
    assert results.get(version, PROFILE, arch) == pristine
    if applies(version):  # the control: upstream's own choice there
        assert pristine == {"backend": UPSTREAM[arch], "cutlass_weights": False}
