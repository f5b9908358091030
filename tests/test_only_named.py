"""Only what was named: a command that names any target never reaches the FlashInfer (or vLLM)
of sm120patch's own Python for another. The FlashInfer a profile needs is the one beside the
named SGLang (its site-packages), else the command refuses and asks for `--flashinfer`."""

from __future__ import annotations

import importlib
import json

import pytest
from test_states import cli
from trees import make_tree, tree_hash


@pytest.fixture
def own_flashinfer(tmp_path, monkeypatch):
    """A FlashInfer importable by this Python: the tool's own environment's."""
    env = make_tree(tmp_path / "env", "flashinfer", "0.6.8", "installed")
    monkeypatch.syspath_prepend(str(env))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("flashinfer") is not None
    return env


def test_the_flashinfer_beside_the_named_sglang_is_the_one_patched(tmp_path, own_flashinfer):
    box = tmp_path / "box"
    sg = make_tree(box, "sglang", "0.5.8", "installed")
    make_tree(box, "flashinfer", "0.6.8", "installed")
    (sg.parent / "flashinfer-installed" / "flashinfer").rename(sg / "flashinfer")
    for info in (sg.parent / "flashinfer-installed").glob("*.dist-info"):
        info.rename(sg / info.name)
    before = tree_hash(own_flashinfer)
    code, out, err = cli("apply", "fusion", "--sglang", str(sg), "--no-gpu-check", "--json")
    assert code == 0, err
    assert tree_hash(own_flashinfer) == before  # the tool's own FlashInfer is not touched
    found = json.loads(cli("status", "--sglang", str(sg), "--json")[1])["targets"]
    status = {t["kind"]: t for t in found}
    assert status["flashinfer"]["state"] == "applied", status
    assert str(sg) in json.dumps(status["flashinfer"]), status


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_no_flashinfer_beside_the_named_sglang_refuses_and_asks_for_it(
    layout, tmp_path, own_flashinfer
):
    sg = make_tree(tmp_path, "sglang", "0.5.8", layout)
    before = tree_hash(own_flashinfer), tree_hash(sg)
    code, out, err = cli("apply", "fusion", "--sglang", str(sg), "--no-gpu-check")
    assert code == 1, err
    assert f"no FlashInfer beside the SGLang at {sg}" in err and "--flashinfer" in err, err
    assert (tree_hash(own_flashinfer), tree_hash(sg)) == before
    # status names nothing it was not given: no FlashInfer row from the tool's environment
    targets = json.loads(cli("status", "--sglang", str(sg), "--json")[1])["targets"]
    assert [t["kind"] for t in targets] == ["sglang"], targets


def test_with_nothing_named_this_pythons_flashinfer_is_still_the_default(own_flashinfer):
    targets = json.loads(cli("status", "--json")[1])["targets"]
    assert [t["kind"] for t in targets if t["kind"] == "flashinfer"] == ["flashinfer"], targets


def test_a_named_vllm_never_reaches_this_pythons_flashinfer(tmp_path, own_flashinfer):
    vl = make_tree(tmp_path, "vllm", "0.10.1", "git")
    targets = json.loads(cli("status", "--vllm", str(vl), "--json")[1])["targets"]
    assert "flashinfer" not in [t["kind"] for t in targets], targets
