"""patches/known.toml: entries load, match this box by version range, GPU family, TP size and
profile, and `doctor` and `apply` show them before acting."""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet
from trees import make_tree
from trialkit import run_cli

from sm120patch.errors import UsageError
from sm120patch.plan import known
from sm120patch.trial import gpu
from sm120patch.trial.known import box_of

MOE_GARBAGE = "flashinfer-nvfp4-moe-grouped-gemm-garbage"


def entry(name: str) -> known.Entry:
    return next(e for e in known.entries() if e.id == name)


def ids(profile: str | None, box: known.Box) -> set[str]:
    return {e.id for e in known.entries() if known.matches(e, profile, box)}


def test_shipped_entries_are_complete_and_cited():
    found = known.entries()
    assert len(found) >= 8
    for e in found:
        assert e.outcome in known.OUTCOMES
        assert e.evidence in known.EVIDENCE
        # A public page a user can open, or the unpublished field report said to be one.
        assert e.source.startswith("https://") or e.evidence == "unpublished", e.id
        assert e.measured, f"{e.id}: say what was run, in the source's terms"
        # Only the field report may cite no page, and it says so in words a user can follow.
        if e.evidence == "unpublished":
            assert "published" in e.source and not e.source.startswith("https://")
        # Nothing a user cannot open: the house test reads every entry for such citations.
        for key in ("sglang", "flashinfer", "gpus", "tp"):
            if key in e.condition:
                SpecifierSet(e.condition[key])  # raises on a bad range
    assert {e.outcome for e in found} >= {"faster", "slower", "wrong-output"}


def test_matched_by_flashinfer_version_range():
    box = known.Box(versions={"sglang": "0.5.8", "flashinfer": "0.6.1"}, gpu_family="sm120")
    assert MOE_GARBAGE in ids("moe", box)
    assert MOE_GARBAGE not in ids("moe", known.Box(versions={"flashinfer": "0.6.7"}))
    # A post release counts as its release, as the pins do.
    assert MOE_GARBAGE in ids("moe", known.Box(versions={"flashinfer": "0.6.6.post1"}))
    assert "flashinfer-fp4-zeros-by-m-0.6.12" in ids("moe", known.Box(versions={"flashinfer": "0.6.12"}))
    assert "flashinfer-fp4-zeros-by-m-0.6.12" not in ids("moe", known.Box(versions={"flashinfer": "0.6.13"}))


def test_matched_by_gpu_family_tp_quantization_and_profile():
    sm120 = known.Box(gpu_family="sm120", gpus=2, tp=2)
    assert "fusion-tp2-sm120-faster" in ids("fusion", sm120)
    assert "fusion-tp4-sm120-regression" not in ids("fusion", sm120)
    assert "fusion-8x-sm120-pcie-slower" not in ids("fusion", sm120)  # 8 GPUs, not 2
    assert ids("fusion", known.Box(gpu_family="sm90")) == set()  # an H100 is not concerned
    assert "fusion-tp4-sm120-regression" in ids("all", known.Box(tp=4))  # all contains fusion
    assert "fusion-tp4-sm120-regression" not in ids("moe", known.Box(tp=4))
    bf16 = known.Box(versions={"flashinfer": "0.6.1"}, quantization="fp8")
    assert MOE_GARBAGE not in ids("moe", bf16)
    nvfp4 = known.Box(versions={"flashinfer": "0.6.1"}, quantization="modelopt_fp4")
    assert MOE_GARBAGE in ids("moe", nvfp4)


def test_box_reads_tp_and_quantization_from_the_command(tmp_path, mocker):
    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Glm4MoeForCausalLM"]}')
    box = box_of(
        {"sglang": None, "flashinfer": None},
        ["python", "-m", "sglang.launch_server", "--model-path", str(model), "--tp", "4",
         "--quantization=modelopt_fp4"],
    )
    assert box.tp == 4 and box.quantization == "modelopt_fp4"
    assert box.architecture == ["Glm4MoeForCausalLM"]


def test_a_bad_entry_is_one_clear_line():
    with pytest.raises(UsageError, match="known.toml entry x: missing figure"):
        known.entries('[[outcome]]\nid = "x"\noutcome = "slower"\ndate = "2026"\nsource = "s"\n'
                      'evidence = "measured"\n')
    with pytest.raises(UsageError, match="outcome must be one of"):
        known.entries(
            '[[outcome]]\nid = "y"\noutcome = "meh"\nfigure = "f"\ndate = "d"\nsource = "s"\n'
            'evidence = "measured"\n'
        )
    with pytest.raises(UsageError, match="evidence must be one of"):
        known.entries(
            '[[outcome]]\nid = "z"\noutcome = "slower"\nfigure = "f"\ndate = "d"\n'
            'source = "s"\nevidence = "rumour"\n'
        )
    with pytest.raises(UsageError, match="missing evidence"):
        known.entries(
            '[[outcome]]\nid = "w"\noutcome = "slower"\nfigure = "f"\ndate = "d"\nsource = "s"\n'
        )


def test_a_line_says_the_evidence_and_what_was_run():
    line = entry("fusion-tp2-sm120-faster").line()
    assert "(reported)" in line and "vLLM, not SGLang" in line and "one run per" in line
    assert "(unpublished)" in entry("fusion-8x-sm120-pcie-slower").line()


def test_only_a_wrong_output_entry_about_the_profile_condemns_it():
    old = known.Box(versions={"sglang": "0.5.9", "flashinfer": "0.6.1"}, gpu_family="sm120")
    new = known.Box(versions={"sglang": "0.5.9", "flashinfer": "0.6.8"}, gpu_family="sm120")
    assert [e.id for e in known.condemning("moe", old)] == [MOE_GARBAGE]
    assert known.condemning("moe", new) == []
    # The mm_fp4 entries are about every NVFP4 server, not about moe.
    fp4 = known.Box(versions={"flashinfer": "0.6.12"}, gpu_family="sm120")
    assert known.condemning("moe", fp4) == []
    assert known.condemning("moe", known.Box(versions={"flashinfer": "0.6.1"},
                                             gpu_family="sm90")) == []


@pytest.mark.parametrize(("fi_version", "shown"), [("0.6.1", True), ("0.6.8", False)])
def test_doctor_and_apply_show_matching_entries(tmp_path, mocker, fi_version, shown):
    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())  # no GPU seen: not excluding
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", fi_version, "installed")
    code, out, err = run_cli("doctor", "--sglang", str(sg), "--flashinfer", str(fi))
    assert code == 0, err
    assert ("flashinfer/issues/2723" in out) is shown
    assert "flashinfer/pull/3903" in out  # fusion at TP2: no GPU and no TP known here
    # doctor stops recommending moe where a wrong-output entry about it matches.
    assert ("moe is not recommended here" in out) is shown
    assert ("recommended here: moe" in out) is not shown
    dry = ("apply", "moe", "--dry-run", "--sglang", str(sg), "--flashinfer", str(fi),
           "--no-gpu-check")
    code, out, err = run_cli(*dry)
    if shown:  # FlashInfer before 0.6.7: refused with the reason, --force to apply anyway
        assert code == 1 and out == ""
        assert "profile moe refuses FlashInfer 0.6.1" in err and "issues/2723" in err
        # Inside the pins: the hint is the refusal's, not "use a pinned release".
        assert "next: use a release it does not refuse (its reason says which), or --force to " \
            "apply anyway" in err and "pinned release" not in err
        code, out, err = run_cli(*dry, "--force")
    assert code == 0, err
    assert ("known: moe wrong-output" in err) is shown
    assert "known:" not in out  # the diff on stdout stays `git apply`-able
    assert "flashinfer/pull/3903" not in err  # a fusion entry is not about moe
    code, out, err = run_cli(
        "apply", "moe", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check",
        *(["--force"] if shown else []),
    )
    assert code == 0, err
    head = out.split("\napplied")[0]  # the known lines come before the report
    assert ("known: moe wrong-output" in head) is shown
    assert out.splitlines()[0].startswith("known: ")


def test_moe_refusal_finds_the_flashinfer_beside_sglang(tmp_path, mocker):
    """`apply moe --sglang SITE` with no --flashinfer reads the FlashInfer installed in the
    same site-packages: the one that server runs with."""
    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())
    site = tmp_path / "site"
    sg = make_tree(site, "sglang", "0.5.9", "installed")
    fi = make_tree(site, "flashinfer", "0.6.3", "installed")
    for tree in (sg, fi):  # both packages in one site-packages directory
        for entry in tree.iterdir():
            entry.rename(site / entry.name)
    code, out, err = run_cli("apply", "moe", "--dry-run", "--sglang", str(site), "--no-gpu-check")
    assert code == 1 and "refuses FlashInfer 0.6.3" in err, err


def test_list_stops_recommending_moe_on_a_flashinfer_it_refuses(tmp_path, mocker):
    """`list` reads the SGLang and FlashInfer installed here (no GPU probe): with a FlashInfer
    before 0.6.7, moe is refused and a wrong-output entry about it matches."""
    from sm120patch import targets

    fi = targets.find("flashinfer", make_tree(tmp_path, "flashinfer", "0.6.1", "installed"))
    mocker.patch.object(known, "installed_targets", return_value=[fi])
    code, out, err = run_cli("list")
    assert code == 0, err
    moe = out.split("\nfusion")[0]
    assert "[recommended, not here]" in moe
    assert "not recommended here: profile moe refuses FlashInfer 0.6.1" in moe
    assert "known: moe wrong-output" in moe
    code, out, _ = run_cli("list", "--json")
    import json

    doc = {p["name"]: p for p in json.loads(out)["profiles"]}
    assert doc["moe"]["not_recommended_here"] and not doc["fusion"]["not_recommended_here"]
    mocker.patch.object(known, "installed_targets", return_value=[])
    code, out, _ = run_cli("list")
    assert "[recommended]" in out and "not here" not in out
