"""The behaviour tier's probe cache (probes.py): its key follows every input the probe reads and
none of the per-module temporary paths, and identical requests from two modules run once.

No probe runs here: the runner is a stand-in that counts its calls (quick suite)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import probes
import pytest
from behave import ARCHS
from overlay_probe import OverlayProbe


def _tree(root: Path, record: str) -> Path:
    site = root / "site"
    (site / "pkg-1.0.dist-info").mkdir(parents=True)
    (site / "pkg-1.0.dist-info" / "RECORD").write_text(record)
    return site


def _request(root: Path, *, record: str = "pkg/a.py,sha256=aa,1\n", overlay: str = "x = 1\n",
             config: dict[str, Any] | None = None, arch: str = "sm120",
             flags: tuple[str, ...] = (), env_path: str = "no-cuda") -> dict[str, Any]:
    """A request as a module builds it, every path under its own temporary `root`."""
    root.mkdir(parents=True, exist_ok=True)
    site = _tree(root, record)
    (root / "overlay.py").write_text(overlay)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config or {"architectures": ["Llama"]}))
    return {"simulate": arch, "sys_path": [str(site)],
            "overlay": {"sglang.srt.server_args": str(root / "overlay.py")},
            "launches": {"mha": ["--model-path", str(model), "--tp", "2", *flags]},
            "sglang": True, "env": {"CUDA_HOME": str(root / env_path)}}


def test_the_key_is_the_content_not_the_temporary_paths(tmp_path: Path) -> None:
    assert probes.key(_request(tmp_path / "a")) == probes.key(_request(tmp_path / "b"))


def test_the_key_changes_when_any_input_changes(tmp_path: Path) -> None:
    base = probes.key(_request(tmp_path / "base"))
    changed = {
        "release files": _request(tmp_path / "r", record="pkg/a.py,sha256=bb,1\n"),
        "overlay bytes": _request(tmp_path / "o", overlay="x = 2\n"),
        "model config": _request(tmp_path / "m", config={"architectures": ["Qwen"]}),
        "simulated GPU": _request(tmp_path / "g", arch="sm100"),
        "launch arguments": _request(tmp_path / "l", flags=("--kv-cache-dtype", "fp8_e4m3")),
        "CUDA version": {**_request(tmp_path / "c"), "cuda_version": "13.0"},
        "environment": {**_request(tmp_path / "e"), "env": {"CUDA_HOME": "/usr"}},
        "probe bytes": _request(tmp_path / "p"),
    }
    keys = {what: probes.key(req) for what, req in changed.items() if what != "probe bytes"}
    probe = tmp_path / "probe.py"
    probe.write_text("# another probe\n")
    keys["probe bytes"] = probes.key(changed["probe bytes"], str(probe))
    assert [what for what, k in keys.items() if k == base] == []
    # the probe's default CUDA version is the same request as naming it
    default = _request(tmp_path / "d")
    assert probes.key({**default, "cuda_version": probes.DEFAULT_CUDA}) == base


def test_patch_bytes_are_in_the_key(tmp_path: Path, monkeypatch: Any) -> None:
    """The readers the probe imports live in patches/: their bytes are part of the key."""
    request = _request(tmp_path / "a")
    before = probes.key(request)
    patches = tmp_path / "root" / "patches"
    patches.mkdir(parents=True)
    (patches / "one.py").write_text("READ = 1\n")
    monkeypatch.setattr(probes, "_ROOT", tmp_path / "root")
    monkeypatch.setattr(probes, "_CODE", {})
    first = probes.key(request)
    (patches / "one.py").write_text("READ = 2\n")
    monkeypatch.setattr(probes, "_CODE", {})
    assert len({before, first, probes.key(request)}) == 3


def test_two_modules_identical_requests_are_one_run(tmp_path: Path) -> None:
    cache = probes.ProbeCache()
    calls: list[dict[str, Any]] = []

    def runner(request: dict[str, Any]) -> dict[str, Any]:
        calls.append(request)
        return {"answer": len(calls)}

    first = cache.run_all([_request(tmp_path / "mod1"), _request(tmp_path / "mod1b", arch="sm90")],
                          runner)
    second = cache.run(_request(tmp_path / "mod2"), runner)  # another module, its own paths
    assert second == first[0]
    assert (cache.asked, cache.ran, len(calls)) == (3, 2, 2)


@pytest.mark.behaviour
def test_moe_gdn_and_pcie_modules_ask_one_pristine_run(tmp_path: Path) -> None:
    """The requests those modules build for a pristine (release, GPU) are one key: each
    module's own temporary directory, and the CUDA version the probe defaults to, do not
    split them (builds the requests only; no probe runs)."""
    import test_gdn_prefill
    import test_moe_runner_auto
    import test_pcie_ipc

    shared = [v for v in test_moe_runner_auto.pinned()
              if v in test_gdn_prefill.pinned() and v in test_pcie_ipc.pinned()]
    if not shared:
        pytest.skip("no release is pinned by all three modules in this session's set")
    version = shared[0]
    for arch in ARCHS:
        keys = {
            probes.key(test_moe_runner_auto.request(tmp_path / "moe", version, arch, {})),
            probes.key(OverlayProbe(test_gdn_prefill.PROFILE, "gdn_prefill", tmp_path / "gdn")
                       .request(version, "pristine", arch)),
            probes.key(OverlayProbe(test_pcie_ipc.PROFILE, "pcie_ipc", tmp_path / "pcie")
                       .request(version, "pristine", arch)),
        }
        assert len(keys) == 1, (version, arch)
