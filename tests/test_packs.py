"""Patch packs from outside (entry points, --patches DIR, SM120PATCH_PATCHES): validated like the
built-in library, one line naming the pack otherwise; where each patch comes from; new-patch."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.specifiers import SpecifierSet

from sm120patch.cli import main
from sm120patch.plan import catalog, lockfile

MODULE = '''
from sm120patch.patchkit.facts import Fact
from sm120patch.patchkit.model import Patch, Status, not_applicable

FACTS = (Fact(releases=">=0.6.1", status=Status.NOT_APPLICABLE, shape="nothing"),)


def transform(module):
    return not_applicable("f", "a test pack")


PATCH = Patch(id={pid!r}, target="flashinfer", title="t", why="w", files=("flashinfer/x.py",),
              marker="def f", transform=transform, facts=FACTS)
'''
PROFILES = '''
schema = 1

[profiles.{name}]
patches = [{patches}]

[profiles.{name}.pins]
flashinfer = "{pins}"
'''


@pytest.fixture(autouse=True)
def no_pack_left(monkeypatch):
    monkeypatch.delenv(catalog.PACKS_ENV, raising=False)


def make_pack(root: Path, pid: str = "flashinfer.extra", *, name: str = "extra",
              patches: str | None = None, pins: str = ">=0.6.1", module: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "extra_patch.py").write_text(module if module is not None else MODULE.format(pid=pid))
    (root / "profiles.toml").write_text(
        PROFILES.format(name=name, patches=patches if patches is not None else f'"{pid}"',
                        pins=pins)
    )
    return root


def cli(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_directory_pack_loads_and_list_says_where_from(tmp_path):
    pack = make_pack(tmp_path / "p")
    code, out, err = cli("--patches", str(pack), "list", "--json")
    assert code == 0, err
    doc = json.loads(out)
    src = {p["id"]: p["source"] for p in doc["patches"]}
    assert src["flashinfer.extra"] == f"directory {pack.resolve()}"
    assert src["sglang.moe-backend"] == "built-in"
    assert {p["name"]: p["source"] for p in doc["profiles"]}["extra"].startswith("directory ")
    code, out, err = cli("--patches", str(pack), "list")
    assert "flashinfer.extra" in out and f"(from directory {pack.resolve()})" in out
    # Without --patches it is gone again (the option is per invocation).
    code, out, _ = cli("list", "--json")
    assert "flashinfer.extra" not in out


def test_environment_variable_adds_packs(tmp_path, monkeypatch):
    pack = make_pack(tmp_path / "p")
    monkeypatch.setenv(catalog.PACKS_ENV, str(pack))
    assert catalog.load().source("flashinfer.extra").name == f"directory {pack.resolve()}"
    assert catalog.load().profile("extra").patches == ("flashinfer.extra",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pid": "flashinfer.comm-arch"},
         "two patches declare the id flashinfer.comm-arch (also in built-in)"),
        ({"pins": ">=0.6.1,<<"}, "profiles.toml: profile extra: Invalid specifier"),
        ({"patches": '"flashinfer.nowhere"'},
         "profiles.toml: profile extra names unknown patch flashinfer.nowhere"),
        ({"name": "moe"}, "profiles.toml: profile moe is also defined in built-in"),
        ({"module": "import not_a_module_anywhere\n"},
         "module extra_patch does not import (ModuleNotFoundError"),
        ({"module": MODULE.format(pid="x.y").replace('target="flashinfer"', 'target="tensorrt"')},
         "patch x.y: target 'tensorrt' is not one of sglang, flashinfer, vllm"),
    ],
    ids=["duplicate-id", "bad-pins", "unknown-patch", "duplicate-profile", "import-error",
         "bad-target"],
)
def test_invalid_pack_is_one_line_naming_it(tmp_path, kwargs, message):
    pack = make_pack(tmp_path / "bad", **kwargs)
    code, out, err = cli("--patches", str(pack), "list")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) >= 2 and all(x.startswith("  ") for x in lines[1:])  # what to do
    assert lines[0].startswith(f"sm120patch: patch pack directory {pack.resolve()}: ")
    assert message in lines[0]
    assert "Traceback" not in err


def test_missing_directory(tmp_path):
    code, _, err = cli("--patches", str(tmp_path / "nope"), "list")
    assert code == 2 and f"patch pack directory {tmp_path / 'nope'}: is not a directory" in err


def test_entry_point_pack(tmp_path, monkeypatch):
    """A distribution's `sm120patch.patches` entry point names a package laid out as a pack."""
    pkg = make_pack(tmp_path / "site" / "thirdparty_pack", pid="flashinfer.third")
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))

    class EntryPoint:
        name = "thirdparty"

        def load(self):
            import importlib

            return importlib.import_module("thirdparty_pack")

    monkeypatch.setattr(catalog, "_entry_points", lambda: [EntryPoint()])
    catalog._load.cache_clear()
    try:
        cat = catalog.load()
        assert cat.source("flashinfer.third").name == "entry point thirdparty"
        assert cat.profile_sources["extra"].name == "entry point thirdparty"
        code, out, err = cli("show", "extra")
        assert code == 0, err
        assert "flashinfer.third (flashinfer, entry point thirdparty): t" in out
    finally:
        catalog._load.cache_clear()


def test_entry_point_that_does_not_import(monkeypatch):
    class Broken:
        name = "broken"

        def load(self):
            raise ImportError("no module named thirdparty")

    monkeypatch.setattr(catalog, "_entry_points", lambda: [Broken()])
    catalog._load.cache_clear()
    try:
        code, _, err = cli("list")
        assert code == 2
        assert "sm120patch: patch pack entry point broken: does not import (ImportError" in err
    finally:
        catalog._load.cache_clear()


# ---- new-patch --------------------------------------------------------------------------------


def test_new_patch_writes_module_facts_profile_and_test(tmp_path):
    pack = tmp_path / "pack"
    args = ["new-patch", "flashinfer.moe-arch", "--target", "flashinfer", "--file",
            "flashinfer/jit/fused_moe.py", "--function", "gen_trtllm_gen_fused_moe_sm100_module",
            "--pins", ">=0.6.1,<0.6.16", "--keyword", "supported_major_versions",
            "--expect", "10", "--add", "12", "--dir", str(pack)]
    code, out, err = cli(*args)
    assert code == 0, err
    module = (pack / "flashinfer_moe_arch.py").read_text()
    assert "FACTS = (" in module and "op.extend_keyword_list(" in module
    cat = catalog._combine([catalog._load_dir(str(pack))])
    patch = cat.patches["flashinfer.moe-arch"]
    assert patch.facts[0].releases == ">=0.6.1,<0.6.16"
    assert cat.profile("moe-arch").pins["flashinfer"] == SpecifierSet(">=0.6.1,<0.6.16")
    # The example: one element, `[10]` -> `[10, 12]` with its space.
    from sm120patch.patchkit.runner import transform_text

    res = transform_text([patch], "f.py", "def gen_trtllm_gen_fused_moe_sm100_module():\n"
                                          "    return g(supported_major_versions=[10])\n")
    assert "supported_major_versions=[10, 12])" in res.after
    # A second run refuses to overwrite; a second patch joins the same pack.
    code, _, err = cli(*args)
    assert code == 2 and "exists" in err
    code, _, err = cli("new-patch", "sglang.other-site", "--target", "sglang", "--file",
                       "sglang/srt/x.py", "--function", "f", "--pins", ">=0.5.8",
                       "--dir", str(pack))
    assert code == 0, err
    both = catalog._combine([catalog._load_dir(str(pack))])
    assert set(both.profiles) == {"moe-arch", "other-site"}
    # The skeleton without an operation refuses (its transform is for the author to write).
    [outcome] = transform_text([both.patches["sglang.other-site"]], "x.py", "def f():\n  pass\n"
                               ).outcomes
    assert outcome.status.value == "refused" and "none written yet" in outcome.reason


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pins", "<<1"], "pins '<<1' are not a PEP 440 specifier"),
        (["--pins", ">=1", "--keyword", "k"], "--keyword, --expect and --add go together"),
        (["--pins", ">=1", "--keyword", "k", "--expect", "a,b", "--add", "1"],
         "--expect 'a,b' is not a list of integers"),
    ],
)
def test_new_patch_bad_input(tmp_path, extra, message):
    code, _, err = cli("new-patch", "flashinfer.x", "--target", "flashinfer", "--file", "flashinfer/f.py",
                       "--function", "f", "--dir", str(tmp_path / "p"), *extra)
    assert code == 2 and message in err, err


def test_new_patch_writes_through_the_files_module(tmp_path):
    """A symbolic link at a name new-patch writes is replaced by the file, never followed (the
    files module's atomic replace), and --force keeps an existing file's mode."""
    pack, elsewhere = tmp_path / "pack", tmp_path / "elsewhere.py"
    pack.mkdir()
    elsewhere.write_text("kept\n")
    (pack / "flashinfer_x_arch.py").symlink_to(elsewhere)
    (pack / "profiles.toml").write_text("schema = 1\n")
    (pack / "profiles.toml").chmod(0o640)
    code, _, err = cli("new-patch", "flashinfer.x-arch", "--target", "flashinfer", "--file",
                       "flashinfer/x.py", "--function", "f", "--pins", ">=1", "--dir", str(pack),
                       "--force")  # fmt: skip
    assert code == 0, err
    assert elsewhere.read_text() == "kept\n"
    assert not (pack / "flashinfer_x_arch.py").is_symlink()
    assert "PATCH = Patch(" in (pack / "flashinfer_x_arch.py").read_text()
    assert (pack / "profiles.toml").stat().st_mode & 0o777 == 0o640


def test_new_patch_bad_id(tmp_path):
    code, _, err = cli("new-patch", "Bad Id", "--target", "flashinfer", "--file", "f.py",
                       "--function", "f", "--pins", ">=1", "--dir", str(tmp_path))
    assert code == 2 and "is not like 'flashinfer.moe-arch'" in err


def test_old_lock_without_pack_fields_reads_as_built_in(tmp_path):
    lock = tmp_path / "old.lock"
    lock.write_text(textwrap.dedent('''
        schema = 1
        profile = "moe"
        [versions]
        sglang = "0.5.8"
        [[patches]]
        id = "sglang.moe-backend"
        digest = "sha256:00"
    '''))
    read = lockfile.read(lock)
    assert read.pack_of == {"sglang.moe-backend": "built-in"} and read.packs == {}
    assert 'pack = "built-in"' in read.to_toml()


REGISTRY = '''
schema = 1

[patches."flashinfer.extra"]
module = "extra_patch"
target = "flashinfer"
title = "t"
files = ["flashinfer/x.py"]
'''


def test_a_pack_with_a_registry_loads_and_lists_without_importing_its_python(tmp_path):
    """A pack's registry.toml names its patches: a module that does not import leaves the
    pack loading and listing from its rows; the patch, once asked for, refuses the pack in one
    line. Without registry.toml the same module fails the pack as it loads."""
    pack = make_pack(tmp_path / "pack", module="raise RuntimeError('damaged')\n")
    with pytest.raises(catalog.PackError, match="module extra_patch does not import"):
        catalog._combine([catalog._load_dir(str(pack))])
    (pack / "registry.toml").write_text(REGISTRY)
    cat = catalog._combine([catalog._load_dir(str(pack))])
    assert cat.patches.rows["flashinfer.extra"].title == "t"
    assert cat.profile("extra").patches == ("flashinfer.extra",)
    with pytest.raises(catalog.PackError, match=r"patch pack directory .*: module extra_patch "
                       r"does not import \(RuntimeError: damaged\)"):
        cat.patches["flashinfer.extra"]
    # Repaired, the module is held to its row, then loads.
    (pack / "extra_patch.py").write_text(MODULE.format(pid="flashinfer.extra"))
    cat = catalog._combine([catalog._load_dir(str(pack))])
    assert cat.patches["flashinfer.extra"].files == ("flashinfer/x.py",)
    # A row that is not one: a line naming the file and the patch.
    (pack / "registry.toml").write_text(REGISTRY.replace('target = "flashinfer"', ""))
    with pytest.raises(catalog.PackError, match="registry.toml: patch flashinfer.extra: a row "
                       "holds exactly module, target, title and files"):
        catalog._load_dir(str(pack))
