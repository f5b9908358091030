"""`sm120patch matrix` against a package index we serve on 127.0.0.1 (tests/fakeindex.py): pip's
configured index, offline from a warm cache, post releases, an empty selection, corrupted cache
entries, progress on a terminal, and the one JSON object it prints."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakeindex import FakeIndex, closed_port_url, pip_env, serve

from sm120patch.cli import main
from sm120patch.maintain import dists, pipconfig, releases, trees


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """Forget what this process read of pip's config and the indexes, before and after."""

    def clear() -> None:
        pipconfig.pip_index.cache_clear()
        releases.listing.cache_clear()
        releases.index_reachable.cache_clear()

    clear()
    yield
    clear()


@pytest.fixture
def index(tmp_path: Path) -> FakeIndex:
    with serve(tmp_path / "index") as served:
        served.add("sglang", "0.5.8")
        served.add("flashinfer-python", "0.6.1")
        yield served


def matrix(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *args: str):
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pipconfig.pip_index.cache_clear()
    releases.listing.cache_clear()
    return CliRunner().invoke(main, ["matrix", "-j", "1", *args])


def rows(output: str) -> dict[tuple[str, str], dict]:
    doc = json.loads(output)
    assert set(doc) == {"rows", "errors", "warnings"}  # one object, never a bare list
    return {(r["kind"], r["version"]): r for r in doc["rows"]}


@pytest.fixture
def json_index(tmp_path: Path) -> FakeIndex:
    """The same releases, with PEP 691 JSON pages (what PyPI serves)."""
    with serve(tmp_path / "index", json_pages=True) as served:
        served.add("sglang", "0.5.8")
        served.add("flashinfer-python", "0.6.1")
        yield served


@pytest.mark.parametrize("pages", ["html", "json"])
def test_reads_the_index_from_pip_config_and_prints_one_json_object(
    pages: str, request: pytest.FixtureRequest, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    index = request.getfixturevalue("index" if pages == "html" else "json_index")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {index.url}\n")
    result = matrix(monkeypatch, pip_env(None, tmp_path / "cache", str(conf)), "--json")
    assert result.exit_code == 0, result.output
    got = rows(result.stdout)
    assert set(got) == {("sglang", "0.5.8"), ("flashinfer", "0.6.1")}
    assert got[("sglang", "0.5.8")]["sites"]["sglang.moe-backend"] == "applied"
    assert got[("flashinfer", "0.6.1")]["sites"]["flashinfer.comm-arch"] == "applied"
    assert "/simple/sglang/" in index.requests and "/simple/flashinfer-python/" in index.requests
    wheel = tmp_path / "cache" / "dist" / "sglang-0.5.8-py3-none-any.whl"
    assert dists.recorded_digest(wheel) == dists.sha256_file(wheel)
    assert result.stderr == ""


def test_offline_from_a_warm_cache_warns_once_and_plans(
    index: FakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    cache = tmp_path / "cache"
    online = matrix(monkeypatch, pip_env(index.url, cache), "--json")
    assert online.exit_code == 0, online.output
    # The index is gone (connection refused): before, this was exit 4, "internal error".
    offline = matrix(monkeypatch, pip_env(closed_port_url(), cache), "--json")
    assert offline.exit_code == 0, offline.output
    assert rows(offline.stdout) == rows(online.stdout)
    lines = offline.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sm120patch: warning: cannot read http://127.0.0.1")
    assert "sglang as listed" in lines[0] and "flashinfer-python as listed" in lines[0]
    assert json.loads(offline.stdout)["warnings"] == [lines[0].removeprefix("sm120patch: warning: ")]


def test_offline_with_a_cold_cache_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    result = matrix(monkeypatch, pip_env(closed_port_url(), tmp_path / "cache"), "--sglang", "==0.5.8")
    assert result.exit_code == 1, result.output
    first, *hint = result.stderr.splitlines()
    assert first.startswith("sm120patch: cannot read http://127.0.0.1") and "no listing" in first
    assert hint and all(x.startswith("  ") for x in hint)
    assert "Traceback" not in result.output


def test_post_releases_are_selected(
    index: FakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    for version in ("0.5.8.post1", "0.5.8.post2", "0.5.9"):
        index.add("sglang", version)
    env = pip_env(index.url, tmp_path / "cache")
    exact = matrix(monkeypatch, env, "--sglang", "==0.5.8.post1", "--json")
    assert exact.exit_code == 0, exact.output
    assert list(rows(exact.stdout)) == [("sglang", "0.5.8.post1")]
    # A range: every release and the latest post release of each.
    ranged = matrix(monkeypatch, env, "--sglang", ">=0.5.8", "--json")
    assert [v for _, v in rows(ranged.stdout)] == ["0.5.8", "0.5.8.post2", "0.5.9"]
    tree = releases.trees_dir() / "sglang-0.5.8.post2"
    assert (tree / "sglang-0.5.8.post2.dist-info" / "METADATA").is_file()


def test_an_empty_selection_is_a_usage_error(
    index: FakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    result = matrix(monkeypatch, pip_env(index.url, tmp_path / "cache"), "--sglang", "==9.9")
    assert result.exit_code == 2, result.output
    first, *hint = result.stderr.splitlines()
    assert first.startswith("sm120patch: no release matches --sglang '==9.9'")
    assert "sglang 0.5.8 to 0.5.8" in first
    assert hint == ["  pick a specifier inside that range, e.g. --sglang '==0.5.8'"]
    assert result.stdout == ""


def _truncate_wheel(cache: Path) -> None:
    wheel = cache / "dist" / "sglang-0.5.8-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[:200])
    # Without a tree, the wheel is what gets read.
    import shutil

    shutil.rmtree(cache / "trees" / "sglang-0.5.8")


def _edit_tree(cache: Path) -> None:
    (cache / "trees" / "sglang-0.5.8" / "sglang/srt/server_args.py").write_text("x = 1\n")


@pytest.mark.parametrize("corrupt", [_truncate_wheel, _edit_tree], ids=["truncated-wheel", "edited-tree"])
def test_a_corrupted_cache_entry_is_fetched_again(
    corrupt, index: FakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    cache = tmp_path / "cache"
    env = pip_env(index.url, cache)
    before = matrix(monkeypatch, env, "--sglang", "==0.5.8", "--json")
    assert before.exit_code == 0, before.output
    corrupt(cache)
    after = matrix(monkeypatch, env, "--sglang", "==0.5.8", "--json")
    assert after.exit_code == 0, after.output
    # Not `refused`: the same outcomes as on the intact cache.
    assert rows(after.stdout) == rows(before.stdout)
    assert trees.tree_problem(cache / "trees" / "sglang-0.5.8") is None
    wheel = cache / "dist" / "sglang-0.5.8-py3-none-any.whl"
    assert dists.verify("sglang", wheel) is None


def _run_on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe); (exit code, what the
    terminal got)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sm120patch", *args], env=env,
                            stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    proc.communicate(timeout=60)
    os.close(master)
    return proc.returncode, seen.decode(errors="replace")


def test_progress_on_a_terminal_unless_quiet(index: FakeIndex, tmp_path: Path) -> None:
    # The download takes longer than the second after which progress shows.
    index.delay_s["sglang-0.5.8-py3-none-any.whl"] = 1.3
    args = ["matrix", "--sglang", "==0.5.8", "-j", "1"]
    code, terminal = _run_on_a_terminal(args, pip_env(index.url, tmp_path / "a"))
    assert code == 0, terminal
    assert "planning releases" in terminal and "sglang 0.5.8" in terminal
    code, terminal = _run_on_a_terminal([*args, "--quiet"], pip_env(index.url, tmp_path / "b"))
    assert code == 0, terminal
    assert terminal == ""


def test_scan_records_the_candidates_new_since_the_previous_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    from trees import FLASHINFER_FILES

    later = dict(FLASHINFER_FILES)
    later["flashinfer/jit/nvshmem.py"] = (
        "def gen_nvshmem_module():\n"
        "    return spec(ctx.get_nvcc_flags_list(supported_major_versions=[9, 10]))\n"
    )
    with serve(tmp_path / "index") as index:
        index.add("flashinfer-python", "0.6.1")
        index.add("flashinfer-python", "0.6.2", files=later)
        env = pip_env(index.url, tmp_path / "cache")
        result = matrix(monkeypatch, env, "--flashinfer", ">=0.6.1", "--scan", "--json")
        assert result.exit_code == 0, result.output
        got = rows(result.stdout)
        first, second = got[("flashinfer", "0.6.1")], got[("flashinfer", "0.6.2")]
        assert first["candidates"] == 1 and first["new_candidates"] == []
        assert second["candidates"] == 2
        assert [(c["file"], c["function"]) for c in second["new_candidates"]] == [
            ("flashinfer/jit/nvshmem.py", "gen_nvshmem_module")
        ]
        # The scans are kept in the release cache: a second run reads them.
        scans = sorted(p.name for p in (tmp_path / "cache" / "scans").iterdir())
        assert scans == ["flashinfer-0.6.1.json", "flashinfer-0.6.2.json"]
        text = matrix(monkeypatch, env, "--flashinfer", ">=0.6.1", "--scan", "--markdown")
        assert "- FlashInfer 0.6.2: 1 new" in text.stdout
        assert "`flashinfer/jit/nvshmem.py:2` `gen_nvshmem_module`: `[9, 10]`" in text.stdout
        # Without --scan nothing of it: the compatibility table stays as it was.
        plain = matrix(monkeypatch, env, "--flashinfer", ">=0.6.1", "--json")
        assert "candidates" not in rows(plain.stdout)[("flashinfer", "0.6.2")]
