"""`sm120patch matrix --vllm SPEC` on the real newest vLLM: a vLLM row (its sources read from
the release cache, never the wheel), a verdict for each vLLM profile, and only the kinds named."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from realcache import release_set

from sm120patch.cli import main
from sm120patch.plan import catalog

pytestmark = pytest.mark.real


def test_matrix_plans_vllm_when_named_and_only_what_is_named(real) -> None:
    newest = release_set("vllm")[-1]
    result = CliRunner().invoke(main, ["matrix", "--vllm", f"=={newest}", "-j", "1", "-q",
                                       "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["errors"] == []
    [row] = doc["rows"]
    assert (row["kind"], row["version"]) == ("vllm", newest)
    cat = catalog.load()
    vllm_profiles = {n for n, p in cat.profiles.items() if "vllm" in p.targets}
    assert set(row["profiles"]) == vllm_profiles
    # Each verdict is what the catalog's pins and refusals say of this release.
    assert row["profiles"]["vllm-fp8-moe"] == "refused"
    assert row["sites"]["vllm.fp8-cutlass-moe"] == "refused"
    assert {row["profiles"][n] for n in vllm_profiles - {"vllm-fp8-moe"}} == {"pinned"}
    assert {row["sites"][p] for n in vllm_profiles - {"vllm-fp8-moe"}
            for p in cat.profiles[n].patches} == {"applied"}


def test_matrix_without_vllm_plans_no_vllm(real) -> None:
    newest = release_set("sglang")[-1]
    result = CliRunner().invoke(main, ["matrix", "--sglang", f"=={newest}", "-j", "1", "-q",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert {r["kind"] for r in json.loads(result.stdout)["rows"]} == {"sglang"}
