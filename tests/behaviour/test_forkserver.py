"""The probe fork server (forkserver.py): a forked probe answers as a fresh interpreter does,
and a request whose sys.path would import another copy of what the server imported before the
fork, or whose environment sets a variable that code names, runs fresh."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import envs
import forkserver
import pytest
from behave import release_set

from sm120patch.explain import explain

pytestmark = pytest.mark.behaviour


def _request(version: str, tmp: Path) -> dict[str, Any]:
    return {"simulate": "sm120", "sys_path": envs.sys_path_for("sglang", version),
            "overlay": {}, "launches": {}, "sglang": True, "flashinfer": False,
            "env": {"CUDA_HOME": str(tmp / "no-cuda")}}


def _log(server: forkserver.ForkServer) -> list[str]:
    return server.log.read_text(encoding="utf-8").splitlines()


def test_a_forked_probe_answers_as_a_fresh_one(tmp_path: Path) -> None:
    deps = envs.deps_python()
    server = forkserver.ForkServer(deps)
    try:
        request = _request(release_set("sglang")[-1], tmp_path)
        forked = explain.run_probe(server.client, request)
        assert _log(server) == ["forked"]
        fresh = explain.run_probe(deps, request)
        assert forked == fresh
    finally:
        server.close()


def test_another_copy_of_a_preloaded_module_or_a_named_variable_runs_fresh(
        tmp_path: Path) -> None:
    server = forkserver.ForkServer(envs.deps_python())
    try:
        shadow = tmp_path / "shadow"
        (shadow / "typing_extensions-0.0.dist-info").mkdir(parents=True)
        (shadow / "typing_extensions.py").write_text("X = 1\n")
        (shadow / "typing_extensions-0.0.dist-info" / "RECORD").write_text(
            "typing_extensions.py,sha256=other,6\n")
        request = {**_request(release_set("sglang")[-1], tmp_path), "sglang": False,
                   "simulate": None}
        with pytest.raises(explain.ProbeCannotImport, match="typing_extensions"):
            # fresh, torch imports the shadow, which is not typing_extensions: as it would
            explain.run_probe(server.client, {**request, "sys_path": [str(shadow)]})
        explain.run_probe(server.client, {**request, "env": {"TORCH_CUDA_SANITIZER": "0"}})
        explain.run_probe(server.client, request)
        log = _log(server)
        assert log[0] == (f"fresh: typing_extensions in {shadow} is not the one imported "
                          "before the fork")
        assert log[1].startswith("fresh: TORCH_CUDA_SANITIZER, which the request sets"), log
        assert log[2] == "forked"
    finally:
        server.close()


def test_the_exit_status_and_streams_are_the_probes(tmp_path: Path) -> None:
    """A probe that cannot import what it is asked for exits as it would fresh (5, `fatal`)."""
    server = forkserver.ForkServer(envs.deps_python())
    try:
        request = {"simulate": None, "sys_path": [str(tmp_path)], "sglang": True,
                   "readers": []}
        req = tmp_path / "request.json"
        req.write_text(json.dumps(request))
        import subprocess

        runs = [subprocess.run([str(py), str(explain.PROBE), str(req), str(tmp_path / f"r{i}")],
                               capture_output=True, text=True, cwd="/", check=False)
                for i, py in enumerate((server.client, envs.deps_python()))]
        assert [r.returncode for r in runs] == [5, 5]
        assert (json.loads((tmp_path / "r0").read_text())
                == json.loads((tmp_path / "r1").read_text()))
    finally:
        server.close()
