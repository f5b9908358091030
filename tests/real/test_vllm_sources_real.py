"""vLLM's pinned releases in the release cache as their sources (maintain/sources.py): fetched
from the index by range requests where it answers them, checked here independently: the .py
files there, no compiled file, every kept file's sha256 the wheel's RECORD says, no wheel kept,
and the tree found as an installed vLLM of that release."""

from __future__ import annotations

import base64
import csv
import hashlib

import pytest

from sm120patch.maintain import releases, sources, trees
from sm120patch.targets import finding

pytestmark = pytest.mark.real

PINNED = releases.DEFAULT_RELEASES["vllm"]


@pytest.fixture(scope="module")
def reachable() -> None:
    if not releases.index_reachable():
        pytest.skip(f"the index ({releases.index_sources()}) is unreachable: vLLM's sources "
                    "are fetched from it")  # fmt: skip


@pytest.mark.parametrize("version", PINNED)
def test_a_pinned_vllm_is_kept_as_its_sources(version: str, reachable: None) -> None:
    root = sources.tree("vllm", version)
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    py = {f for f in files if f.startswith("vllm/") and f.endswith(".py")}
    assert "vllm/__init__.py" in py and len(py) > 1000, len(py)
    assert not [f for f in files if f.endswith((".so", ".whl", ".cubin"))]
    [info] = [d for d in root.iterdir() if d.name.endswith(".dist-info")]
    assert info.name == f"vllm-{version}.dist-info"
    record = {row[0]: row[1] for row in csv.reader((info / "RECORD").read_text().splitlines())
              if len(row) >= 2}  # fmt: skip
    kept = files - {trees.TREE_RECORD, f"{info.name}/RECORD"}
    for rel in sorted(kept):
        digest = hashlib.sha256((root / rel).read_bytes()).digest()
        assert record[rel] == "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert not list(releases.cache_dir().rglob("vllm-*.whl"))
    found = finding.find("vllm", root)
    assert (found.layout, found.version) == ("installed", version)


def test_the_newest_vllm_as_a_tagged_checkout_reads_its_release(tmp_path, reachable: None) -> None:
    """The newest pinned release's sources in a repository shaped as upstream's (the package at
    the root, setuptools-scm's pyproject table, the release tagged v<version>)."""
    import shutil

    from trees import VLLM_SCM_PYPROJECT, commit_all, git, init_repo

    newest = max(PINNED, key=lambda v: tuple(int(x) for x in v.split(".")))
    root = tmp_path / "vllm"
    shutil.copytree(sources.tree("vllm", newest) / "vllm", root / "vllm")
    (root / "vllm" / "_version.py").unlink(missing_ok=True)  # a build's record, not tracked
    (root / "pyproject.toml").write_text(VLLM_SCM_PYPROJECT)
    init_repo(root)
    commit_all(root, newest)
    git(root, "tag", f"v{newest}")
    found = finding.find("vllm", root)
    assert (found.layout, found.version) == ("git", newest), found.version_source
