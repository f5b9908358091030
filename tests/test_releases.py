"""The release cache on distributions we build here: no network, no upstream code."""

from __future__ import annotations

import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import pytest
from fakeindex import pip_env, serve

from sm120patch.maintain import dists, index, pipconfig, releases, trees
from sm120patch.targets import finding


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
        zf.writestr(
            f"{name}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nreadme\n",
        )
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
    make_wheel(
        cache / "dist",
        "sglang",
        "0.5.8",
        {
            "sglang/__init__.py": "",
            "sglang/srt/server_args.py": "x = 1\r\n",  # line endings kept as released
            "sglang/srt/models/llama.py": "unrelated = True\n",
        },
    )
    tree = trees.tree("sglang", "0.5.8")
    assert tree == cache / "trees" / "sglang-0.5.8"
    assert (tree / "sglang/srt/server_args.py").read_bytes() == b"x = 1\r\n"
    assert not (tree / "sglang/srt/models").exists()
    found = finding.find("sglang", tree)
    assert (found.version, found.layout) == ("0.5.8", "installed")
    assert "sglang/srt/server_args.py" in trees.tree_record(tree)["present"]
    # no temporary directories left behind
    assert sorted(p.name for p in (cache / "trees").iterdir() if p.is_dir()) == ["sglang-0.5.8"]


def test_sdist_tree_takes_pkg_info_as_metadata(cache: Path) -> None:
    make_sdist(
        cache / "dist",
        "flashinfer_python",
        "0.3.1",
        {
            "flashinfer/__init__.py": "",
            "flashinfer/comm/trtllm_ar.py": "def gen_trtllm_comm_module(): ...\n",
            "csrc/kernel.cu": "// not ours\n",
        },
    )
    tree = trees.tree("flashinfer", "0.3.1")
    assert (tree / "flashinfer/comm/trtllm_ar.py").is_file()
    assert not (tree / "csrc").exists()
    found = finding.find("flashinfer", tree)
    assert found.version == "0.3.1"
    assert found.version_source == "flashinfer_python-0.3.1.dist-info/METADATA"


def test_stale_tree_is_rebuilt_whole(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(
        cache / "dist",
        "sglang",
        "0.5.9",
        {
            "sglang/__init__.py": "",
            "sglang/srt/server_args.py": "",
            "sglang/srt/new_site.py": "",
        },
    )
    tree = trees.tree("sglang", "0.5.9")
    assert not (tree / "sglang/srt/new_site.py").exists()
    # A patch now reads one more file: the tree is rebuilt, by rename, with it.
    wanted = trees.wanted_files("sglang")
    monkeypatch.setattr(trees, "wanted_files", lambda kind: (*wanted, "sglang/srt/new_site.py"))
    assert trees.tree("sglang", "0.5.9") == tree
    assert (tree / "sglang/srt/new_site.py").is_file()
    assert sorted(p.name for p in (cache / "trees").iterdir() if p.is_dir()) == ["sglang-0.5.9"]


def test_tree_without_the_package_is_an_error(cache: Path) -> None:
    make_wheel(cache / "dist", "sglang", "0.5.7", {"other/__init__.py": ""})
    with pytest.raises(releases.ReleaseError, match="no sglang/__init__.py"):
        trees.tree("sglang", "0.5.7")
    assert not (cache / "trees" / "sglang-0.5.7").exists()


def test_fetch_reuses_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = make_wheel(cache / "dist", "sglang", "0.5.8", {"sglang/__init__.py": ""})

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(dists.subprocess, "run", no_network)
    assert dists.fetch("sglang", "0.5.8") == wheel


def test_pip_arguments_per_release() -> None:
    new = dists.pip_download_args("sglang", "0.5.11")
    assert new[1:5] == ["-I", "-m", "pip", "download"] and "--no-deps" in new
    assert {
        "--python-version",
        "3.11",
        "--platform",
        "manylinux_2_34_x86_64",
        "--only-binary=:all:",
    } <= set(new)
    old = dists.pip_download_args("sglang", "0.5.10")
    assert "--platform" not in old and "--only-binary=:all:" in old
    assert "flashinfer-python==0.6.1" in dists.pip_download_args("flashinfer", "0.6.1")
    assert dists.is_sdist_only("flashinfer", "0.4.1")
    assert not dists.is_sdist_only("flashinfer", "0.5.0")


def listed(*names: str, yanked: tuple[str, ...] = ()) -> list[index.IndexFile]:
    files = (index.make_file("sglang", n, f"https://x/{n}", None, n in yanked) for n in names)
    return [f for f in files if f]


def test_select_takes_every_release_and_its_latest_post() -> None:
    files = listed(
        "sglang-0.4.5-py3-none-any.whl",
        "sglang-0.4.6-py3-none-any.whl",
        "sglang-0.4.6.post1-py3-none-any.whl",
        "sglang-0.4.6.post2.tar.gz",
        "sglang-0.5.0rc0-py3-none-any.whl",
        "sglang-0.5.1.post1-py3-none-any.whl",
        "sglang-0.5.11-cp311-cp311-manylinux_2_34_x86_64.whl",
        "sglang-0.5.11.tar.gz",
        "sglang-0.5.24.tar.gz",
        "other-1.0-py3-none-any.whl",
    )
    assert releases.select(files, ">=0.4.6,<0.5.24") == [
        "0.4.6",
        "0.4.6.post2",
        "0.5.1.post1",
        "0.5.11",
    ]
    # An exact post release, an older one included: what was asked for.
    assert releases.select(files, "==0.4.6.post1") == ["0.4.6.post1"]
    assert releases.select(files, "==0.4.6") == ["0.4.6"]
    # Pre-releases only when the specifier names one (PEP 440).
    assert releases.select(files, ">=0.5") == ["0.5.1.post1", "0.5.11", "0.5.24"]
    assert releases.select(files, "==0.5.0rc0") == ["0.5.0rc0"]
    assert releases.select(files, "==9.9") == []
    # Every post release, or none.
    assert releases.select(files, "<0.5", posts=True) == [
        "0.4.5",
        "0.4.6",
        "0.4.6.post1",
        "0.4.6.post2",
    ]
    assert releases.select(files, "<0.5", posts=False) == ["0.4.5", "0.4.6"]


def test_the_old_module_name_is_the_same_module() -> None:
    import sm120patch.maintain.releases as old

    assert old is releases


def test_select_skips_yanked_releases_unless_pinned() -> None:
    files = listed(
        "sglang-0.5.2-py3-none-any.whl",
        "sglang-0.5.3-py3-none-any.whl",
        yanked=("sglang-0.5.3-py3-none-any.whl",),
    )
    assert releases.select(files, ">=0.5") == ["0.5.2"]
    assert releases.select(files, "==0.5.3") == ["0.5.3"]


def test_choose_prefers_the_pure_wheel_then_cp311_linux_then_the_sdist() -> None:
    names = [
        "sglang-0.5.12-cp311-cp311-manylinux_2_34_aarch64.whl",
        "sglang-0.5.12-cp310-cp310-manylinux_2_34_x86_64.whl",
        "sglang-0.5.12-cp311-cp311-manylinux_2_34_x86_64.whl",
        "sglang-0.5.12.tar.gz",
    ]
    assert dists.choose(listed(*names)).filename == names[2]
    assert dists.choose(listed(*names[:2], names[3])).filename == names[1]
    assert dists.choose(listed(names[0], names[3])).filename == names[3]
    assert dists.choose(listed(*names, "sglang-0.5.12-py3-none-any.whl")).filename.endswith(
        "py3-none-any.whl"
    )
    assert dists.choose(listed(names[0])) is None


def test_pip_config_precedence_is_pips() -> None:
    text = "\n".join(
        [
            "global.index-url='https://global.example/simple'",
            "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
            "global.find-links='/opt/wheels'",
            "download.index-url='https://download.example/simple'",
            ":env:.cert='/etc/ssl/certs/ca.crt'",
        ]
    )
    config = pipconfig.from_settings(pipconfig.parse_config_list(text))
    assert config.index_urls == (
        "https://download.example/simple",
        "file:///opt/a/simple",
        "file:///opt/b/simple",
    )
    assert config.find_links == ("/opt/wheels",)
    assert config.cert == "/etc/ssl/certs/ca.crt"
    env = pipconfig.parse_config_list(text + "\n:env:.index-url='http://127.0.0.1:1/simple'")
    assert pipconfig.from_settings(env).index_url == "http://127.0.0.1:1/simple"
    none = pipconfig.parse_config_list(text + "\n:env:.no-index='1'")
    assert pipconfig.from_settings(none).sources == ("/opt/wheels",)
    assert pipconfig.from_settings({}).index_urls == (pipconfig.DEFAULT_INDEX,)


def test_pip_index_asks_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = http://127.0.0.1:1/simple\nextra-index-url = file:///x/simple\n"
    )
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://127.0.0.1:2/simple")  # env wins
    pipconfig.pip_index.cache_clear()
    try:
        config = pipconfig.pip_index()
    finally:
        pipconfig.pip_index.cache_clear()
    assert config.index_urls == ("http://127.0.0.1:1/simple", "http://127.0.0.1:2/simple")


def test_index_pages_html_json_and_directories(tmp_path: Path) -> None:
    sha = "ab" * 32
    html = (
        f'<a href="../../files/sglang-0.5.8-py3-none-any.whl#sha256={sha}">x</a>'
        '<a href="https://cdn.example/sglang-0.5.9.tar.gz" data-yanked="">y</a>'
        '<a href="../../files/other-1.0.tar.gz">z</a>'
    )
    got = index.parse_html("sglang", html, "https://idx.example/simple/sglang/")
    assert [(f.filename, f.url, f.sha256, f.yanked) for f in got] == [
        (
            "sglang-0.5.8-py3-none-any.whl",
            "https://idx.example/files/sglang-0.5.8-py3-none-any.whl",
            sha,
            False,
        ),
        ("sglang-0.5.9.tar.gz", "https://cdn.example/sglang-0.5.9.tar.gz", None, True),
    ]
    doc = {
        "files": [
            {
                "filename": "flashinfer_python-0.6.1-py3-none-any.whl",
                "url": "f/a.whl",
                "hashes": {"sha256": sha},
                "yanked": "broken",
            }
        ]
    }
    (f,) = index.parse_json(
        "flashinfer-python", doc, "https://idx.example/simple/flashinfer-python/"
    )
    assert (f.url, f.sha256, f.yanked, str(f.version)) == (
        "https://idx.example/simple/flashinfer-python/f/a.whl",
        sha,
        True,
        "0.6.1",
    )
    # find-links directory: distributions of any project, ours picked by name.
    (tmp_path / "sglang-0.5.8-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "torch-2.1-py3-none-any.whl").write_bytes(b"")
    found = index.read_location("sglang", str(tmp_path), index=False, cert=None)
    assert [f.filename for f in found] == ["sglang-0.5.8-py3-none-any.whl"]
    # a file:// index without the project: nothing, not an error
    assert index.read_location("sglang", (tmp_path / "none").as_uri(), index=True, cert=None) == []


def test_truncated_wheel_is_downloaded_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with serve(cache.parent / "index") as served:
        served.add("sglang", "0.5.8")
        for key, value in pip_env(served.url, cache).items():
            monkeypatch.setenv(key, value)
        pipconfig.pip_index.cache_clear()
        releases.listing.cache_clear()
        try:
            wheel = dists.fetch("sglang", "0.5.8")
            good = wheel.read_bytes()
            wheel.write_bytes(good[: len(good) // 2])
            assert dists.verify("sglang", wheel) is not None
            assert dists.fetch("sglang", "0.5.8") == wheel
            assert wheel.read_bytes() == good
            assert served.requests.count("/files/sglang-0.5.8-py3-none-any.whl") == 2
        finally:
            pipconfig.pip_index.cache_clear()
            releases.listing.cache_clear()


def test_unrecorded_cached_wheel_is_adopted_only_when_whole(cache: Path) -> None:
    wheel = make_wheel(cache / "dist", "sglang", "0.5.8", {"sglang/__init__.py": ""})
    assert dists.recorded_digest(wheel) is None  # fetched by an older sm120patch
    assert dists.verify("sglang", wheel) is None
    assert dists.recorded_digest(wheel) == dists.sha256_file(wheel)
    other = make_wheel(cache / "dist", "sglang", "0.5.9", {"sglang/__init__.py": ""})
    other.write_bytes(other.read_bytes()[:-30])
    assert "does not read as a whole archive" in dists.verify("sglang", other)


def test_edited_tree_is_rebuilt(cache: Path) -> None:
    make_wheel(
        cache / "dist",
        "sglang",
        "0.5.8",
        {"sglang/__init__.py": "", "sglang/srt/server_args.py": "x = 1\n"},
    )
    tree = trees.tree("sglang", "0.5.8")
    assert trees.tree_problem(tree) is None
    (tree / "sglang/srt/server_args.py").write_text("edited = True\n")
    assert trees.tree_problem(tree) == "sglang/srt/server_args.py was changed"
    assert trees.tree("sglang", "0.5.8") == tree
    assert (tree / "sglang/srt/server_args.py").read_text() == "x = 1\n"
    (tree / "sglang/srt/server_args.py").unlink()
    assert trees.tree_problem(tree) == "sglang/srt/server_args.py is missing"
    # A record without digests (an older sm120patch built it) is rebuilt once, with them.
    record = trees.tree_record(tree)
    del record["sha256"]
    (tree / trees.TREE_RECORD).write_text(json.dumps(record))
    trees.tree("sglang", "0.5.8")
    assert trees.tree_problem(tree) is None
    assert (tree / "sglang/srt/server_args.py").read_text() == "x = 1\n"
