"""One release table: the patches' facts are the only place a release range is written. What
other places need of it is derived from them (a patch's files, the release cache's site files
and full range, where each explain reader looks) or held to them (the default releases of the
real tier, in tests/real/test_facts.py, which needs the index's listing)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from sm120patch.maintain import releases, trees
from sm120patch.patchkit.facts import Fact, Status
from sm120patch.patchkit.model import Patch, files_of
from sm120patch.plan import catalog

PROBE = Path(__file__).resolve().parents[1] / "sm120patch" / "explain" / "probe.py"


def library() -> list[Patch]:
    cat = catalog.load()
    return [p for p in cat.patches.values() if cat.sources[p.id].built_in]


def test_a_patch_reads_the_files_its_facts_name() -> None:
    for patch in library():
        assert patch.files == files_of(patch.facts), patch.id
    fact = Fact(releases=">=1", status=Status.APPLIED, shape="s", file="pkg/new.py")
    old = Fact(releases="<1", status=Status.APPLIED, shape="s", file="pkg/old.py")
    made = Patch(id="t.p", target="sglang", title="t", why="w", marker="m",
                 transform=lambda m: None, facts=(old, fact))  # type: ignore[arg-type,return-value]
    assert made.files == ("pkg/new.py", "pkg/old.py")  # the newest release's first


def test_no_library_patch_lists_its_files_by_hand() -> None:
    """The library's `Patch(...)` calls leave `files` to the facts."""
    library_dir = Path(__file__).resolve().parents[1] / "patches"
    for path in sorted(library_dir.glob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Patch"]
        assert all(k.arg != "files" for c in calls for k in c.keywords), path.name


def test_the_catalog_refuses_a_fact_on_a_file_the_patch_does_not_read() -> None:
    from sm120patch.plan.registry import patch_problems as _patch_problems

    patch = library()[0]
    stray = replace(patch, facts=(*patch.facts, Fact(releases=">=99", status=Status.APPLIED,
                                                     shape="s", file="pkg/x.py")))
    assert any("pkg/x.py" in p for p in _patch_problems(stray))
    assert not _patch_problems(patch)


@pytest.mark.parametrize("kind", releases.KINDS)
def test_the_release_cache_holds_every_file_a_fact_names(kind: str) -> None:
    named = {f.file for p in library() if p.target == kind for f in p.facts if f.file}
    assert named <= set(trees.site_files(kind)) <= set(trees.wanted_files(kind))


@pytest.mark.parametrize("kind", releases.KINDS)
def test_the_full_range_spans_every_fact_and_every_pin(kind: str) -> None:
    full = SpecifierSet(releases.full_range(kind))
    cat = catalog.load()
    specs = [SpecifierSet(f.releases) for p in cat.patches.values() if p.target == kind
             for f in p.facts]
    specs += [p.pins[kind] for p in cat.profiles.values() if kind in p.pins]
    for spec in specs:
        for s in spec:
            if s.operator in (">=", "=="):
                assert full.contains(s.version, prereleases=True), (spec, full)
    # Below the range no fact holds; a fact further down widens it.
    low = min((s.version for spec in specs for s in spec if s.operator in (">=", "==")),
              key=lambda v: tuple(int(x) for x in v.split(".")[:3]))
    assert releases.full_range(kind).startswith(f">={low},")


def test_a_fact_below_the_range_widens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cat = catalog.load()
    patch = cat.patches["sglang.pcie-allreduce"]
    older = replace(patch, facts=(Fact(releases=">=0.3.0,<0.4.6", status=Status.REFUSED,
                                       shape="s"), *patch.facts))
    wider = replace(cat, patches={**cat.patches, patch.id: older})
    monkeypatch.setattr(catalog, "load", lambda: wider)
    assert releases.full_range("sglang") == ">=0.3.0,<0.5.24"


# ---- the explain probe: where each reader looks comes from its patch's facts


def modules(patch: Patch) -> tuple[str, ...]:
    return tuple(f.removesuffix(".py").replace("/", ".") for f in patch.files)


def test_each_explain_reader_looks_where_its_facts_say() -> None:
    """The probe names no site of its own: each reader gets its modules (the patch's files,
    newest first) and functions (the facts', newest first) from its patch."""
    from sm120patch.explain import explain

    cat = catalog.load()
    sent = explain.reader_requests(("sglang", "flashinfer", "vllm"))
    assert {r["patch"] for r in sent} == {p.id for p in cat.patches.values() if p.explain}
    for reader in sent:
        patch = cat.patches[reader["patch"]]
        assert tuple(reader["modules"]) == modules(patch)
        newest_first = [f.function for f in reversed(patch.facts) if f.function]
        assert reader["functions"] == list(dict.fromkeys(newest_first))
    gate = next(r for r in sent if r["name"] == "gate")
    assert gate["modules"] == ["sglang.srt.layers.layer_boundary.residual.add_norm",
                               "sglang.srt.layers.communicator"]
    text = PROBE.read_text(encoding="utf-8")
    for patch in (cat.patches[r["patch"]] for r in sent):
        for name in (*modules(patch), *(f.function for f in patch.facts if f.function)):
            assert name not in text, (patch.id, name)
