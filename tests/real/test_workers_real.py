"""A plan made with worker processes is the plan made in one process, on every default SGLang
release (with the newest default FlashInfer): outcomes, the text after every step, and the
imports the patches added."""

from __future__ import annotations

import os

import pytest
from pytest_mock import MockerFixture
from realcache import RealReleases, release_set

from sm120patch.plan import planner, workers


@pytest.mark.parametrize("sglang", release_set("sglang"))
@pytest.mark.parametrize(("profile", "started"), [("all", True), ("fusion", False)])
def test_workers_plan_what_one_process_plans(
    real: RealReleases,
    sglang: str,
    profile: str,
    started: bool,
    monkeypatch: pytest.MonkeyPatch,
    mocker: MockerFixture,
) -> None:
    paths = {
        "sglang": real.tree("sglang", sglang),
        "flashinfer": real.tree("flashinfer", release_set("flashinfer")[-1]),
    }
    monkeypatch.setenv("SM120PATCH_PLAN_CACHE", "0")
    monkeypatch.delenv(workers.ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    fork = mocker.spy(os, "fork")
    if started:  # as apply does: workers started first, taken by the plan
        with planner.start_workers(profile, paths) as ahead:
            assert fork.call_count == 1 and len(ahead.children) == 1
            forked = planner.plan(profile, paths, force=True, started=ahead)
            assert not ahead.children
    else:
        forked = planner.plan(profile, paths, force=True)
    assert fork.call_count == 1  # server_args.py is far over the size a worker takes
    monkeypatch.setenv(workers.ENV, "0")
    alone = planner.plan(profile, paths, force=True)
    assert fork.call_count == 1
    assert forked.outcomes == alone.outcomes
    assert forked.diff() == alone.diff()
    for a, b in zip(forked.targets, alone.targets, strict=True):
        for fa, fb in zip(a.files, b.files, strict=True):
            assert (fa.file, fa.before, fa.after) == (fb.file, fb.before, fb.after)
            assert fa.step_texts() == fb.step_texts()
            assert fa.imports_added() == fb.imports_added()
