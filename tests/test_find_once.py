"""A command finds each target once and assesses it at most once: the command layer's
`Session` resolves the targets it names and hands those `Target` objects to the engine, and an
assessment is passed down rather than made again. Counted with spies on the real functions,
for every command that works on targets, on both layouts."""

from __future__ import annotations

import inspect
import json
import os
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from killing import command
from trees import make_tree

from sm120patch.cli import main
from sm120patch.engine import assess
from sm120patch.targets import finding


def where(sg: Path, fi: Path) -> list[str]:
    return ["--sglang", str(sg), "--flashinfer", str(fi)]


def python_without_site(tmp_path: Path) -> Path:
    """An interpreter that cannot import torch: explain finds and assesses, then stops."""
    script = tmp_path / "python-no-site"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


DESCRIBE = inspect.signature(finding._describe)


class Counts:
    """Spies on finding (`finding._describe`, which every find ends in, once per target found)
    and assessing (`assess.assess`, which `assess.status` calls once per target)."""

    def __init__(self, mocker) -> None:
        self.describe = mocker.spy(finding, "_describe")
        self.find = mocker.spy(finding, "find")
        self.quiet = mocker.spy(finding, "find_quiet")
        self.assess = mocker.spy(assess, "assess")
        self.status = mocker.spy(assess, "status")

    def reset(self) -> None:
        for spy in (self.describe, self.find, self.quiet, self.assess, self.status):
            spy.reset_mock()

    def found(self) -> Counter[tuple[str, str]]:
        """How often each target (kind, package directory: `_describe`'s first two arguments,
        however they are passed) was found."""
        out: Counter[tuple[str, str]] = Counter()
        for c in self.describe.call_args_list:
            kind, where = list(DESCRIBE.bind(*c.args, **c.kwargs).arguments.values())[:2]
            out[str(kind), str(where)] += 1
        return out

    def assessed(self) -> Counter[tuple[str, str]]:
        """How often each target (kind, package directory) was assessed."""
        return Counter(
            (str(c.args[0].kind), str(c.args[0].package_dir)) for c in self.assess.call_args_list
        )

    def line(self) -> str:
        return (f"find {self.find.call_count}, find_quiet {self.quiet.call_count}, "
                f"_describe {self.describe.call_count}, assess {self.assess.call_count}, "
                f"status {self.status.call_count}")  # fmt: skip


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout + result.stderr


@pytest.fixture(params=["git", "installed"])
def trees(request, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", request.param)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", request.param)
    return sg, fi


def killed_apply(sg: Path, fi: Path) -> None:
    """An apply killed after its journals: `recover` has something to do."""
    proc = subprocess.run(
        command("apply", "all", *where(sg, fi), "--no-gpu-check"),
        env={**os.environ, "SM120PATCH_KILL_AT": "after-write"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -9, proc.stderr


def test_every_command_finds_each_target_once_and_assesses_it_at_most_once(
    trees, tmp_path, mocker
):
    sg, fi = trees
    both = where(sg, fi)
    lock = tmp_path / "all.lock"
    counts = Counts(mocker)
    # (command line, its exit code). Order matters: each command meets the trees as the ones
    # before left them.
    steps: list[tuple[list[str], int]] = [
        (["apply", "all", *both, "--dry-run", "--no-gpu-check"], 0),
        # moe patches SGLang and checks the FlashInfer it refuses below 0.6.7: the one named.
        (["apply", "moe", *both, "--dry-run", "--no-gpu-check"], 0),
        (["pin", "all", *both, "-o", str(lock)], 0),
        (["ensure", "all", *both, "--no-gpu-check"], 0),  # pristine: applies
        (["status", *both], 0),
        (["ensure", "all", *both, "--no-gpu-check"], 0),  # applied: the service start
        (["ensure", "--locked", str(lock), *both, "--no-gpu-check"], 0),
        (["pin", "all", *both, "-o", str(tmp_path / "applied.lock")], 0),
        (["doctor", *both], 0),
        (["scan", *both], 0),
        (["explain", *both, "--python", str(python_without_site(tmp_path)),
          "--simulate", "sm120"], 7),
        (["revert", "--all", *both], 0),
        (["apply", "all", *both, "--no-gpu-check"], 0),
        (["revert", "--all", *both, "--dry-run"], 0),
        (["revert", "--all", *both], 0),
        (["ensure", "--locked", str(lock), *both, "--no-gpu-check"], 0),  # pristine: applies
        (["revert", "all", *both], 0),
    ]  # fmt: skip
    wrong = []
    for args, code in steps:
        counts.reset()
        got, out = cli(*args)
        assert got == code, (args, out)
        found, assessed = counts.found(), counts.assessed()
        label = " ".join(a for a in args if not a.startswith("/"))
        if sorted(k for k, _ in found) != ["flashinfer", "sglang"] or set(found.values()) != {1}:
            wrong.append((label, "found", dict(found), counts.line()))
        if any(n > 1 for n in assessed.values()):
            wrong.append((label, "assessed", dict(assessed), counts.line()))
    killed_apply(sg, fi)
    counts.reset()
    got, out = cli("recover", *both)
    assert got == 0, out
    found, assessed = counts.found(), counts.assessed()
    if not found or any(n != 1 for n in found.values()):
        wrong.append(('recover', 'found', dict(found), counts.line()))
    if any(n > 1 for n in assessed.values()):
        wrong.append(("recover", "assessed", dict(assessed), counts.line()))
    assert not wrong, "\n".join(map(str, wrong))


def test_the_flashinfer_beside_an_installed_sglang_is_found_once(tmp_path, mocker):
    """moe checks the FlashInfer in SGLang's site-packages (not named, not importable here):
    the pins, the note on what was not checked, the plan and `status` all ask for it, and it
    is found once."""
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    beside = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    for path in beside.iterdir():
        path.rename(site / path.name)
    counts = Counts(mocker)
    for args in (["apply", "moe", "--sglang", str(site), "--no-gpu-check"],
                 ["status", "--sglang", str(site)],
                 ["ensure", "moe", "--sglang", str(site), "--no-gpu-check"]):  # fmt: skip
        counts.reset()
        code, out = cli(*args)
        assert code == 0, out
        assert counts.found() == {
            ("sglang", str((site / "sglang").resolve())): 1,
            ("flashinfer", str((site / "flashinfer").resolve())): 1,
        }, (args[0], counts.line())
        assert all(n == 1 for n in counts.assessed().values()), (args[0], counts.line())


def test_ensure_takes_its_assessment_under_the_lock_only_while_the_state_is_the_same(
    tmp_path, mocker
):
    """`ensure` hands the assessment it made before the lock to the apply: another run that
    applied a profile meanwhile changed the state, so the apply assesses again under its lock
    and refuses, as it would have, instead of writing `all` over `fusion`."""
    from sm120patch.engine import apply

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    real = apply.apply_runs  # ensure imports it where it applies (not at every service start)

    first = [True]

    def another_run_first(*args, **kwargs):
        # ensure's call (the first): the other run's apply goes through apply_runs too
        if first.pop() if first else False:
            inner = cli("apply", "fusion", *where(sg, fi), "--no-gpu-check")
            assert inner[0] == 0, inner[1]
        return real(*args, **kwargs)

    mocker.patch.object(apply, "apply_runs", another_run_first)
    code, out = cli("ensure", "all", *where(sg, fi), "--no-gpu-check")
    assert code == 1, out
    assert "profile fusion is applied on SGLang" in out
    mocker.stopall()
    code, out = cli("status", *where(sg, fi), "--json")
    assert {t["profile"] for t in json.loads(out)["targets"] if t["kind"] == "sglang"} == {
        "fusion"}  # fmt: skip


def test_ensure_refuses_a_target_the_apply_left_without_its_record(tmp_path):
    """The sites hold the patches, but not by sm120patch's hand (its record was removed): the
    apply changes nothing and records nothing there, and `ensure` says so from the apply's
    report rather than from a second assessment."""
    from sm120patch.engine import store

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0
    target = finding.find("sglang", sg)
    (store.state_dir_for(target.root, target.layout, target.kind) / store.MANIFEST).unlink()
    code, out = cli("ensure", "all", *where(sg, fi), "--no-gpu-check")
    assert code == 1, out
    assert f"SGLang at {target.root}: its sites already hold profile all's code" in out
