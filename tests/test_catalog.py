"""The catalog: the one place a profile is resolved and its pins checked; facts-derived
absent ranges; plan.check_pins kept working on top of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sm120patch.errors import UsageError
from sm120patch.plan import catalog
from sm120patch.plan.pins import check_pins


def test_a_profile_names_its_patches_and_what_is_outside_its_pins():
    cat = catalog.load()
    prof = cat.profile("all")
    assert [p.id for p in cat.patches_of(prof)] == list(prof.patches)
    assert catalog.pin_problems(prof, {"sglang": "0.5.7", "flashinfer": "0.6.1"}) == [
        "sglang 0.5.7 is outside the pins of profile all (sglang >=0.5.8,<0.5.24)"
    ]
    assert catalog.pin_problems(cat.profile("moe"), {"sglang": "0.5.9.post1"}) == []
    with pytest.raises(UsageError, match="unknown profile 'nope'; known profiles: all, attention, fp4-gemm, fusion"):
        cat.profile("nope")


def test_pin_problems_bad_version_and_labels():
    prof = catalog.load().profile("moe")
    [line] = catalog.pin_problems(prof, {"sglang": "banana"}, {"sglang": ("SGLang", "version.py")})
    assert line == (
        "SGLang version 'banana' (from version.py) is not a PEP 440 version; "
        "profile moe is pinned to >=0.5.8,<0.5.24"
    )
    # a kind the profile does not pin is not its business
    assert catalog.pin_problems(prof, {"flashinfer": "0.1"}) == []
    # ... but a release it refuses is (moe refuses FlashInfer before 0.6.7, with the reason)
    [refused] = catalog.refusal_problems(prof, {"flashinfer": "0.6.6.post1"})
    assert refused.startswith("profile moe refuses flashinfer 0.6.6.post1 (flashinfer <0.6.7): ")
    assert "issues/2723" in refused
    assert catalog.refusal_problems(prof, {"flashinfer": "0.6.7"}) == []


def test_a_profile_holding_a_refusing_profiles_patch_refuses_as_it_does():
    """A refusal protects the patches of its profile: another profile that holds all of them
    (all holds moe's) carries the same refusal, else it would apply what the first refuses."""
    profiles = catalog.load().profiles
    missing = []
    for p in profiles.values():
        for q in profiles.values():
            if q is p or not set(p.patches) <= set(q.patches):
                continue
            for r in p.refuse:
                if not any(x.kind == r.kind and x.releases == r.releases for x in q.refuse):
                    missing.append(f"{q.name} lacks {p.name}'s refusal of {r.kind} {r.releases}")
    assert missing == []
    [line] = catalog.refusal_problems(profiles["all"], {"flashinfer": "0.6.1"})
    assert line.startswith("profile all refuses flashinfer 0.6.1 (flashinfer <0.6.7): ")


def test_pcie_allreduce_steps_aside_from_0_5_21():
    prof = catalog.load().profile("pcie-allreduce")
    assert catalog.refusal_problems(prof, {"sglang": "0.5.20"}) == []
    [line] = catalog.refusal_problems(prof, {"sglang": "0.5.21"})
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in line


@pytest.mark.parametrize("table", [
    'reason = "no kind"',
    'sglang = ">=0.5.21"\nflashinfer = "<0.6.7"\nreason = "two kinds"',
    'sglang = ">=0.5.21"',
    'sglang = ">=0.5.21"\nreason = "r"\nhint = "unknown key"',
    'sglang = "banana"\nreason = "r"',
])
def test_a_bad_refuse_table_is_refused(table):
    text = (
        'schema = 1\n[profiles.p]\npatches = []\n[profiles.p.pins]\nsglang = ">=0.5.8"\n'
        f"[[profiles.p.refuse]]\n{table}\n"
    )
    with pytest.raises(RuntimeError, match="profile p"):
        catalog.parse_profiles(text, {})


def test_check_pins_keeps_its_signature_and_messages():
    prof = catalog.load().profile("fusion")
    target = SimpleNamespace(kind="flashinfer", name="FlashInfer", version="0.3.0",
                             version_source="METADATA")
    assert check_pins(prof, [target]) == [
        "FlashInfer 0.3.0 is outside the pins of profile fusion (flashinfer >=0.3.1,<0.7.5)"
    ]


def test_absent_comes_from_facts_and_from_the_profile_table():
    cat = catalog.load()
    assert not cat.profile("moe").absent  # profiles.toml declares no absent table any more
    assert cat.profile("all").absent_ok("sglang.moe-backend", "0.5.7.post1")
    assert not cat.profile("all").absent_ok("sglang.sm120-flag", "0.5.7")
    text = """
schema = 1
[profiles.x]
patches = ["sglang.sm120-flag"]
[profiles.x.pins]
sglang = ">=0.5.4"
[profiles.x.absent]
"sglang.sm120-flag" = "<0.5.8"
"""
    prof = catalog.parse_profiles(text, cat.patches)["x"]
    assert prof.absent_ok("sglang.sm120-flag", "0.5.7")
    assert not prof.absent_ok("sglang.sm120-flag", "0.5.8")


def test_outside_the_pins_the_hint_asks_for_a_pinned_release(tmp_path):
    from trees import make_tree

    from sm120patch.errors import Refused
    from sm120patch.plan import pins

    sg = make_tree(tmp_path, "sglang", "0.5.3", "installed")
    prof = catalog.load().profile("moe")
    found = pins.resolve_targets(prof, {"sglang": sg})
    with pytest.raises(Refused) as exc:
        pins.require_pins(prof, found, {"sglang": sg}, force=False, verb="pin")
    assert exc.value.hint == "use a pinned release, or pin anyway: `sm120patch <again> --force`"
    pins.require_pins(prof, found, {"sglang": sg}, force=True, verb="pin")  # forced: no refusal


def test_every_patch_id_fits_the_column_the_outcome_lines_give_it():
    from sm120patch import render

    longest = max(catalog.load().patches, key=len)
    assert len(longest) < render.PATCH_WIDTH, longest


LISTING = """
import json, sys
from sm120patch.cmdline import profiles as render
from sm120patch.plan import catalog
cat = catalog.load()
lines = render.profiles_text(cat).out
doc = render.profiles_doc(cat)
print(json.dumps({"lines": len(lines), "patches": len(doc["patches"]),
                  "libcst": "libcst" in sys.modules,
                  "modules": [m for m in sys.modules if m.startswith("sm120patch.patches.")]}))
"""


def test_loading_the_catalog_and_listing_its_profiles_imports_no_patch_module():
    """The registry knows every patch by its row: `list` (text and JSON) shows every profile
    and patch without importing a patch module, so without libcst, which they import at their
    top. Asking for a patch imports its module then, and only its."""
    import json
    import subprocess
    import sys

    ran = subprocess.run([sys.executable, "-c", LISTING], capture_output=True, text=True,
                         check=True)
    seen = json.loads(ran.stdout)
    assert seen["patches"] == len(catalog.load().patches) > 20 and seen["lines"] > 40
    assert seen["modules"] == [] and seen["libcst"] is False

    from sm120patch.plan.registry import Registry

    registry = Registry(catalog.load().patches.rows.values())
    assert registry.imported() == []
    assert registry["sglang.fusion-gate"].title == registry.rows["sglang.fusion-gate"].title
    assert registry.imported() == ["sglang.fusion-gate"]


def test_a_module_that_disagrees_with_its_row_is_refused_when_imported(tmp_path):
    """A title changed in the module alone: the catalog loads (it reads rows), and asking for
    the patch refuses the pack in one line naming what differs."""
    import shutil
    from pathlib import Path

    library = tmp_path / "library"
    shutil.copytree(Path(catalog.__file__).parents[2] / "patches", library,
                    ignore=shutil.ignore_patterns("__pycache__"))
    module = library / "sglang_fusion_gate.py"
    text = module.read_text()
    title = 'title="Let the FlashInfer allreduce-fusion gate pass on SM120",'
    assert title in text
    module.write_text(text.replace(title, 'title="Another title",'))
    cat = catalog._combine([catalog._load_dir(str(library))])
    assert cat.patches.rows["sglang.fusion-gate"].title != "Another title"
    with pytest.raises(catalog.PackError, match="sglang_fusion_gate's PATCH has title 'Another title' where registry.toml has"):
        cat.patches["sglang.fusion-gate"]


def test_every_module_of_the_library_has_its_row_and_agrees_with_it():
    """A module the registry does not list would never load: each patch module of the library
    has a row, and each row's module, imported, agrees with it (the registry refuses one that
    does not)."""
    from pathlib import Path

    from sm120patch.plan.registry import Registry

    library = Path(catalog.__file__).parents[2] / "patches"
    modules = {p.stem for p in library.glob("*.py") if p.stem != "__init__"}
    rows = catalog.load().patches.rows
    assert {r.module.rsplit(".", 1)[-1] for r in rows.values()} == modules
    fresh = Registry(rows.values())
    assert [fresh[pid].id for pid in rows] == list(rows)
