"""Session cache for the real-release tier: trees, targets and each patch's run on each release.

Kept out of conftest.py so test modules can import its types by a name of their own.

The work per release (download, unpack, every patch's run, every second run) is done once per
session, up front and in parallel worker processes: the patches run libcst over files of up
to 330 kB (SGLang's server_args.py), a few seconds each, and the releases are independent.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from pathlib import Path

from packaging.specifiers import SpecifierSet

from sm120patch.maintain import releases, sources, trees
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Outcome, Patch, Status
from sm120patch.patchkit.runner import FileResult, transform_text
from sm120patch.patchkit.sitecheck import Spans
from sm120patch.plan import catalog
from sm120patch.plan.catalog import Profile
from sm120patch.plan.planner import plan_target
from sm120patch.targets import Target, finding

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


def site_cases() -> list[SiteCase]:
    """Every patch on every release of this session: what tests/real/test_sites.py checks."""
    from sm120patch.patchkit.kinds import TARGETS

    return [
        SiteCase(p.id, kind, v)
        for kind in TARGETS  # vLLM's too: its sources are cached (maintain/sources.py)
        for v in release_set(kind)
        for p in patches_of(kind)
    ]


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

    # Parsed once per session and per distinct text: several tests, and many releases, read
    # the same 330 kB file's syntax tree (the checks only read it).
    @cached_property
    def before_ast(self) -> ast.Module:
        return parsed(self.before)

    @cached_property
    def after_ast(self) -> ast.Module:
        return parsed(self.after)

    def key(self, known: Fact | None) -> CheckKey:
        """What the patch's check reads: its module, the two texts and the fact it is told."""
        return (self.patch.id, patch_digest(self.patch), digest(self.before),
                digest(self.after), known)


# (patch id, its module's digest, digest of the text before, digest of the text after, fact)
CheckKey = tuple[str, str, str, str, "Fact | None"]


@lru_cache(maxsize=64)
def parsed(text: str) -> ast.Module:
    return ast.parse(text)


@cache
def compiles(text: str, file: str) -> bool:
    """compile() once per distinct text (a SyntaxError is raised again on each call)."""
    compile(text, file, "exec", dont_inherit=True)
    return True


_checked: dict[CheckKey, Spans | AssertionError] = {}


def checked(run: SiteRun, known: Fact | None) -> Spans:
    """The patch's own check (Patch.check) on the run, once per CheckKey in a session: a
    check is a function of the two trees and the fact alone (`Check`'s signature), so the
    releases whose site bytes are equal share one answer, a failure included."""
    check = run.patch.check
    assert check is not None, f"{run.patch.id} declares no check (Patch(check=...))"
    assert known is not None
    key = run.key(known)
    if key not in _checked:
        try:
            _checked[key] = check(run.before_ast, run.after_ast, known)
        except AssertionError as exc:
            _checked[key] = exc
            raise
    found = _checked[key]
    if isinstance(found, AssertionError):  # a fresh error: the first keeps its own traceback
        raise AssertionError(f"{found} (the same input as a release that failed above)") from found
    return found


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
    found = finding.find(kind, release_tree(kind, version))
    assert found.version == version, f"{found.version} read from {found.version_source}"
    return found


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def patch_digest(patch: Patch) -> str:
    """The sha256 of the module that defines the patch: its transform, sought names and check."""
    return _module_digest(patch.transform.__module__)


@cache
def _module_digest(name: str) -> str:
    module = sys.modules[name]
    assert module.__file__, f"no source file for {name}"
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()


# (patch ids in order, their modules' digests, the file's path, the digest of its text): what
# a transform reads. transform_text is a function of exactly these, so a key that is equal
# means a result that is equal; the release's version and its other files are not in it.
RunKey = tuple[tuple[str, ...], tuple[str, ...], str, str]


def run_key(patches: Sequence[Patch], file: str, text: str) -> RunKey:
    ids = tuple(p.id for p in patches)
    return ids, tuple(patch_digest(p) for p in patches), file, digest(text)


class ByBytes:
    """transform_text remembered by its RunKey: byte-identical input runs once per process.

    What depends on the release beyond the file (its version's facts and notes, the names its
    other modules define) is judged by the planner after the transform, on every release."""

    def __init__(self) -> None:
        self.results: dict[RunKey, FileResult] = {}
        self.ran = 0

    def __call__(self, patches: Sequence[Patch], file: str, text: str) -> FileResult:
        key = run_key(patches, file, text)
        if key not in self.results:
            self.ran += 1
            self.results[key] = _without_trees(transform_text(patches, file, text))
        # The planner replaces a result's outcomes and changes (never edits them in place):
        # each release gets its own shell around the shared texts and trees.
        return copy.copy(self.results[key])


@dataclass
class _Kept(FileResult):
    """A FileResult kept without its libcst trees (a chain over 15 releases of server_args.py
    would hold 15 of them), with what the planner still asks of the trees worked out first."""

    added: frozenset[tuple[str, str]] = frozenset()

    def imports_added(self) -> set[tuple[str, str]]:
        return set(self.added)


def _without_trees(result: FileResult) -> _Kept:
    kept = _Kept(result.file, result.before, result.after, list(result.outcomes), [],
                 list(result.texts), None, frozenset(result.imports_added()))
    kept.steps = [(pid, None) for pid, _ in result.steps]  # refuse_all reads the ids
    return kept


def run_chain(key: ChainKey, by_bytes: ByBytes | None = None) -> RawRuns:
    """Plan a whole chain on one release and cut it into one step per patch; run every applied
    patch a second time on its own output."""
    chain, kind, version = key
    run = by_bytes or ByBytes()
    cat = catalog.load()
    target = find_target(kind, version)
    planned = plan_target(
        chain_profile(chain, kind), [cat.patches[p] for p in chain], target, run=run
    )
    runs: RawRuns = {}
    for result in planned.files:
        text = result.before
        steps = dict(_step_texts(result))
        for outcome in result.outcomes:  # in chain order within one file
            after = steps.get(outcome.patch, text)
            rerun = None
            if outcome.status is Status.APPLIED:
                rerun = run([cat.patches[outcome.patch]], result.file, after)
            runs[outcome.patch] = (outcome, result.file, text, after, rerun)
            text = after
    missing = set(chain) - set(runs)
    assert not missing, f"no outcome for {sorted(missing)} on {kind} {version}"
    return runs


def run_chains(job: tuple[tuple[str, ...], str, tuple[str, ...]]) -> tuple[list[RawRuns], int]:
    """One chain on each of several releases, in a worker process, sharing one ByBytes: a
    release whose files hold the same bytes as an earlier one's costs no transform. Also
    returns how many transforms ran."""
    chain, kind, versions = job
    by_bytes = ByBytes()
    runs = [run_chain((chain, kind, v), by_bytes) for v in versions]
    return runs, by_bytes.ran


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
        self.transforms_run = 0

    def tree(self, kind: str, version: str) -> Path:
        return release_tree(kind, version)  # built once per cache; cheap to look up after

    def target(self, kind: str, version: str) -> Target:
        key = (kind, version)
        if key not in self._targets:
            self._targets[key] = find_target(kind, version)
        return self._targets[key]

    def warm(self, cases: Iterable[SiteCase]) -> None:
        """Run every chain these cases need, in parallel: one job per chain, over every release
        it is needed on, so that identical bytes run once (ByBytes)."""
        wanted = {(chain_of(c.patch_id), c.kind, c.version) for c in cases}
        by_chain: dict[tuple[tuple[str, ...], str], list[str]] = {}
        for chain, kind, version in sorted(wanted - set(self._chains)):
            by_chain.setdefault((chain, kind), []).append(version)
        jobs = [(chain, kind, tuple(vs)) for (chain, kind), vs in by_chain.items()]
        if not jobs:
            return
        # Biggest first (SGLang's server_args.py), so the pool does not end on a long tail.
        jobs.sort(key=lambda j: (j[1] != "sglang", -len(j[0]) * len(j[2])))
        n = min(workers(), len(jobs))
        if n == 1:
            results = list(map(run_chains, jobs))
        else:
            with ProcessPoolExecutor(max_workers=n) as pool:
                results = list(pool.map(run_chains, jobs))
        for (chain, kind, versions), (runs, ran) in zip(jobs, results, strict=True):
            self.transforms_run += ran
            for version, r in zip(versions, runs, strict=True):
                self._chains[(chain, kind, version)] = r

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
