"""examples/systemd/vllm.service.d/sm120patch.conf on the real newest vLLM: its ExecStartPre
(`ensure --locked LOCK --vllm DIR`) passes on the tree the lock was made on, re-applies it on a
pristine reinstall, and fails (exit 1, nothing written) on a tree edited by hand."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest
from test_cycle_newest import cli
from test_cycle_vllm import installed, newest, reachable  # noqa: F401 (a fixture)
from trees import tree_hash

pytestmark = pytest.mark.real

DROP_IN = (Path(__file__).resolve().parents[2] / "examples" / "systemd" / "vllm.service.d"
           / "sm120patch.conf")
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"


def exec_start_pre() -> list[str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys keep case
    parser.read(DROP_IN)
    return shlex.split(parser["Service"]["ExecStartPre"])


def test_the_drop_in_names_ensure_locked_and_the_vllm() -> None:
    argv = exec_start_pre()
    assert argv[0].endswith("/sm120patch")
    assert argv[1:3] == ["ensure", "--locked"] and argv[4] == "--vllm"
    assert argv[5].endswith("site-packages")


def test_the_guard_on_the_newest_vllm(reachable: None, tmp_path: Path,  # noqa: F811
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM120PATCH_CACHE", str(tmp_path / "plan-cache"))
    version = newest("vllm-moe")
    site = installed(tmp_path / "box", version)
    lock = tmp_path / "sm120patch-vllm.lock"
    code, _, err = cli("apply", "vllm-moe", "--vllm", str(site), "--no-gpu-check")
    assert code == 0, err
    code, _, err = cli("pin", "vllm-moe", "--vllm", str(site), "-o", str(lock))
    assert code == 0, err

    def guard(root: Path) -> tuple[int, str]:
        # The unit's words, with this test's lock and tree (and no SM120 GPU here).
        argv = exec_start_pre()
        code, out, err = cli(*argv[1:3], str(lock), argv[4], str(root), "--no-gpu-check")
        return code, out + err

    applied = tree_hash(site)
    assert guard(site)[0] == 0 and tree_hash(site) == applied
    # A reinstall: the release's bytes again; the guard re-applies the lock.
    fresh = installed(tmp_path / "reinstalled", version)
    code, said = guard(fresh)
    assert code == 0, said
    assert (fresh / ORACLE).read_bytes() == (site / ORACLE).read_bytes()
    # A hand edit of the patched file: the guard fails and writes nothing.
    edited = (site / ORACLE).read_text() + "# a hand edit\n"
    (site / ORACLE).write_text(edited)
    before = tree_hash(site)
    code, said = guard(site)
    assert code == 1 and "next:" in said, said
    assert tree_hash(site) == before
