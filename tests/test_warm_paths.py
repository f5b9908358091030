"""Warm paths without libcst: the commands that run most often (`status`, `ensure` and
`ensure --locked` at every service start, `revert`) decide from hashes on an applied tree, never
from a parse; `apply` plans, always (a lock is a claim held to that plan, not a plan). Each
command runs in a fresh interpreter that then reports whether libcst was imported. And `apply`
never enters the trial wing: known outcomes are data the plan wing reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trees import make_tree

from sm120patch.config import Config
from sm120patch.plan.diffs import apply_diff, diff_texts

PROBE = """
import json, sys
from sm120patch.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "libcst": "libcst" in sys.modules, "kit": sorted(
    m for m in sys.modules
    if m == "sm120patch.patchkit.model" or m.startswith("sm120patch.patches.")
)}), file=sys.stderr)
"""


def run(*args: str, cache: Path, kit: bool = False, packs: Path | None = None) -> dict:
    """The exit code and whether libcst was imported; with `kit`, also the patch modules and
    the kit's model that were imported (none on a warm `ensure`: the profile is read from
    profiles.toml)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "SM120PATCH_CACHE": str(cache),
             **({"SM120PATCH_PATCHES": str(packs)} if packs else {})},
    )
    out = json.loads(proc.stderr.strip().splitlines()[-1])
    if not kit:
        del out["kit"]
    return out


@pytest.fixture(params=["git", "installed"])
def trees(request, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", request.param)
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", request.param)
    return ["--sglang", str(sg), "--flashinfer", str(fi)], sg


def test_status_ensure_and_revert_on_an_applied_tree_need_no_parse(trees, tmp_path):
    where, sg = trees
    cache = tmp_path / "cache"
    assert run("apply", "all", *where, "--dry-run", "--no-gpu-check", cache=cache) == {
        "code": 0, "libcst": True}  # fmt: skip
    assert run("apply", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": True}
    assert run("status", *where, cache=cache) == {"code": 0, "libcst": False}
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache, kit=True) == {
        "code": 0, "libcst": False, "kit": []}  # fmt: skip
    assert run("revert", "--all", *where, cache=cache) == {"code": 0, "libcst": False}
    # Pristine again: ensure applies, and so plans.
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": True}
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache) == {"code": 0, "libcst": False}


def test_a_fleet_node_plans_each_locked_apply_and_holds_its_lock_without_a_parse(trees, tmp_path):
    where, sg = trees
    lock = tmp_path / "all.lock"
    assert run("pin", "all", *where, "-o", str(lock), cache=tmp_path / "reference")["code"] == 0
    node = tmp_path / "node-cache"
    # A lock is a claim, never a source of bytes: the node's own patches decide what is
    # written, so a locked apply plans ...
    assert run("apply", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": True}  # fmt: skip
    # ... and every service start after it holds the applied bytes to the lock from hashes,
    # without the patch modules or the kit's model.
    assert run("ensure", "--locked", str(lock), *where, "--no-gpu-check", cache=node, kit=True) == {
        "code": 0, "libcst": False, "kit": []}  # fmt: skip
    assert run("status", *where, cache=node) == {"code": 0, "libcst": False}
    assert run("revert", "--all", *where, cache=node) == {"code": 0, "libcst": False}
    assert run("apply", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": True}  # fmt: skip
    assert run("ensure", "--locked", str(lock), *where, "--no-gpu-check", cache=node) == {
        "code": 0, "libcst": False}  # fmt: skip


def test_ensure_on_an_applied_tree_answers_from_the_bytes_even_with_a_damaged_pack(tmp_path):
    """The bytes are the truth: a pack whose Python does not import leaves a tree as wanted as
    it was (no patch module is imported to say so); a plan, which needs the patches, refuses
    the pack in one line."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]
    cache = tmp_path / "cache"
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "broken.py").write_text("raise RuntimeError('damaged')\n")
    assert run("apply", "all", *where, "--no-gpu-check", cache=cache)["code"] == 0
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache, kit=True, packs=pack) == {
        "code": 0, "libcst": False, "kit": []}  # fmt: skip
    assert run("revert", "--all", *where, cache=cache)["code"] == 0
    # Pristine: ensure must plan, and the catalog refuses the damaged pack (a usage error).
    assert run("ensure", "all", *where, "--no-gpu-check", cache=cache, packs=pack)["code"] == 2


def test_the_light_profile_reader_agrees_with_the_catalog(tmp_path):
    """What `ensure` reads from profiles.toml is what the catalog makes of it; where the light
    reader cannot decide (a profile defined twice, a name it does not know) it says nothing
    and the catalog decides."""
    from sm120patch.plan import catalog, profiles

    cat = catalog.load()
    assert cat.profiles
    for name, prof in cat.profiles.items():
        spec = profiles.spec(name, Config())
        assert spec is not None, name
        assert spec == prof, name  # one model: every field but the facts the catalog adds
        assert not spec.facts and prof.facts, name
    assert profiles.spec("no-such-profile", Config()) is None
    pack = tmp_path / "pack"
    pack.mkdir()
    twice = next(iter(cat.profiles))
    (pack / "profiles.toml").write_text(
        f'schema = 1\n[profiles.{twice}]\npatches = []\npins = {{ sglang = ">=0.1" }}\n'
    )
    assert profiles.spec(twice, Config((str(pack),))) is None


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


def loaded_by(*args: str) -> list[str]:
    """The sm120patch modules a command loads, in a fresh interpreter (its exit code checked)."""
    proc = subprocess.run([sys.executable, "-c", STATUS_PROBE.replace("except SystemExit:\n    pass",
                           "except SystemExit as exc:\n    assert not exc.code, exc.code"), *args],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stderr.strip().splitlines()[-1])


def test_apply_and_its_dry_run_never_enter_the_trial_wing(trees):
    """The known outcomes an apply shows are data the plan wing reads (`plan.known`), and the
    trials recorded here are shown as recorded: nothing of sm120patch.trial loads. With the GPU
    check on, the GPUs are read through the NVML reader (`trial/gpu.py`), and nothing else of
    that wing."""
    where, _ = trees
    for args in (["apply", "all", "--dry-run", "--no-gpu-check", *where],
                 ["apply", "all", "--no-gpu-check", *where],
                 ["revert", "--all", *where]):  # fmt: skip
        loaded = loaded_by(*args)
        assert "sm120patch.plan.planner" in loaded or args[0] == "revert", args  # it planned
        assert not [m for m in loaded if m.startswith("sm120patch.trial")], (args, loaded)
    loaded = loaded_by("apply", "all", "--dry-run", *where)
    assert {m for m in loaded if m.startswith("sm120patch.trial")} <= {"sm120patch.trial",
                                                                        "sm120patch.trial.gpu"}


def test_ensure_on_an_applied_tree_loads_no_planner(trees, tmp_path):
    """`ensure` and `ensure --locked` at a service start find the tree as wanted from its hashes:
    the pins are checked (`plan/pins.py`), and the planner, its plans, the apply verb and the
    layouts that write load only when the tree is not yet as wanted."""
    where, _ = trees
    lock = tmp_path / "all.lock"
    assert run("pin", "all", *where, "-o", str(lock), cache=tmp_path / "cache")["code"] == 0
    loaded_by("apply", "all", "--no-gpu-check", *where)
    planning = {"sm120patch.plan.planner", "sm120patch.plan.plans", "sm120patch.engine.apply",
                "sm120patch.engine.layouts", "sm120patch.patchkit.runner"}  # fmt: skip
    for args in (["ensure", "all", "--no-gpu-check", *where],
                 ["ensure", "--locked", str(lock), "--no-gpu-check", *where]):  # fmt: skip
        loaded = loaded_by(*args)
        assert "sm120patch.plan.pins" in loaded, args  # it checked the pins
        assert not planning & set(loaded), (args, sorted(planning & set(loaded)))


GITPYTHON_PROBE = """
import sys
from sm120patch.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print("git" in sys.modules, file=sys.stderr)
"""


def test_a_checkout_never_opens_gitpython(tmp_path):
    """Git runs one way, plain git commands (`targets.run_git`): GitPython's import, with the
    two `git version` it runs, was about a tenth of a cold dry run. Neither the dry run nor
    the apply, which commits, imports it."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "git")
    where = ["--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check"]

    def opened(*args: str) -> bool:
        proc = subprocess.run([sys.executable, "-c", GITPYTHON_PROBE, *args],
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stderr.strip().splitlines()[-1].lower())

    assert opened("apply", "all", "--dry-run", *where) is False
    assert opened("apply", "all", *where) is False


def test_status_and_ensure_on_installed_packages_spawn_nothing(tmp_path):
    """On installed packages the warm commands run no git, so they do not import `subprocess`
    (with `selectors` and the rest, a few ms of every service start)."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]
    probe = GITPYTHON_PROBE.replace('"git" in sys.modules', '"subprocess" in sys.modules')
    assert run("apply", "all", "--no-gpu-check", *where, cache=tmp_path / "c")["code"] == 0
    for args in (["status", *where], ["ensure", "all", "--no-gpu-check", *where]):
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == "False", args
