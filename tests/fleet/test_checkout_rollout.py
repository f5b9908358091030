"""examples/ansible/rollout.yml on a node whose SGLang and FlashInfer are git checkouts kept as
upstream keeps them (a release tag, no generated version file), run twice: the first run applies
the lock pinned on the installed packages of the same releases (a lock names module paths), the
second finds every file as the lock says and changes nothing. Then the start-up guard of the
drop-in (`ensure --locked`) holds on that node, and `revert --all` gives the checkouts back."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FLASHINFER, SGLANG, Fleet
from fleetkit import snapshot
from test_examples import Node, recap
from trees import git, tree_hash, upstream_checkout

pytestmark = [pytest.mark.real, pytest.mark.fleet]


def test_the_checkout_rollout_twice(fleet: Fleet, site: Path, tmp_path: Path):
    node = Node(fleet, site, tmp_path)
    node.trees = {
        "sglang": upstream_checkout(tmp_path, "sglang", SGLANG),
        "flashinfer": upstream_checkout(tmp_path, "flashinfer", FLASHINFER),
    }
    before = {kind: tree_hash(root) for kind, root in node.trees.items()}
    installed = snapshot(site)
    where = [a for kind, root in node.trees.items() for a in (f"--{kind}", str(root))]

    first = node.rollout("--diff")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert recap(out)["failed"] == 0 and recap(out)["changed"] >= 1, out
    for root in node.trees.values():
        assert git(root, "rev-parse", "--abbrev-ref", "HEAD").strip() == "sm120patch/fusion"

    version = fleet.tool("status", *where, "--json")
    # sm120patch's own commits never change a checkout's version (read below them), so the
    # second rollout's apply --locked sees the release the lock was pinned on.
    assert _versions(version.stdout) == {"sglang": SGLANG, "flashinfer": FLASHINFER}, version.stdout
    again = node.rollout()
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert recap(out)["changed"] == 0, out

    guard = fleet.tool("ensure", "--locked", str(node.lock), *where, "--no-gpu-check")
    assert guard.returncode == 0, guard.stderr
    back = fleet.tool("revert", "--all", *where)
    assert back.returncode == 0, back.stderr
    assert {kind: tree_hash(root) for kind, root in node.trees.items()} == before
    assert snapshot(site) == installed  # the installed packages were never the target


def _versions(status_json: str) -> dict[str, str]:
    import json

    return {t["kind"]: t["version"] for t in json.loads(status_json)["targets"]}
