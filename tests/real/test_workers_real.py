"""A plan made with worker processes is the plan made in one process, on every default SGLang
release (with the newest default FlashInfer): outcomes, the text after every step, and the
imports the patches added."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pytest_mock import MockerFixture
from realcache import RealReleases, release_set

from sm120patch.engine import apply as apply_engine
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


@pytest.mark.parametrize("dry_run", [True, False])
def test_apply_starts_the_worker_before_its_checks(
    real: RealReleases,
    dry_run: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`apply` and `apply --dry-run` fork once, before the preflight, and print and write what
    they do without workers."""
    import shutil

    from click.testing import CliRunner

    from sm120patch.cli import main

    monkeypatch.setenv("SM120PATCH_PLAN_CACHE", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    events: list[str] = []
    real_fork, real_preflight = os.fork, apply_engine._preflight

    def fork() -> int:
        pid = real_fork()
        if pid:  # the parent's record; the child leaves at once with os._exit
            events.append("fork")
        return pid

    def preflight(*a: object, **k: object) -> object:
        events.append("preflight")
        return real_preflight(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(apply_engine, "_preflight", preflight)
    outputs, trees = [], []
    for mode in ("1", "0"):
        monkeypatch.setenv(workers.ENV, mode)
        events.clear()
        sg = shutil.copytree(real.tree("sglang", "0.5.8"), tmp_path / f"sg{mode}")
        fi = shutil.copytree(real.tree("flashinfer", release_set("flashinfer")[-1]),
                             tmp_path / f"fi{mode}")  # fmt: skip
        args = ["apply", "all", "--no-gpu-check", "--sglang", str(sg), "--flashinfer", str(fi)]
        result = CliRunner().invoke(main, [*args, "--dry-run"] if dry_run else args)
        assert result.exit_code == 0, result.output
        assert events == (["fork", "preflight"] if mode == "1" else ["preflight"])
        outputs.append(result.output.replace(str(tmp_path), "").replace(f"sg{mode}", "sg")
                       .replace(f"fi{mode}", "fi"))  # fmt: skip
        trees.append({(root.name[:2], p.relative_to(root).as_posix()): p.read_bytes()
                      for root in (Path(sg), Path(fi)) for p in root.rglob("*.py")})  # fmt: skip
    assert outputs[0] == outputs[1]
    assert trees[0] == trees[1]
