"""Warm paths without libcst: the commands that run most often decide from hashes and the plan
cache, never from a parse (a lock is a claim held to the plan, not a plan). Each command runs
in a fresh interpreter that then reports whether libcst was imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trees import make_tree

from sm120patch.plan.diffs import apply_diff, diff_texts

PROBE = """
import json, sys
from sm120patch.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "libcst": "libcst" in sys.modules}), file=sys.stderr)
"""


def run(*args: str, cache: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "SM120PATCH_CACHE": str(cache)},
    )
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.fixture(params=["git", "installed"])
def trees(request, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", request.param)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", request.param)
    return ["--sglang", str(sg), "--flashinfer", str(fi)], sg


def test_apply_after_a_dry_run_status_and_ensure_need_no_parse(trees, tmp_path):
    where, sg = trees
    cache = tmp_path / "cache"
    assert run("apply", "all", *where, "--dry-run", "--no-gpu-check", cache=cache) == {
        "code": 0, "libcst": True}  # fmt: skip  (the cold plan parses, and fills the cache)
    assert run("apply", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": False}
    assert run("status", *where, cache=cache) == {"code": 0, "libcst": False}
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": False}
    assert run("revert", "--all", *where, cache=cache) == {"code": 0, "libcst": False}
    # Pristine again, same bytes: ensure applies from the cache.
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": False}


def test_a_fleet_node_plans_once_then_holds_its_locks_to_its_own_plans_without_a_parse(
    trees, tmp_path
):
    where, sg = trees
    lock = tmp_path / "all.lock"
    assert run("pin", "all", *where, "-o", str(lock), cache=tmp_path / "reference")["code"] == 0
    node = tmp_path / "node-cache"  # a node that never planned anything
    # A lock is a claim, never a source of bytes: the node's own patches decide what is
    # written, so the first locked apply plans (and fills the node's own cache) ...
    assert run("apply", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": True}  # fmt: skip
    # ... and every run after it (service starts, a revert and the next rollout) holds the
    # lock to the cached plan without a parse.
    assert run("ensure", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": False}  # fmt: skip
    assert run("revert", "--all", *where, cache=node) == {"code": 0, "libcst": False}
    assert run("apply", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": False}  # fmt: skip
    assert run("revert", "--all", *where, cache=node) == {"code": 0, "libcst": False}
    assert run("ensure", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": False}  # fmt: skip


def test_a_corrupt_cache_entry_is_planned_afresh(trees, tmp_path):
    where, sg = trees
    cache = tmp_path / "cache"
    assert run("apply", "all", *where, "--dry-run", "--no-gpu-check", cache=cache)["code"] == 0
    entries = list((cache / "plans").glob("*.json.z"))
    assert entries
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:20])
    assert run("apply", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": True}


def test_an_edited_file_is_a_cache_miss(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    cache = tmp_path / "cache"
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]
    assert run("apply", "all", *where, "--dry-run", "--no-gpu-check", cache=cache)["code"] == 0
    path = sg / "sglang/srt/server_args.py"
    path.write_text(path.read_text() + "# edited after the dry run\n")
    assert run("apply", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": True}
    assert path.read_text().endswith("# edited after the dry run\n")
    # A file the import check reads (the patch adds `from sglang.srt.utils import
    # is_sm120_supported`), not one the patch writes, is part of the entry too.
    assert run("revert", "--all", *where, cache=cache)["code"] == 0
    assert run("apply", "all", *where, "--dry-run", "--no-gpu-check", cache=cache)["code"] == 0
    utils = sg / "sglang/srt/utils/common.py"
    utils.write_text(utils.read_text().replace("def is_sm120_supported(): ...\n", ""))
    code = run("apply", "all", *where, "--no-gpu-check", cache=cache)
    assert code == {"code": 1, "libcst": True}  # planned afresh: the import would now fail


lines = st.lists(st.sampled_from(["a\n", "b\n", "c\n", "  x = 1\n", "\n", "def f():\n"]), max_size=30)


@given(lines, lines, st.booleans(), st.booleans())
def test_a_diff_applies_back_to_exactly_its_text(old, new, cut_old, cut_new):
    before, after = "".join(old), "".join(new)
    before = before.rstrip("\n") if cut_old else before
    after = after.rstrip("\n") if cut_new else after
    diff = diff_texts("m.py", before, after)
    if diff:
        assert apply_diff(before, diff) == after
    # The context must match exactly: a text whose changed lines differ is refused.
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and
               not line.startswith("---")]  # fmt: skip
    if removed and removed[0].strip():
        other = "".join(
            line.replace(removed[0], removed[0] + "# other") if line.rstrip("\n") == removed[0]
            else line
            for line in before.splitlines(True)
        )
        assert apply_diff(other, diff) is None


STATUS_PROBE = """
import json, sys
from sm120patch.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("sm120patch.", "packaging")))),
      file=sys.stderr)
"""


def test_status_and_help_load_neither_the_catalog_nor_packaging(trees):
    """`status` decides from hashes and the state alone; loading the catalog (every patch module)
    or packaging (version rules) would charge every start of a service for nothing."""
    where, _ = trees
    for args in (["status", *where], ["--help"]):
        proc = subprocess.run([sys.executable, "-c", STATUS_PROBE, *args],
                              capture_output=True, text=True)  # fmt: skip
        loaded = json.loads(proc.stderr.strip().splitlines()[-1])
        assert "sm120patch.plan.catalog" not in loaded, args
        assert not [m for m in loaded if m.startswith(("packaging", "sm120patch.patches"))], args
