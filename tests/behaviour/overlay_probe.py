"""A profile's explain reader run pristine and patched under each simulated GPU, for the
behaviour modules of one-reader profiles (gdn-prefill, pcie-ipc).

Every (release, side, arch) a module's tests read is asked of the shared probe cache in one
batch when the module starts (`prefetch`), so the distinct requests run in parallel processes
and the pristine ones are shared with the other modules (test_probes.py holds that the
requests are one key). A negative test's own overlay runs alone and is kept nowhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import envs
import forkserver
import probes
from behave import ARCHS, release_set

from sm120patch.explain import explain
from sm120patch.plan import catalog
from sm120patch.targets import finding

SIDES = ("pristine", "patched")


def pinned(profile: str) -> list[str]:
    prof = catalog.load().profile(profile)
    return [v for v in release_set("sglang") if prof.pinned("sglang", v)]


class OverlayProbe:
    """`reader`'s answer (a key of the probe's result) for `profile` on SGLang releases."""

    def __init__(self, profile: str, reader: str, tmp: Path) -> None:
        self.profile = profile
        self.reader = reader
        self.tmp = tmp
        self.python = forkserver.python(envs.deps_python())
        self.results: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.overlays: dict[str, dict[str, str]] = {}

    def overlay(self, version: str) -> dict[str, str]:
        if version not in self.overlays:
            target = finding.find("sglang", envs.release_prefix("sglang", version))
            texts = explain.patched_texts(target, self.profile)
            self.overlays[version] = explain.write_overlay(texts, self.tmp / version)
        return self.overlays[version]

    def request(
        self, version: str, side: str, arch: str, overlay: dict[str, str] | None = None
    ) -> dict[str, Any]:
        return {
            "simulate": arch,
            "sys_path": envs.sys_path_for("sglang", version),
            "overlay": overlay
            if overlay is not None
            else (self.overlay(version) if side == "patched" else {}),
            "launches": {},
            "sglang": True,
            "flashinfer": False,
            "env": {"CUDA_HOME": str(self.tmp / "no-cuda")},
        }

    def _runner(self, request: dict[str, Any]) -> dict[str, Any]:
        return explain.run_probe(self.python, request)

    def prefetch(self, versions: list[str]) -> None:
        """Every (release, side, arch) of `versions` in one parallel batch."""
        cases = [(v, side, arch) for v in versions for side in SIDES for arch in ARCHS]
        requests = [self.request(*case) for case in cases]  # overlays serially, first
        done = probes.SHARED.run_all(requests, self._runner)
        self.results.update({c: r[self.reader] for c, r in zip(cases, done, strict=True)})

    def run(
        self, version: str, side: str, arch: str, overlay: dict[str, str] | None = None
    ) -> dict[str, Any]:
        if overlay is not None:  # a negative test's own overlay: run it, keep nothing
            return dict(self._runner(self.request(version, side, arch, overlay))[self.reader])
        if (version, side, arch) not in self.results:
            self.prefetch([version])
        return self.results[(version, side, arch)]
