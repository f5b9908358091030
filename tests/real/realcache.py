"""Session cache for the real-release tier: trees, targets and each patch's run on each release.

Kept out of conftest.py so test modules can import its types by a name of their own.

The work per release (download, unpack, every patch's run, every second run) is done once per
session, up front and in parallel worker processes: the patches run libcst over files of up
to 330 kB (SGLang's server_args.py), a few seconds each, and the releases are independent.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

from packaging.specifiers import SpecifierSet

from sm120patch import targets
from sm120patch.maintain import releases, sources, trees
from sm120patch.patchkit.model import Outcome, Patch, Status
from sm120patch.patchkit.runner import FileResult, transform_text
from sm120patch.plan import catalog
from sm120patch.plan.catalog import Profile
from sm120patch.plan.planner import plan_target
from sm120patch.targets import Target

FULL_ENV = "SM120PATCH_FULL_RELEASES"
WORKERS_ENV = "SM120PATCH_REAL_WORKERS"


def full_run() -> bool:
    return os.environ.get(FULL_ENV, "") not in ("", "0")


@cache
def release_set(kind: str) -> tuple[str, ...]:
    """The releases of `kind` this session runs on."""
    if full_run():
        try:
            return tuple(releases.available(kind))
        except releases.ReleaseError:
            # Offline: fall back to the default set; the session fixture then says why.
            pass
    return releases.DEFAULT_RELEASES[kind]


def patches_of(kind: str) -> list[Patch]:
    return sorted(
        (p for p in catalog.load().patches.values() if p.target == kind), key=lambda p: p.id
    )


@dataclass(frozen=True)
class SiteCase:
    """One patch on one release: the unit most tests are parametrized over."""

    patch_id: str
    kind: str
    version: str

    def __str__(self) -> str:
        return f"{self.patch_id}@{self.version}"


@dataclass
class SiteRun:
    """One patch's step on one file: the text it saw and the text it left.

    A patch may rely on the ones before it in its profile (the fusion gate on the SM120 flag
    that sglang.sm120-flag adds to the same file), so each site runs as part of its profile's
    chain, exactly as an apply commits it: `before` is the file after the earlier patches,
    `after` is `before` plus this patch's change, `rerun` the patch run again on `after`.
    """

    patch: Patch
    target: Target
    chain: tuple[str, ...]
    outcome: Outcome
    file: str
    before: str
    after: str
    rerun: FileResult | None  # only for an applied site

    # Parsed once per session: several tests read the same 330 kB file's syntax tree.
    @cached_property
    def before_ast(self) -> ast.Module:
        return ast.parse(self.before)

    @cached_property
    def after_ast(self) -> ast.Module:
        return ast.parse(self.after)


def chain_of(patch_id: str) -> tuple[str, ...]:
    """The patches, on `patch_id`'s target, of the smallest profile holding it, in order. The
    patches before `patch_id` are the ones it may rely on; the ones after cannot change what it
    does (a patch only sees the text the earlier ones left)."""
    cat = catalog.load()
    holding = sorted(
        (p for p in cat.profiles.values() if patch_id in p.patches),
        key=lambda p: (len(p.patches), p.name),
    )
    if not holding:
        return (patch_id,)
    kind = cat.patches[patch_id].target
    return tuple(pid for pid in holding[0].patches if cat.patches[pid].target == kind)


def chain_profile(chain: tuple[str, ...], kind: str) -> Profile:
    """A profile of `chain`, pinned everywhere, for which a missing site is fine: the planner
    then judges each patch alone (upstream vs already-applied) without a real profile's
    opinion on absent sites, which tests/real/test_profiles.py checks separately."""
    return Profile(
        name="chain:" + "+".join(chain),
        title="",
        status="experimental",
        patches=chain,
        pins={kind: SpecifierSet()},
        absent={pid: SpecifierSet() for pid in chain},
    )


ChainKey = tuple[tuple[str, ...], str, str]  # (chain, kind, version)
# patch id -> (outcome, file, before, after, rerun): plain data, cheap to send between processes
RawRuns = dict[str, tuple[Outcome, str, str, str, FileResult | None]]


def release_tree(kind: str, version: str) -> Path:
    """The cached tree of a release: vLLM's as its `.py` sources (`sources.tree`, never a
    wheel), the others unpacked from their distribution (`trees.tree`). On a cold cache
    `trees.tree` refuses vLLM, so every caller goes through here."""
    if kind in releases.SOURCES_ONLY:
        return sources.tree(kind, version)
    return trees.tree(kind, version)


def find_target(kind: str, version: str) -> Target:
    found = targets.find(kind, release_tree(kind, version))
    assert found.version == version, f"{found.version} read from {found.version_source}"
    return found


def run_chain(key: ChainKey) -> RawRuns:
    """Plan a whole chain once on one release and cut it into one step per patch; run every
    applied patch a second time on its own output. Runs in a worker process."""
    chain, kind, version = key
    cat = catalog.load()
    target = find_target(kind, version)
    planned = plan_target(chain_profile(chain, kind), [cat.patches[p] for p in chain], target)
    runs: RawRuns = {}
    for result in planned.files:
        text = result.before
        steps = dict(_step_texts(result))
        for outcome in result.outcomes:  # in chain order within one file
            after = steps.get(outcome.patch, text)
            rerun = None
            if outcome.status is Status.APPLIED:
                rerun = transform_text([cat.patches[outcome.patch]], result.file, after)
            runs[outcome.patch] = (outcome, result.file, text, after, rerun)
            text = after
    missing = set(chain) - set(runs)
    assert not missing, f"no outcome for {sorted(missing)} on {kind} {version}"
    return runs


def _step_texts(result: FileResult) -> list[tuple[str, str]]:
    """(patch id, text after it) per applied patch; the engine may keep steps as trees."""
    if hasattr(result, "step_texts"):
        return result.step_texts()
    return [(pid, step if isinstance(step, str) else step.code) for pid, step in result.steps]


def workers() -> int:
    env = os.environ.get(WORKERS_ENV)
    return max(1, int(env)) if env else (os.cpu_count() or 1)


class RealReleases:
    """Session cache of trees, targets and per-site runs."""

    def __init__(self) -> None:
        self._targets: dict[tuple[str, str], Target] = {}
        self._chains: dict[ChainKey, RawRuns] = {}
        self._sites: dict[SiteCase, SiteRun] = {}

    def tree(self, kind: str, version: str) -> Path:
        return release_tree(kind, version)  # built once per cache; cheap to look up after

    def target(self, kind: str, version: str) -> Target:
        key = (kind, version)
        if key not in self._targets:
            self._targets[key] = find_target(kind, version)
        return self._targets[key]

    def warm(self, cases: Iterable[SiteCase]) -> None:
        """Run every chain these cases need, in parallel; the trees get built on the way."""
        wanted = {(chain_of(c.patch_id), c.kind, c.version) for c in cases}
        keys = sorted(wanted - set(self._chains))
        if not keys:
            return
        n = min(workers(), len(keys))
        if n == 1:
            results = map(run_chain, keys)
            self._chains.update(zip(keys, results, strict=True))
            return
        # Biggest first (SGLang's server_args.py), so the pool does not end on a long tail.
        keys.sort(key=lambda k: (k[1] != "sglang", -len(k[0])))
        with ProcessPoolExecutor(max_workers=n) as pool:
            self._chains.update(zip(keys, pool.map(run_chain, keys), strict=True))

    def site(self, case: SiteCase) -> SiteRun:
        if case not in self._sites:
            self._sites[case] = self._site(case)
        return self._sites[case]

    def _site(self, case: SiteCase) -> SiteRun:
        chain = chain_of(case.patch_id)
        key = (chain, case.kind, case.version)
        if key not in self._chains:
            self.warm([case])
        outcome, file, before, after, rerun = self._chains[key][case.patch_id]
        patch = catalog.load().patches[case.patch_id]
        return SiteRun(patch, self.target(case.kind, case.version), chain, outcome, file,
                       before, after, rerun)
