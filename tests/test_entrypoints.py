"""The entry-point scan finds what `importlib.metadata.entry_points(group=...)` finds."""

from __future__ import annotations

import sys
import zipfile
from importlib import metadata

import pytest

from sm120patch.plan import entrypoints

GROUP = "sm120patch.patches"


def stdlib(group: str) -> list[tuple[str, str]]:
    return sorted((ep.name, ep.value) for ep in metadata.entry_points(group=group))


def ours(group: str, path: list[str] | None = None) -> list[tuple[str, str]]:
    return sorted((ep.name, ep.value) for ep in entrypoints.entry_points(group, path))


def dist(site, dirname: str, text: str | None) -> None:
    info = site / dirname
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Name: {dirname.split('-')[0]}\nVersion: 1\n")
    if text is not None:
        (info / "entry_points.txt").write_text(text)


@pytest.mark.parametrize("group", ["console_scripts", "pytest11", GROUP])
def test_same_as_the_standard_library_on_this_environment(group):
    assert ours(group) == stdlib(group)


def test_same_as_the_standard_library_on_awkward_layouts(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    # The same distribution twice (names normalise alike): the first on the path wins.
    dist(first, "Pack_A-1.0.dist-info", f"[{GROUP}]\na = pack_a.patches\n")
    dist(second, "pack.a-2.0.dist-info", f"[{GROUP}]\nshadowed = pack_a.old\n")
    # Comments, blank lines, other groups, an attribute and extras, an egg-info directory.
    dist(first, "b-0.1.dist-info",
         f"# comment\n\n[console_scripts]\nb = b.cli:main\n\n[{GROUP}]\n"
         " b_pack = b.pack:PACK.inner [extra]\n")  # fmt: skip
    dist(second, "c.egg-info", f"[{GROUP}]\nc=c_pack\n")
    dist(second, "d-1.dist-info", None)  # no entry_points.txt
    (second / "e-1.egg-info").write_text("Name: e\n")  # an egg-info file, not a directory
    path = [str(first), str(tmp_path / "missing"), str(second)]
    monkeypatch.setattr(sys, "path", path)
    for group in (GROUP, "console_scripts"):
        assert ours(group) == stdlib(group)
    assert ours(GROUP) == [("a", "pack_a.patches"), ("b_pack", "b.pack:PACK.inner [extra]"),
                           ("c", "c_pack")]  # fmt: skip


def test_a_zip_on_the_path_goes_to_the_standard_library(tmp_path, monkeypatch):
    archive = tmp_path / "packs.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("z-1.dist-info/METADATA", "Name: z\nVersion: 1\n")
        z.writestr("z-1.dist-info/entry_points.txt", f"[{GROUP}]\nz = z_pack\n")
    monkeypatch.setattr(sys, "path", [str(archive)])
    assert ours(GROUP) == stdlib(GROUP) == [("z", "z_pack")]


def test_load_follows_module_and_attributes(tmp_path, monkeypatch):
    pkg = tmp_path / "ep_target"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class PACK:\n    inner = 'found'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = entrypoints.EntryPoint("x", "ep_target:PACK.inner [extra]", GROUP)
    assert ep.load() == "found"
    assert entrypoints.EntryPoint("x", "ep_target", GROUP).load().__name__ == "ep_target"
    with pytest.raises(ValueError, match="not `module"):
        entrypoints.EntryPoint("x", "not a value!", GROUP).load()
