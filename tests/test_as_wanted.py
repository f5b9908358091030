"""A target a profile needs nothing from is as wanted: FlashInfer 0.6.17 on builds its comm
module for SM120 (flashinfer.comm-arch is `upstream`), so `apply fusion` writes nothing there.
Every verb then treats that target as the profile wants it, from a record of "nothing needed"
held to the bytes that said so: status, ensure (twice, without a parse), pin, apply --locked,
ensure --locked, revert and recover, on checkouts and installed packages. Small fixture trees
(tests/trees.py); tests/real/test_cycle_newest.py runs the same cycle on the newest releases."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner
from killing import run as run_process
from test_warm_paths import run as probe  # the command in a fresh interpreter; libcst?
from trees import make_tree, tree_hash

from sm120patch.cli import main
from sm120patch.engine.store import TargetState
from sm120patch.plan import catalog
from sm120patch.targets.finding import find

COMM = "flashinfer/jit/comm.py"
UPSTREAM = "supported_major_versions=[9, 10, 12]"


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def states(where: list[str]) -> dict[str, dict]:
    code, out, err = cli("status", *where, "--json")
    assert code == 0, err
    return {t["kind"]: t for t in json.loads(out)["targets"]}


@pytest.fixture(params=["git", "installed"])
def pair(request, tmp_path):
    """SGLang 0.5.8 (fusion patches it) and a FlashInfer 0.6.17 whose comm module already
    builds for SM120, as `layout`."""
    layout = request.param
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    fi = make_tree(tmp_path, "flashinfer", "0.6.17", layout)
    comm = fi / COMM
    comm.write_text(comm.read_text().replace("supported_major_versions=[9, 10]", UPSTREAM, 1))
    if layout == "git":
        subprocess.run(["git", "-C", str(fi), "commit", "-qam", "0.6.17"], check=True)
    return layout, sg, fi, ["--sglang", str(sg), "--flashinfer", str(fi)]


def test_the_whole_cycle_treats_a_target_that_needs_nothing_as_wanted(pair, tmp_path):
    layout, sg, fi, where = pair
    before = {r: tree_hash(r) for r in (sg, fi)}
    cache = tmp_path / "cache"
    pristine_lock, applied_lock = tmp_path / "pristine.lock", tmp_path / "applied.lock"
    assert cli("pin", "fusion", *where, "-o", str(pristine_lock))[0] == 0

    code, out, err = cli("apply", "fusion", *where, "--no-gpu-check")
    assert code == 0, err
    assert "needs nothing here" in out
    found = states(where)
    assert found["flashinfer"]["state"] == "applied"
    assert found["flashinfer"]["profile"] == "fusion"
    assert found["flashinfer"]["files"] == []
    assert (found["flashinfer"]["needs_nothing"], found["sglang"]["needs_nothing"]) == (True, False)
    assert "needs nothing here" in found["flashinfer"]["message"]
    assert tree_hash(fi) == before[fi]  # nothing written into FlashInfer

    # The service guard, twice, from the bytes alone: no parse.
    for _ in range(2):
        assert probe("ensure", "fusion", *where, "--no-gpu-check", cache=cache) == {
            "code": 0, "libcst": False}  # fmt: skip
    code, _, err = cli("pin", "fusion", *where, "-o", str(applied_lock))
    assert code == 0, err
    assert applied_lock.read_text() == pristine_lock.read_text()
    assert 'flashinfer = "0.6.17"' in applied_lock.read_text()
    for verb in ("apply", "ensure", "apply"):
        code, _, err = cli(verb, "--locked", str(applied_lock), *where, "--no-gpu-check")
        assert code == 0, f"{verb} --locked: {err}"

    code, out, err = cli("revert", "--all", *where)
    assert code == 0, err
    assert "profile fusion needed nothing here" in out
    assert {r: tree_hash(r) for r in (sg, fi)} == before
    assert {k: t["state"] for k, t in states(where).items()} == {
        "sglang": "pristine", "flashinfer": "pristine"}  # fmt: skip

    # A fresh copy: the lock applies there, and holds there.
    assert cli("apply", "--locked", str(applied_lock), *where, "--no-gpu-check")[0] == 0
    assert probe("ensure", "--locked", str(applied_lock), *where, "--no-gpu-check",
                 cache=cache) == {"code": 0, "libcst": False}  # fmt: skip
    assert states(where)["flashinfer"]["state"] == "applied"


def test_the_record_that_nothing_is_needed_is_held_to_the_bytes(pair):
    layout, sg, fi, where = pair
    assert cli("apply", "fusion", *where, "--no-gpu-check")[0] == 0
    comm = fi / COMM
    # FlashInfer replaced in place by a build that still passes [9, 10]: the verdict no longer
    # holds, status says so, and ensure plans again and patches it.
    comm.write_text(comm.read_text().replace(UPSTREAM, "supported_major_versions=[9, 10]"))
    if layout == "git":
        subprocess.run(["git", "-C", str(fi), "commit", "-qam", "back"], check=True)
    found = states(where)["flashinfer"]
    assert found["state"] == "gone"
    assert COMM in found["message"]
    code, _, err = cli("ensure", "fusion", *where, "--no-gpu-check")
    assert code == 0, err
    found = states(where)["flashinfer"]
    assert found["state"] == "applied"
    assert [f["state"] for f in found["files"]] == ["patched"]
    assert "supported_major_versions=[9, 10, 12]" in comm.read_text()


def test_a_kill_before_the_record_then_recover_and_ensure(pair):
    """The record is written after the apply commits: a kill just before it loses nothing;
    recover keeps the committed apply, and ensure plans FlashInfer again and records it."""
    layout, sg, fi, where = pair
    proc = run_process("apply", "fusion", *where, "--no-gpu-check",
                       env={"SM120PATCH_KILL_AT": "after-close"})  # fmt: skip
    assert proc.returncode != 0
    assert cli("recover", *where)[0] == 0
    found = states(where)
    assert (found["sglang"]["state"], found["flashinfer"]["state"]) == ("applied", "pristine")
    code, _, err = cli("ensure", "fusion", *where, "--no-gpu-check")
    assert code == 0, err
    assert states(where)["flashinfer"]["state"] == "applied"
    # SGLang alone reverted; an apply killed mid-write over the recorded FlashInfer: recover
    # rolls SGLang back and leaves FlashInfer's record, which still holds, and ensure applies.
    assert cli("revert", "fusion", "--sglang", str(sg))[0] == 0
    assert states(where)["flashinfer"]["state"] == "applied"
    proc = run_process("apply", "fusion", *where, "--no-gpu-check",
                       env={"SM120PATCH_KILL_AT": "after-write"})  # fmt: skip
    assert proc.returncode != 0
    code, out, err = cli("recover", *where)
    assert code == 0, err
    found = states(where)
    assert (found["sglang"]["state"], found["flashinfer"]["state"]) == ("pristine", "applied")
    assert cli("ensure", "fusion", *where, "--no-gpu-check")[0] == 0
    assert {t["state"] for t in states(where).values()} == {"applied"}


def test_a_record_that_does_not_name_the_patches_files_is_planned_again(pair):
    """The record is state, not instruction: one that does not check every file the profile's
    patches read (edited, or written before a pack added a patch) does not make the target as
    wanted; ensure plans it again and writes a whole record."""
    layout, sg, fi, where = pair
    assert cli("apply", "fusion", *where, "--no-gpu-check")[0] == 0
    st = TargetState.of(find("flashinfer", fi).root, layout, "flashinfer")
    doc = json.loads((st.dir / "manifest.json").read_text())
    whole = doc["checked"]
    assert [c["module"] for c in whole] == sorted(catalog.load().patches["flashinfer.comm-arch"].files)
    (st.dir / "manifest.json").write_text(json.dumps({**doc, "checked": []}))
    code, out, err = cli("ensure", "fusion", *where, "--no-gpu-check")
    assert code == 0, err
    assert "does not name the files its patches read now" in out
    assert json.loads((st.dir / "manifest.json").read_text())["checked"] == whole
