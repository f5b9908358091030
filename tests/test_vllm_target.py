"""vLLM as a target: found installed (dist-info version, RECORD hashes) and as a checkout
(setuptools-scm from its tags, an editable install's record), and looked for only when named."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
import trees
from click.testing import CliRunner
from trees import VLLM_SCM_PYPROJECT, commit_all, init_repo, make_tree

from sm120patch.cli import main
from sm120patch.errors import Refused
from sm120patch.targets import finding
from sm120patch.targets.installed import record_hashes
from sm120patch.targets.resolved import Resolved


def _record_line(parent: Path, rel: str) -> str:
    digest = hashlib.sha256((parent / rel).read_bytes()).digest()
    return f"{rel},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},0"


def installed_vllm(tmp_path: Path, version: str = "0.34.0") -> Path:
    site = make_tree(tmp_path, "vllm", version, "installed")
    rels = sorted(p.relative_to(site).as_posix() for p in (site / "vllm").rglob("*.py"))
    info = site / f"vllm-{version}.dist-info"
    (info / "RECORD").write_text("\n".join(_record_line(site, r) for r in rels) + "\n")
    return site


def test_an_installed_vllm_is_read_from_its_dist_info(tmp_path):
    site = installed_vllm(tmp_path)
    found = finding.find("vllm", site)
    assert (found.kind, found.layout, found.version) == ("vllm", "installed", "0.34.0")
    assert found.version_source == "vllm-0.34.0.dist-info/METADATA"
    assert found.name == "vLLM" and found.package_dir == site.resolve() / "vllm"
    hashes = record_hashes(found)
    gate = "vllm/platforms/gates.py"
    assert hashes[gate] == hashlib.sha256((site / gate).read_bytes()).hexdigest()
    assert set(hashes) == {"vllm/__init__.py", "vllm/platforms/__init__.py", gate}


def vllm_repo(tmp_path: Path) -> Path:
    """A vLLM-shaped checkout: the package at the root, setuptools-scm's record ignored."""
    root = tmp_path / "vllm"
    for rel, text in trees.VLLM_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "pyproject.toml").write_text(VLLM_SCM_PYPROJECT)
    (root / ".gitignore").write_text("vllm/_version.py\n")
    init_repo(root)
    commit_all(root, "first")
    return root


def test_a_vllm_checkout_at_its_tag_is_that_release_and_past_it_a_dev_build(tmp_path):
    root = vllm_repo(tmp_path)
    trees.git(root, "tag", "-a", "-m", "v0.33.0", "v0.33.0")
    found = finding.find("vllm", root)
    assert (found.layout, found.version) == ("git", "0.33.0")
    assert found.version_source == "pyproject.toml at HEAD: setuptools-scm, tag v0.33.0"
    (root / "vllm" / "extra.py").write_text("")
    commit_all(root, "work past the release")
    commit_all(root, "more work")
    found = finding.find("vllm", root)
    # setuptools-scm's guess-next-dev and node-and-date on a clean commit: what `pip install
    # -e` records for it.
    assert found.version == f"0.33.1.dev2+g{trees.git(root, 'rev-parse', 'HEAD')[:9]}"


def test_a_vllm_checkout_without_tags_reads_its_editable_record(tmp_path):
    root = vllm_repo(tmp_path)
    assert finding.find("vllm", root).version == "unknown"
    (root / "vllm" / "_version.py").write_text(
        "__version__ = version = '0.34.1.dev7+gabcdef012'\n"
        "__version_tuple__ = version_tuple = (0, 34, 1, 'dev7', 'gabcdef012')\n"
    )
    found = finding.find("vllm", root)
    assert (found.version, found.version_source) == (
        "0.34.1.dev7+gabcdef012", "vllm/_version.py, written by its editable install")  # fmt: skip


def test_a_vllm_is_looked_for_only_when_named(tmp_path, monkeypatch):
    site = installed_vllm(tmp_path)
    monkeypatch.syspath_prepend(str(site))  # importable here: still not looked for unnamed
    asked: list[str] = []
    real = finding.find
    monkeypatch.setattr(finding, "find",
                        lambda kind, path, stated=None: asked.append(kind) or real(kind, path))
    assert Resolved({}).quiet("vllm") is None and "vllm" not in asked
    assert [t.kind for t in Resolved({"vllm": site}).each(("vllm",))] == ["vllm"]
    # A profile needing one it was not given refuses: the command line names the vLLM it patches.
    with pytest.raises(Refused, match="looked for only where the command names it"):
        Resolved({}).quiet("vllm", required=True)
    assert asked == ["vllm"]  # the named one only


def test_status_lists_a_named_vllm(tmp_path):
    site = installed_vllm(tmp_path)
    result = CliRunner().invoke(main, ["status", "--vllm", str(site), "--json"])
    assert result.exit_code == 0, result.output
    [listed] = [t for t in json.loads(result.output)["targets"] if t["kind"] == "vllm"]
    assert (listed["version"], listed["state"]) == ("0.34.0", "pristine")
    stated = CliRunner().invoke(main, ["status", "--vllm", str(site), "--vllm-version", "0.34.0",
                                       "--json"])  # fmt: skip
    [listed] = [t for t in json.loads(stated.output)["targets"] if t["kind"] == "vllm"]
    assert listed["version_source"] == "--vllm-version"
    bad = CliRunner().invoke(main, ["status", "--vllm", str(tmp_path / "nothing")])
    assert bad.exit_code == 2 and "--vllm" in bad.output and "Traceback" not in bad.output
