"""A command's configuration is its own: two Sessions in one process, with different packs and
stated versions, each see theirs, down to the engine (nothing is set for the process)."""

from __future__ import annotations

import pytest
from test_packs import make_pack
from trees import make_tree

from sm120patch import app
from sm120patch.config import PACKS_ENV, Config
from sm120patch.engine import apply
from sm120patch.errors import UnknownProfile, UsageError


@pytest.fixture(autouse=True)
def no_env_pack(monkeypatch):
    monkeypatch.delenv(PACKS_ENV, raising=False)


def test_two_sessions_in_one_process_keep_their_own_packs_and_versions(tmp_path):
    pack = make_pack(tmp_path / "pack")
    fi = make_tree(tmp_path, "flashinfer", "0.6.1", "installed")
    # Both made before either is used: a setting for the process would be the second's.
    mine = app.Session(
        paths={"flashinfer": str(fi)}, packs=(str(pack),), stated={"flashinfer": "0.6.2"}
    )
    other = app.Session(paths={"flashinfer": str(fi)})
    assert "extra" in mine.catalog.profiles
    assert "extra" not in other.catalog.profiles
    assert mine.target("flashinfer").version == "0.6.2"
    assert mine.target("flashinfer").version_source.startswith("--flashinfer-version")
    assert other.target("flashinfer").version == "0.6.1"
    # The engine, given a session's targets, loads that session's packs: the pack's profile
    # plans for the one, and is unknown to the other.
    prep = apply.dry_run("extra", mine.targets, force=True)
    assert prep.plan is not None and prep.plan.profile.name == "extra"
    with pytest.raises(UnknownProfile):
        apply.dry_run("extra", other.targets, force=True)


def test_a_config_reads_the_environment_when_made_and_checks_the_versions(monkeypatch, tmp_path):
    monkeypatch.setenv(PACKS_ENV, str(tmp_path / "env-pack"))
    assert Config.made(["given"]).packs == ("given", str(tmp_path / "env-pack"))
    assert Config.made(stated={"sglang": "0.5.9", "flashinfer": None}).stated == {"sglang": "0.5.9"}
    with pytest.raises(UsageError, match="--sglang-version nope: not a PEP 440 version"):
        Config.made(stated={"sglang": "nope"})
