"""The release cache on distributions we build here: no network, no upstream code."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from sm120patch import releases, targets


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SM120PATCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "dist").mkdir(parents=True)
    return tmp_path / "cache"


def make_wheel(dist: Path, name: str, version: str, files: dict[str, str]) -> Path:
    path = dist / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
        zf.writestr(f"{name}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nreadme\n")
    return path


def make_sdist(dist: Path, name: str, version: str, files: dict[str, str]) -> Path:
    path = dist / f"{name}-{version}.tar.gz"
    top = f"{name}-{version}"
    members = {**files, "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}
    with tarfile.open(path, "w:gz") as tf:
        for rel, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_cache_dir_from_env(cache: Path) -> None:
    assert releases.cache_dir() == cache
    assert releases.dist_dir() == cache / "dist"


def test_wheel_tree_holds_only_the_wanted_files(cache: Path) -> None:
    make_wheel(cache / "dist", "sglang", "0.5.8", {
        "sglang/__init__.py": "",
        "sglang/srt/server_args.py": "x = 1\r\n",  # line endings kept as released
        "sglang/srt/models/llama.py": "unrelated = True\n",
    })
    tree = releases.tree("sglang", "0.5.8")
    assert tree == cache / "trees" / "sglang-0.5.8"
    assert (tree / "sglang/srt/server_args.py").read_bytes() == b"x = 1\r\n"
    assert not (tree / "sglang/srt/models").exists()
    found = targets.find("sglang", tree)
    assert (found.version, found.layout) == ("0.5.8", "installed")
    assert "sglang/srt/server_args.py" in releases.tree_record(tree)["present"]
    # no temporary directories left behind
    assert sorted(p.name for p in (cache / "trees").iterdir() if p.is_dir()) == ["sglang-0.5.8"]


def test_sdist_tree_takes_pkg_info_as_metadata(cache: Path) -> None:
    make_sdist(cache / "dist", "flashinfer_python", "0.3.1", {
        "flashinfer/__init__.py": "",
        "flashinfer/comm/trtllm_ar.py": "def gen_trtllm_comm_module(): ...\n",
        "csrc/kernel.cu": "// not ours\n",
    })
    tree = releases.tree("flashinfer", "0.3.1")
    assert (tree / "flashinfer/comm/trtllm_ar.py").is_file()
    assert not (tree / "csrc").exists()
    found = targets.find("flashinfer", tree)
    assert found.version == "0.3.1"
    assert found.version_source == "flashinfer_python-0.3.1.dist-info/METADATA"


def test_stale_tree_is_rebuilt_whole(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(cache / "dist", "sglang", "0.5.9", {
        "sglang/__init__.py": "", "sglang/srt/server_args.py": "", "sglang/srt/new_site.py": "",
    })
    tree = releases.tree("sglang", "0.5.9")
    assert not (tree / "sglang/srt/new_site.py").exists()
    # A patch now reads one more file: the tree is rebuilt, by rename, with it.
    wanted = releases.wanted_files("sglang")
    monkeypatch.setattr(releases, "wanted_files", lambda kind: (*wanted, "sglang/srt/new_site.py"))
    assert releases.tree("sglang", "0.5.9") == tree
    assert (tree / "sglang/srt/new_site.py").is_file()
    assert sorted(p.name for p in (cache / "trees").iterdir() if p.is_dir()) == ["sglang-0.5.9"]


def test_tree_without_the_package_is_an_error(cache: Path) -> None:
    make_wheel(cache / "dist", "sglang", "0.5.7", {"other/__init__.py": ""})
    with pytest.raises(releases.ReleaseError, match="no sglang/__init__.py"):
        releases.tree("sglang", "0.5.7")
    assert not (cache / "trees" / "sglang-0.5.7").exists()


def test_fetch_reuses_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = make_wheel(cache / "dist", "sglang", "0.5.8", {"sglang/__init__.py": ""})

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(releases.subprocess, "run", no_network)
    assert releases.fetch("sglang", "0.5.8") == wheel


def test_pip_arguments_per_release() -> None:
    new = releases.pip_download_args("sglang", "0.5.11")
    assert new[1:4] == ["-m", "pip", "download"] and "--no-deps" in new
    assert {"--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
            "--only-binary=:all:"} <= set(new)
    old = releases.pip_download_args("sglang", "0.5.10")
    assert "--platform" not in old and "--only-binary=:all:" in old
    assert "flashinfer-python==0.6.1" in releases.pip_download_args("flashinfer", "0.6.1")
    assert releases.is_sdist_only("flashinfer", "0.4.1")
    assert not releases.is_sdist_only("flashinfer", "0.5.0")


def test_available_lists_final_releases_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["sglang-0.4.5-py3-none-any.whl", "sglang-0.4.6-py3-none-any.whl",
             "sglang-0.4.6.post1-py3-none-any.whl", "sglang-0.5.0rc0-py3-none-any.whl",
             "sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl", "sglang-0.5.11.tar.gz",
             "sglang-0.5.24.tar.gz", "other-1.0-py3-none-any.whl"]
    index = {"files": [{"filename": n, "url": f"https://x/{n}", "hashes": {}} for n in names]}
    monkeypatch.setattr(releases, "_fetch_json", lambda url, timeout: index)
    releases.index.cache_clear()
    try:
        assert releases.available("sglang") == ["0.4.6", "0.5.11"]
        assert releases.available("sglang", ">=0.5", posts=True) == ["0.5.11", "0.5.24"]
        assert releases.available("sglang", "<0.5", posts=True) == ["0.4.5", "0.4.6",
                                                                     "0.4.6.post1"]
    finally:
        releases.index.cache_clear()
