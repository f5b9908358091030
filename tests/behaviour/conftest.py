"""The behaviour tier (tests/behaviour): see behave.py.

Skips, with the reason, only when PyPI cannot be reached and the cache lacks what the tier
needs (a release's wheel or the dependency environment).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import forkserver
import probes
import pytest
from behave import ARCHS, SIDES, Behaviour, Case, release_set
from vllm_behave import VllmBehaviour
from vllm_behave import all_cases as all_vllm_cases

from sm120patch.maintain import dists, releases

SUMMARY_ENV = "SM120PATCH_BEHAVIOUR_RESULTS"  # write every probe result to this JSON file


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    given = {
        arg
        for mark in metafunc.definition.iter_markers("parametrize")
        for arg in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
    }
    for kind in releases.KINDS:
        name = f"{kind}_version"
        if name in metafunc.fixturenames and name not in given:
            metafunc.parametrize(name, release_set(kind))


def all_cases() -> list[Case]:
    return [
        Case(kind, v, side, arch)
        for kind in releases.KINDS
        for v in release_set(kind)
        for side in SIDES
        for arch in ARCHS
    ]


@pytest.fixture(scope="session")
def behaviour(tmp_path_factory: pytest.TempPathFactory,
              request: pytest.FixtureRequest) -> Behaviour:
    if not releases.pypi_reachable():
        missing = [f"{k} {v}" for k in releases.KINDS for v in release_set(k)
                   if dists.cached(k, v) is None]
        import envs

        if missing or not envs.root().is_dir():
            what = f"{len(missing)} releases (first: {missing[0]})" if missing else (
                "the dependency environment")
            pytest.skip(f"PyPI is unreachable and the cache {releases.cache_dir()} lacks "
                        f"{what}; the behaviour tier needs them")
    tmp = tmp_path_factory.mktemp("behaviour")
    b = Behaviour(tmp / "models", tmp / "overlays")
    wanted = {(c.kind, c.version) for item in request.session.items
              for c in _versions_of(item)}
    b.warm([c for c in all_cases() if (c.kind, c.version) in wanted])
    summary = os.environ.get(SUMMARY_ENV)
    if summary:  # for the figures in a report: every case's result, as JSON
        Path(summary).write_text(json.dumps({str(c): r for c, r in b.results.items()}))
    return b


def _versions_of(item: pytest.Item) -> list[Case]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [Case(kind, params[f"{kind}_version"], "", "") for kind in releases.KINDS
            if f"{kind}_version" in params]


@pytest.fixture(scope="session")
def vllm_behaviour(tmp_path_factory: pytest.TempPathFactory,
                   request: pytest.FixtureRequest) -> VllmBehaviour:
    """The vLLM cases (vllm_behave.py) of every release a selected test names, run once per
    session, in parallel processes; a test naming none runs its own cases when it asks."""
    if not releases.pypi_reachable():
        import envs

        if not envs.root().is_dir():
            pytest.skip(f"PyPI is unreachable and the cache {releases.cache_dir()} lacks the "
                        "dependency environment; the behaviour tier needs it")
    b = VllmBehaviour(tmp_path_factory.mktemp("vllm-behaviour") / "overlays")
    wanted = tuple(sorted({item.callspec.params["version"] for item in request.session.items
                           if "vllm_behaviour" in getattr(item, "fixturenames", ())
                           and "version" in getattr(getattr(item, "callspec", None),
                                                    "params", {})}))
    b.warm(all_vllm_cases(wanted))
    return b


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many probe requests the session's modules made, and how many distinct ones ran."""
    if probes.SHARED.asked:
        ran = forkserver.counts()
        fresh = sum(n for how, n in ran.items() if how != "forked")
        terminalreporter.write_line(f"behaviour probes: {probes.SHARED.asked} asked, "
                                    f"{probes.SHARED.ran} run ({ran.get('forked', 0)} forked "
                                    f"from the torch-imported server, {fresh} fresh)")
        for how, n in sorted(ran.items()):
            if how != "forked":
                terminalreporter.write_line(f"  {n} {how}")
