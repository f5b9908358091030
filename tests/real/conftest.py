"""The real-release tier: SGLang and FlashInfer releases from PyPI, cached outside the repository.

Which releases: `sm120patch.maintain.releases.DEFAULT_RELEASES`, or with SM120PATCH_FULL_RELEASES=1
every release of `full_range` (with its latest post release) that the index lists. The whole tier
skips, with the reason, when the index cannot be reached and the cache does not already hold
every release it needs.

Everything per release (download, unpack, each patch's run) happens once per session and is
shared by the tests through the session-scoped `real` fixture.
"""

from __future__ import annotations

import pytest
from realcache import FULL_ENV, RealReleases, SiteCase, full_run, release_set, site_cases

from sm120patch.maintain import dists, releases
from sm120patch.patchkit.kinds import TARGETS
from sm120patch.plan import catalog


@pytest.fixture(scope="session")
def real(request: pytest.FixtureRequest) -> RealReleases:
    needed = [(k, v) for k in releases.KINDS for v in release_set(k)]
    if not releases.index_reachable():
        missing = [f"{k} {v}" for k, v in needed if dists.cached(k, v) is None]
        if missing:
            pytest.skip(
                f"the index ({releases.index_sources()}) is unreachable and "
                f"{len(missing)} releases are not in the cache {releases.cache_dir()} "
                f"(first: {missing[0]}); the real-release tier needs them"
            )
    if full_run() and release_set("sglang") == releases.DEFAULT_RELEASES["sglang"]:
        pytest.skip(f"{FULL_ENV}=1 but PyPI's release list could not be read")
    cache = RealReleases()
    # All the per-release work of the selected tests, once, in parallel.
    cache.warm(case for item in request.session.items for case in _cases_of(item))
    return cache


def _cases_of(item: pytest.Item) -> list[SiteCase]:
    """The site runs a collected test will read."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "site_case" in params:
        return [params["site_case"]]
    cat = catalog.load()
    # A `profile` parameter outside the real tier may be anything (the Ansible module's
    # refusal of `--force` as a profile): only a profile of the library names site runs.
    if params.get("profile") not in cat.profiles:
        return []
    # test_plan_on_git_repos names both releases; test_profile_on_pinned_release one kind's.
    versions = {kind: params.get(kind) for kind in TARGETS}
    if "kind" in params:
        versions[params["kind"]] = params["version"]
    return [
        SiteCase(pid, cat.patches[pid].target, versions[cat.patches[pid].target])
        for pid in cat.profile(params["profile"]).patches
        if versions[cat.patches[pid].target]
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "site_case" in metafunc.fixturenames:
        metafunc.parametrize("site_case", site_cases(), ids=str)
    if "sglang_version" in metafunc.fixturenames:
        metafunc.parametrize("sglang_version", release_set("sglang"))
