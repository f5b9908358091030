"""A command closes every descriptor it opened (the targets' handles, the state directory's),
by context at its end, not when the garbage collector gets to them: /proc/self/fd counted
before and after each command, run in this process with the collector off."""

from __future__ import annotations

import gc
import os

import pytest
from killing import cli
from trees import make_tree

from sm120patch.engine import apply, assess, revert


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_collector():
    """A handle closed only when collected would be closed here by luck: not with this off."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_no_descriptor_outlives_a_command(tmp_path, no_collector, layout):
    sg = str(make_tree(tmp_path, "sglang", "0.5.8", layout))
    fi = str(make_tree(tmp_path, "flashinfer", "0.6.1", "installed"))
    targets = ("--sglang", sg, "--flashinfer", fi)
    cli("status", *targets)  # the first command's imports and caches, before counting
    for command in (
        ("status",),
        ("apply", "fusion", "--dry-run", "--no-gpu-check"),
        ("apply", "fusion", "--no-gpu-check"),
        ("status", "--json"),
        ("revert", "fusion"),
        ("recover",),
    ):
        before = open_fds()
        code, _, err = cli(*command, *targets)
        assert code == 0, (command, err)
        assert open_fds() == before, command
    before = open_fds()
    assert cli("list")[0] == 0  # the targets installed here, read for their versions alone
    assert open_fds() == before


def test_a_verb_given_paths_closes_what_it_found(tmp_path, no_collector):
    """A caller holding no `Resolved` (a test, a library user) gives paths: the verb finds
    the targets for itself, and closes them when it returns."""
    paths = {
        "sglang": str(make_tree(tmp_path, "sglang", "0.5.8", "installed")),
        "flashinfer": str(make_tree(tmp_path, "flashinfer", "0.6.1", "installed")),
    }
    assess.status(paths)
    before = open_fds()
    assert apply.apply("fusion", paths).action == "applied"
    assert [s.assessment.state for s in assess.status(paths)] == ["applied", "applied"]
    assert revert.revert("fusion", paths).action == "reverted"
    assert open_fds() == before
