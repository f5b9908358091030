"""`revert --dry-run`: the revert's own preflight, refusing as the revert does, and a diff that
is exactly what the revert writes back; nothing written anywhere."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from test_states import SERVER_ARGS, cli, error_lines, everything, module_path, pair, where  # noqa: F401
from trees import git, make_tree, tree_hash

from sm120patch.engine import store


def test_the_diff_is_what_the_revert_writes_back(pair, tmp_path):  # noqa: F811
    layout, sg, fi = pair
    pristine = [tree_hash(sg), tree_hash(fi)]
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0
    before = everything(tmp_path)
    code, diff, err = cli("revert", "--all", *where(sg, fi), "--dry-run")
    assert code == 0, err
    assert everything(tmp_path) == before  # no journal, no lock file, no branch switch
    assert "the revert would restore 2 file(s)" in err and "diff --git" in diff
    # Applied to a copy of the patched trees, the diff gives the trees the revert gives.
    copies = []
    for root in (sg, fi):
        copy = tmp_path / "copy" / root.name
        shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".git", ".sm120patch"))
        copies.append(copy)
    for copy, kind in zip(copies, ("sglang", "flashinfer"), strict=True):
        mine = "".join(d for d in diff.split("diff --git")[1:] if f"/{kind}/" in d.split("\n")[0])
        # Paths in the diff are the target's own (python/sglang/... in a checkout).
        subprocess.run(["git", "apply", "-"], input="diff --git" + mine, text=True, cwd=copy,
                       check=True)  # fmt: skip
    assert cli("revert", "--all", *where(sg, fi))[0] == 0
    assert [tree_hash(sg), tree_hash(fi)] == pristine
    for root, copy in zip((sg, fi), copies, strict=True):
        for f in (p for p in copy.rglob("*.py")):
            assert f.read_bytes() == (root / f.relative_to(copy)).read_bytes(), f


def test_json_says_what_the_revert_would_do(pair):  # noqa: F811
    layout, sg, fi = pair
    assert cli("apply", "moe", *where(sg, fi), "--no-gpu-check", "--force")[0] == 0
    code, out, _ = cli("revert", "moe", *where(sg, fi), "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] is True and doc["action"] == "reverted"
    assert doc["changed"] is True and "-" in doc["diff"]
    assert cli("revert", "moe", *where(sg, fi))[0] == 0
    code, out, _ = cli("revert", "moe", *where(sg, fi), "--dry-run", "--json")
    doc = json.loads(out)
    assert doc["action"] == "nothing-to-do" and doc["changed"] is False and doc["diff"] == ""


def _drifted(sg, fi, layout):
    assert cli("apply", "all", *where(sg, fi), "--no-gpu-check")[0] == 0
    sa = module_path(sg, layout, "sglang", SERVER_ARGS)
    sa.write_text(sa.read_text() + "# edited after the apply\n")
    return ["all", *where(sg, fi)]


def _other_profile(sg, fi, layout):
    assert cli("apply", "moe", *where(sg, fi), "--no-gpu-check", "--force")[0] == 0
    return ["fusion", *where(sg, fi)]


def _unfinished(sg, fi, layout):
    assert cli("apply", "moe", *where(sg, fi), "--no-gpu-check", "--force")[0] == 0
    from sm120patch.targets import finding

    t = finding.find("sglang", sg)
    st = store.TargetState.of(t.root, t.layout, "sglang")
    (st.dir / "journal.json").write_text(json.dumps(
        {"schema": 1, "op": "apply", "files": [], "git": None, "peers": []}))  # fmt: skip
    return ["moe", *where(sg, fi)]


@pytest.mark.parametrize("make", [_drifted, _other_profile, _unfinished], ids=lambda f: f.__name__)
def test_the_dry_run_refuses_exactly_as_the_revert(make, pair, tmp_path):  # noqa: F811
    layout, sg, fi = pair
    args = make(sg, fi, layout)
    before = everything(tmp_path)
    dry = cli("revert", *args, "--dry-run")
    assert everything(tmp_path) == before
    real = cli("revert", *args)
    assert dry[0] == real[0] != 0, (dry, real)
    assert error_lines(dry[2]) == error_lines(real[2]) and error_lines(dry[2])


def test_force_shows_the_edit_it_would_discard(pair, tmp_path):  # noqa: F811
    layout, sg, fi = pair
    _drifted(sg, fi, layout)
    code, diff, err = cli("revert", "--all", *where(sg, fi), "--dry-run", "--force")
    assert code == 0, err
    assert "-# edited after the apply\n" in diff


def test_a_held_lock_refuses_as_the_revert_does(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    st = store.TargetState.of(sg, "installed", "sglang")
    with st.locked():
        dry = cli("revert", "moe", "--sglang", str(sg), "--dry-run")
        real = cli("revert", "moe", "--sglang", str(sg))
    assert dry[0] == real[0] == 1 and error_lines(dry[2]) == error_lines(real[2])


def test_a_stale_record_is_only_dropped(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    git(sg, "checkout", "-q", "main")
    git(sg, "branch", "-D", "sm120patch/moe")
    before = everything(tmp_path)
    code, diff, err = cli("revert", "moe", "--sglang", str(sg), "--dry-run")
    assert code == 0 and diff == "" and "the revert would drop the record" in err, err
    assert everything(tmp_path) == before
    code, out, _ = cli("revert", "moe", "--sglang", str(sg))
    assert code == 0 and "dropped the record" in out
