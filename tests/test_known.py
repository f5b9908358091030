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
        # What it relies on, quoted from the source; the field report has no text to quote.
        assert len(e.quote) >= 20, f"{e.id}: quote the sentence or figure the entry relies on"
        if e.evidence == "unpublished":
            assert e.quote.startswith("unpublished"), e.id
        # Nothing a user cannot open: the house test reads every entry for such citations.
        for key in ("sglang", "flashinfer", "gpus", "tp"):
            if key in e.condition:
                SpecifierSet(e.condition[key])  # raises on a bad range
    assert {e.outcome for e in found} >= {"faster", "slower", "wrong-output"}


def test_matched_by_flashinfer_version_range():
    box = known.Box(versions={"sglang": "0.5.8", "flashinfer": "0.6.1"}, gpu_family="sm120")
    assert MOE_GARBAGE not in ids("moe", box)  # the source ran 0.6.5, and says no more
    assert MOE_GARBAGE in ids("moe", known.Box(versions={"flashinfer": "0.6.5"}))
    assert MOE_GARBAGE not in ids("moe", known.Box(versions={"flashinfer": "0.6.7"}))
    # A post release counts as its release, as the pins do.
    assert MOE_GARBAGE in ids("moe", known.Box(versions={"flashinfer": "0.6.5.post1"}))
    assert "flashinfer-fp4-zeros-by-m-0.6.12" in ids("moe", known.Box(versions={"flashinfer": "0.6.12"}))
    assert "flashinfer-fp4-zeros-by-m-0.6.12" not in ids("moe", known.Box(versions={"flashinfer": "0.6.13"}))


def test_matched_by_gpu_family_tp_quantization_and_profile():
    sm120 = known.Box(gpu_family="sm120", gpus=2, tp=2)
    assert "fusion-tp2-sm120-sglang-dsv4" in ids("fusion", sm120)
    assert "fusion-tp4-sm120-regression" not in ids("fusion", sm120)
    assert "fusion-8x-sm120-pcie-slower" not in ids("fusion", sm120)  # 8 GPUs, not 2
    assert ids("fusion", known.Box(gpu_family="sm90")) == set()  # an H100 is not concerned
    assert "fusion-tp4-sm120-regression" in ids("all", known.Box(tp=4))  # all contains fusion
    assert "fusion-tp4-sm120-regression" not in ids("moe", known.Box(tp=4))
    bf16 = known.Box(versions={"flashinfer": "0.6.5"}, quantization="fp8")
    assert MOE_GARBAGE not in ids("moe", bf16)
    nvfp4 = known.Box(versions={"flashinfer": "0.6.5"}, quantization="modelopt_fp4")
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


def test_a_line_says_the_evidence_what_was_run_and_the_source_quoted():
    e = entry("vllm-allreduce-fusion-tp2-sm120-faster")
    line = e.full()
    assert "(confounded, vLLM)" in line and "one run per" in line
    assert "differed: patch, flashinfer-build, cuda-runtime-resolver" in line
    assert line.endswith('"' + e.quote + '")')
    assert "single run per concurrency cell" in line  # the caveat, in the source's words
    assert "(unpublished, SGLang)" in entry("fusion-8x-sm120-pcie-slower").full()


def test_a_short_line_names_the_kernel_what_it_compares_with_and_the_engine():
    """40.6: a one-line summary says which kernel it is about and what it is compared with,
    so `moe slower` cannot read as "moe is slower than upstream"."""
    for e in known.entries():
        line = e.line()
        assert len(line) <= known.SHORT == 120, line
        assert line.startswith(f"known: {e.about} ({e.kernel}) {e.outcome}"), line
        if e.outcome in known.COMPARED:  # what it is compared with, in the library's entries
            assert e.against and f" {e.against} (" in line, line
        assert not line.endswith("..."), line  # where it applies is never cut off
    assert entry("moe-cutlass-slower-than-b12x-tp4").line() == (
        "known: moe (flashinfer_cutlass) slower than b12x (confounded, SGLang): sm120, tp == 4")
    # The dense GEMM bug is about mm_fp4 on every server, not about the MoE profile.
    assert entry("flashinfer-mm-fp4-zeros-0.6.3").line() == (
        "known: any server (mm_fp4 cutlass) wrong-output (measured, FlashInfer alone): "
        "flashinfer == 0.6.3, sm120")
    # A figure from two different builds says so on the short line, not "measured".
    assert entry("vllm-moe-b12x-vs-marlin-2x5070ti-confounded").line() == (
        "known: vllm-moe (flashinfer_b12x) faster than marlin (confounded, vLLM): sm120, gpus == 2")


def test_an_entry_that_calls_itself_confounded_says_so_in_its_evidence():
    for e in known.entries():
        if "confounded" in e.measured or "confounded" in e.id:
            assert e.evidence == "confounded", e.id


UNQUOTED = (
    'schema = 1\n[[outcome]]\nid = "ours"\noutcome = "faster"\nfigure = "f"\ndate = "2026"\n'
    'source = "https://example.org/x"\nevidence = "measured"\n'
)


def test_an_entry_without_a_quote_fails_the_library_not_a_pack():
    # A pack's own entry may leave the quote out...
    assert [e.quote for e in known.entries(UNQUOTED)] == [""]
    # ... the library's may not: the built-in known.toml is read as `quoted`.
    with pytest.raises(UsageError, match="1 entries quote no source \\(ours\\)"):
        known.entries(UNQUOTED, quoted=True)
    quoted = UNQUOTED + ('quote = "the figure, as the source writes it"\nengine = "sglang"\n'
                         'kernel = "k"\ndiffers = ["patch"]\nagainst = "upstream"\n')
    assert known.entries(quoted, quoted=True)[0].quote == "the figure, as the source writes it"
    # The field report has no text to quote, and its quote says so.
    field = quoted.replace('"measured"', '"unpublished"')
    with pytest.raises(UsageError, match="quote no source"):
        known.entries(field, quoted=True)


def test_the_library_is_read_quoted(mocker, tmp_path):
    """The built-in pack's known.toml with one quote dropped fails every read of it; the same
    file as another pack's loads."""
    from pathlib import Path
    from types import SimpleNamespace

    from sm120patch import patches
    from sm120patch.plan import catalog

    text = (Path(next(iter(patches.__path__))) / "known.toml").read_text(encoding="utf-8")
    first = text.index("\nquote = ")
    (tmp_path / "known.toml").write_text(text[:first] + text[text.index("\n", first + 1):])
    for built_in in (True, False):
        pack = SimpleNamespace(location=str(tmp_path), built_in=built_in)
        mocker.patch.object(catalog, "load", return_value=SimpleNamespace(loaded=[pack]))
        if built_in:
            with pytest.raises(UsageError, match="quote no source"):
                known.entries()
        else:
            assert len(known.entries()) == text.count("[[outcome]]")


def test_the_sglang_fusion_figure_of_pr_30700_is_known():
    e = entry("fusion-tp2-sm120-sglang-dsv4")
    assert e.outcome == "faster" and e.evidence == "measured"
    assert "+5.2% on medians" in e.quote and "five consecutive 30 s runs" in e.quote
    assert "pull/30700" in e.source and "2026-07-24" in e.source
    assert e.id in ids("fusion", known.Box(gpu_family="sm120", tp=2))
    assert e.id not in ids("fusion", known.Box(gpu_family="sm120", tp=4))


def test_the_cutlass_b12x_figure_says_the_fp4_gemm_backend_differed_too():
    e = entry("moe-cutlass-slower-than-b12x-tp4")
    assert "--fp4-gemm-backend flashinfer_cudnn" in e.measured and "flashinfer_cudnn" in e.quote
    assert "not the MoE runner's alone" in e.measured


def test_only_a_wrong_output_entry_about_the_profile_condemns_it():
    old = known.Box(versions={"sglang": "0.5.9", "flashinfer": "0.6.5"}, gpu_family="sm120")
    new = known.Box(versions={"sglang": "0.5.9", "flashinfer": "0.6.8"}, gpu_family="sm120")
    assert [e.id for e in known.condemning("moe", old)] == [MOE_GARBAGE]
    assert known.condemning("moe", new) == []
    # The mm_fp4 entries are about every NVFP4 server, not about moe.
    fp4 = known.Box(versions={"flashinfer": "0.6.12"}, gpu_family="sm120")
    assert known.condemning("moe", fp4) == []
    assert known.condemning("moe", known.Box(versions={"flashinfer": "0.6.1"},
                                             gpu_family="sm90")) == []


@pytest.mark.parametrize(("fi_version", "shown"), [("0.6.5", True), ("0.6.8", False)])
def test_doctor_and_apply_show_matching_entries(tmp_path, mocker, fi_version, shown):
    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())  # no GPU seen: not excluding
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", fi_version, "installed")
    code, short, err = run_cli("doctor", "--sglang", str(sg), "--flashinfer", str(fi))
    assert code == 0, err
    known_lines = [line for line in short.splitlines() if line.startswith("known: ")]
    assert known_lines and all(len(line) <= 120 for line in known_lines), short
    assert "in full: `sm120patch doctor --verbose" in short  # where they are in full
    code, out, err = run_cli("doctor", "--sglang", str(sg), "--flashinfer", str(fi), "--verbose")
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
        assert f"profile moe refuses FlashInfer {fi_version}" in err and "issues/2723" in err
        # Inside the pins: the hint is the refusal's, not "use a pinned release".
        assert "  use a release it does not refuse (its reason says which), or apply " \
            "anyway: the command above" in err and "pinned release" not in err
        # the next: line is the user's own command with --force, as it pastes
        assert f"  next: sm120patch {' '.join(dry)} --force\n" in err, err
        code, out, err = run_cli(*dry, "--force")
    assert code == 0, err
    assert ("known: moe (flashinfer_cutlass) wrong-output" in err) is shown
    assert "known:" not in out  # the diff on stdout stays `git apply`-able
    assert "known: fusion" not in err  # a fusion entry is not about moe
    code, out, err = run_cli(
        "apply", "moe", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check",
        *(["--force"] if shown else []),
    )
    assert code == 0, err
    head = out.split("\napplied")[0]  # the known lines come before the report
    assert ("known: moe (flashinfer_cutlass) wrong-output" in head) is shown
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
    from sm120patch.targets import finding

    fi = finding.find("flashinfer", make_tree(tmp_path, "flashinfer", "0.6.5", "installed"))
    mocker.patch.object(known, "installed_targets", return_value=[fi])
    code, out, err = run_cli("list")
    assert code == 0, err
    moe = out.split("\nfusion")[0]
    assert "[recommended, not here]" in moe
    assert "not recommended here: profile moe refuses FlashInfer 0.6.5" in moe
    assert "known: moe (flashinfer_cutlass) wrong-output" in moe
    code, out, _ = run_cli("list", "--json")
    import json

    doc = {p["name"]: p for p in json.loads(out)["profiles"]}
    assert doc["moe"]["not_recommended_here"] and not doc["fusion"]["not_recommended_here"]
    mocker.patch.object(known, "installed_targets", return_value=[])
    code, out, _ = run_cli("list")
    assert "[recommended]" in out and "not here" not in out


# ---- 39.7: claims that cannot travel --------------------------------------------------------

RAN = (
    'schema = 1\n[[outcome]]\nid = "e"\nprofile = "fusion"\noutcome = "faster"\nfigure = "f"\n'
    'date = "2026"\nsource = "https://example.org/x"\nquote = "q as written"\n'
    'against = "NCCL"\n'
)


@pytest.mark.parametrize(
    ("ran", "most"),
    [
        ('engine = "sglang"\nkernel = "trtllm-allreduce"\ndiffers = ["patch"]\n', "measured"),
        # vLLM's figure under SGLang's fusion: another engine
        ('engine = "vllm"\nkernel = "trtllm-allreduce"\ndiffers = ["patch"]\n', "inferred"),
        # another kernel's figure (a one-shot allreduce) under this profile
        ('engine = "sglang"\nkernel = "oneshot-allreduce"\ndiffers = ["patch"]\n', "inferred"),
        # the FP4 GEMM backend changed too
        ('engine = "sglang"\nkernel = "trtllm-allreduce"\ndiffers = ["patch", "fp4-gemm-backend"]\n',
         "confounded"),
    ],
)
def test_the_evidence_word_is_derived_from_what_the_source_ran(ran, most):
    """An entry's evidence may claim at most what its engine, kernel and `differs` allow:
    claiming one step more fails the library's read in one line naming the entry."""
    order = ["inferred", "reported", "confounded", "measured"]
    for word in order:
        text = RAN + ran + f'evidence = "{word}"\n'
        if order.index(word) <= order.index(most):
            assert known.ceiling(known.entries(text, quoted=True)[0]) == most
        else:
            with pytest.raises(UsageError, match=f"e \\({word}, but what it ran allows {most}"):
                known.entries(text, quoted=True)


def test_an_entry_that_does_not_say_what_it_ran_fails_the_library():
    with pytest.raises(UsageError, match="e \\(no engine, kernel, differs\\)"):
        known.entries(RAN + 'evidence = "measured"\n', quoted=True)
    assert known.entries(RAN + 'evidence = "measured"\n')[0].engine == ""  # a pack's may


def test_known_toml_passes_the_derived_evidence_check():
    """Every shipped entry, its evidence word against the ceiling derived from its fields
    (the loader raises too; this names the entry and both words)."""
    for e in known.entries():
        most = known.ceiling(e)
        assert known.STRENGTH[e.evidence] <= known.STRENGTH[most], (e.id, e.evidence, most)
        assert e.engine in known.ENGINES and e.kernel, e.id


def test_the_five_claims_of_issue_39_say_no_more_than_their_sources():
    found = {e.id: e for e in known.entries()}
    # A vLLM measurement is no longer under SGLang's fusion as measured.
    assert "fusion-tp2-sm120-faster" not in found
    assert not [e for e in found.values() if e.condition.get("profile") == "fusion"
                and e.engine != "sglang" and e.evidence == "measured"]  # fmt: skip
    # lukealonso's one-shot kernel is not SGLang's stock custom allreduce.
    for name in ("pcie-oneshot-allreduce-tp4", "pcie-oneshot-allreduce-tp8-cross-numa"):
        assert found[name].evidence == "inferred" and found[name].kernel == "oneshot-allreduce"
    assert found["moe-cutlass-slower-than-b12x-tp4"].evidence == "confounded"
    assert "fp4-gemm-backend" in found["moe-cutlass-slower-than-b12x-tp4"].differs
    # One shape on one release: held to that release.
    assert found["flashinfer-mm-fp4-zeros-0.6.3"].condition["flashinfer"] == "==0.6.3"
    garbage = found[MOE_GARBAGE]
    assert garbage.evidence == "inferred" and garbage.engine == "vllm"
    assert garbage.condition["flashinfer"] == "==0.6.5"
    assert "compute_120f" in garbage.quote and "cutlass/issues/3096" in garbage.quote


def test_the_moe_refusal_says_what_the_sources_say():
    """The refusal of FlashInfer before 0.6.7 rests on the TMA grouped-GEMM failure that
    0.6.7's CUTLASS is credited with, and says the garbage output was a build target's."""
    from sm120patch.plan import catalog

    for name in ("moe", "all"):
        (refusal,) = catalog.load().profiles[name].refuse
        reason = " ".join(refusal.reason.split())
        assert "cutlass/issues/3096" in reason and "compute_120f" in reason, name
        assert "CUDA 13.0" in reason and "vllm/pull/38423" in reason, name
        assert "not by a FlashInfer release" in reason or "no FlashInfer release" in reason
