"""`scan` on whole real releases (every `.py` of the wheel, read from the release cache): every
site a patch changes reads `covered` on every release inside the pins of its profile, and the
gates of SGLang 0.5.23 no profile covered when they were found read `candidate` (or `covered`,
once a profile's patch changes them: the expectation is read from the catalog)."""

from __future__ import annotations

import ast
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from realcache import RealReleases, SiteCase, SiteRun, release_set, workers

from sm120patch.maintain import releases, trees
from sm120patch.plan import catalog
from sm120patch.scan import run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.real

# What a patch that makes a gate admit SM120 writes: an SM120 word in a test (`or
# _is_sm120_supported`, `elif get_platform().is_sm120:`, `[9, 10, 12]`). A flag's definition
# (`_is_sm120_supported = ...`, sglang.sm120-flag) or an import is no test; a patch that writes
# no SM120 word (pcie-allreduce's GPU count, fusion-preflight's multicast query) changes no gate;
# nor does one that changes what SM120 already gets (fp4-gemm-auto on 0.5.11, where the auto
# choice has an `is_sm120_supported()` branch: the lines around its change name SM120 already).
SM120_WORD = re.compile(r"is_sm12\d|sm_?12\d(?!patch)|\b12\b", re.IGNORECASE)
NOT_A_TEST = re.compile(r"^\s*(?:_?is_sm12\w*\s*=|from\b|import\b|is_sm12\w*,?\s*$)")
AROUND = 3  # lines of the text before a change that say what it changes


def changes_an_arch_test(run_: SiteRun) -> bool:
    """Whether a patch's step writes an SM120 word into a test where the code around it named
    none (judged from its diff alone, not from what `scan` makes of it)."""
    import difflib

    def words(lines: list[str]) -> bool:
        code = [x.split("#")[0] for x in lines]
        return any(SM120_WORD.search(x) and not NOT_A_TEST.match(x) for x in code)

    old, new = run_.before.splitlines(), run_.after.splitlines()
    # A function the patch adds whole (pcie-ipc's helper) tests SM120 where upstream tested no
    # architecture at all: there is no released gate there for the scan to cover.
    had = {n.name for n in ast.walk(ast.parse(run_.before)) if isinstance(n, ast.FunctionDef)}
    added = {line for n in ast.walk(ast.parse(run_.after))
             if isinstance(n, ast.FunctionDef) and n.name not in had
             for line in range(n.lineno - 1, n.end_lineno or n.lineno)}
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new).get_opcodes():
        if (
            op != "equal"
            and words([x for j, x in enumerate(new[j1:j2], j1) if j not in added])
            and not words(old[max(0, i1 - AROUND) : i2 + AROUND])
        ):
            return True
    return False


# Gates of SGLang 0.5.23 that no profile covered when `scan` first read that release: the FP4
# GEMM auto choice, GDN's prefill default, the MHA attention default. (file, function, a part of
# the expression.)
KNOWN_0523 = [
    ("sglang/srt/layers/quantization/fp4_utils.py", "initialize_fp4_gemm_config",
     "get_platform().is_sm100"),
    ("sglang/srt/layers/attention/linear/gdn_backend.py", "flashinfer_gdn_prefill_default",
     "sm_major not in (9, 10)"),
    ("sglang/srt/arg_groups/model_override_base.py", "get_default_attn_backend",
     "get_platform().is_sm100 and is_no_spec_infer_or_topk_one"),
]  # fmt: skip

CASES = [(kind, v) for kind in releases.KINDS for v in release_set(kind)]


def _scan(case: tuple[str, str]) -> run.TargetScan:
    kind, version = case
    return run.scan_files(kind, version, trees.package_files(kind, version))


@pytest.fixture(scope="session")
def scans(real: object) -> dict[tuple[str, str], run.TargetScan]:
    """Every release of the session scanned once, in parallel (`real` checks the cache)."""
    n = min(workers(), len(CASES))
    if n <= 1:
        return {case: _scan(case) for case in CASES}
    # SGLang's big releases first, so the pool does not end on a long tail.
    order = sorted(CASES, key=lambda c: (c[0] != "sglang", c[1]), reverse=False)
    with ProcessPoolExecutor(max_workers=n) as pool:
        return dict(zip(order, pool.map(_scan, order), strict=True))


def _fact(patch_id: str, version: str):  # noqa: ANN202
    patch = catalog.load().patches[patch_id]
    facts = patch.facts_at(version)
    return facts[0] if facts else None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_every_site_a_patch_changes_reads_covered(
    real: RealReleases, scans: dict[tuple[str, str], run.TargetScan], case: tuple[str, str]
) -> None:
    kind, version = case
    found = scans[case]
    cat = catalog.load()
    checked = 0
    for profile in cat.profiles.values():
        if kind not in profile.targets or not profile.pinned(kind, version):
            continue
        for o in found.outcomes:
            if o.profile != profile.name or o.outcome != "applied":
                continue
            if not changes_an_arch_test(real.site(SiteCase(o.patch, kind, version))):
                continue
            covered = [
                x
                for x in found.of("covered")
                if any(c.profile == profile.name and c.patch == o.patch for c in x.covered_by)
            ]
            assert covered, (
                f"{o.patch} applies on {kind} {version} ({profile.name}, {o.file}::{o.site}) "
                "and the scan reports no gate it covers"
            )
            fact = _fact(o.patch, version)
            for x in covered:
                assert x.gate.file == o.file, f"{o.patch}: {x.gate.file}:{x.gate.line}"
                if fact is not None and fact.function:
                    assert x.gate.function == fact.function, (
                        f"{o.patch} on {version}: covers {x.gate.function}, its fact names "
                        f"{fact.function}"
                    )
            checked += 1
    if not checked:
        pytest.skip(f"no patch changes a gate of {kind} {version} (outside the pins, or upstream)")


@pytest.mark.parametrize("where", KNOWN_0523, ids=lambda w: w[1])
def test_known_gates_of_0523_read_candidate_until_a_profile_covers_them(
    scans: dict[tuple[str, str], run.TargetScan], where: tuple[str, str, str]
) -> None:
    if ("sglang", "0.5.23") not in scans:
        pytest.skip("SGLang 0.5.23 is not in this session's releases")
    file, function, part = where
    found = scans[("sglang", "0.5.23")]
    gates = [x for x in found.gates if x.gate.file == file and x.gate.function == function]
    hits = [x for x in gates if part in x.gate.key[2]]  # the whole expression
    assert len(hits) == 1, [x.gate.expression for x in gates]
    # Covered once a patch of the catalog changes this function on 0.5.23, else a candidate.
    patches = _patches_naming(file, function, "0.5.23")
    if patches:
        assert hits[0].cls == "covered", hits[0].reason
        assert {c.patch for c in hits[0].covered_by} & set(patches)
    else:
        assert hits[0].cls == "candidate", hits[0].reason


# The NVFP4 MoE runner's `auto` (from 0.5.13: MARLIN for `(8, 0) <= capability < (10, 0)`,
# else FLASHINFER_TRTLLM): SM120 goes SM100's way, into TRT-LLM-gen MoE, which it cannot run.
MOE_AUTO = ("sglang/srt/layers/quantization/modelopt_quant.py",
            "ModelOptNvFp4FusedMoEMethod.create_moe_runner", "(8, 0) <= get_device_capability()")  # fmt: skip
MOE_AUTO_CASES = [c for c in CASES if c[0] == "sglang" and Version(c[1]) >= Version("0.5.13")]


def _patches_naming(file: str, function: str, version: str) -> list[str]:
    return [
        p.id
        for p in catalog.load().patches.values()
        if any(f.file == file and f.function == function for f in p.facts_at(version))
    ]


@pytest.mark.parametrize("case", MOE_AUTO_CASES, ids=lambda c: c[1])
def test_the_nvfp4_moe_auto_choice_is_a_gap_naming_trtllm_gen(
    scans: dict[tuple[str, str], run.TargetScan], case: tuple[str, str]
) -> None:
    file, function, part = MOE_AUTO
    gates = [x for x in scans[case].gates if x.gate.file == file and x.gate.function == function]
    hits = [x for x in gates if part in x.gate.key[2]]
    assert len(hits) == 1, [x.gate.expression for x in gates]
    # Covered once a patch of the catalog changes this function on the release, else a gap.
    patches = _patches_naming(file, function, case[1])
    if patches:
        assert hits[0].cls == "covered", hits[0].reason
        assert {c.patch for c in hits[0].covered_by} & set(patches)
    else:
        assert (hits[0].cls, hits[0].family) == ("candidate", "trtllm-gen-moe"), hits[0].reason
        assert "flashinfer_trtllm" in hits[0].reason and "TRT-LLM-gen" in hits[0].reason


# The hand-labelled sample (tests/data/scan_labels.toml): scan's precision per class on it.
LABELS = Path(__file__).resolve().parent.parent / "data" / "scan_labels.toml"


def labelled() -> dict[str, Any]:
    return dict(tomllib.loads(LABELS.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def labelled_scans(real: RealReleases) -> dict[tuple[str, str], run.TargetScan]:
    """The releases the sample was drawn from (FlashInfer 0.7.4 is outside the default set)."""
    cases = sorted({(g["target"], g["version"]) for g in labelled()["gate"]})
    return {case: _scan(case) for case in cases}


def precision(
    gates: list[dict[str, str]], scans: dict[tuple[str, str], run.TargetScan]
) -> dict[str, tuple[int, int]]:
    """scan class -> (labelled gates of that class whose label agrees, labelled gates of that
    class). A labelled gate the scan no longer finds is an error: the sample is stale."""
    out: dict[str, tuple[int, int]] = {}
    for g in gates:
        found = [
            x
            for x in scans[(g["target"], g["version"])].gates
            if (x.gate.file, x.gate.function, x.gate.kind, x.gate.key[2], x.gate.key[3])
            == (g["file"], g["function"], g["kind"], g["expression"], g["occurrence"])
        ]
        assert found, f"no longer found: {g['file']} {g['function']} {g['expression'][:80]}"
        right, seen = out.get(found[0].cls, (0, 0))
        out[found[0].cls] = (right + (g["label"] == found[0].cls), seen + 1)
    return out


def test_scan_precision_per_class_holds_on_the_labelled_sample(
    labelled_scans: dict[tuple[str, str], run.TargetScan],
) -> None:
    doc = labelled()
    found = precision(doc["gate"], labelled_scans)
    for cls, floor in doc["precision"].items():
        right, seen = found.get(cls, (0, 0))
        assert seen, f"no labelled gate reads {cls} any more"
        assert right / seen >= floor, (
            f"{cls}: {right} of {seen} labels agree ({right / seen:.2f}), below the "
            f"{floor} docs/scan.md reports"
        )


def test_a_whole_sglang_release_in_seconds(scans: dict[tuple[str, str], run.TargetScan]) -> None:
    """Text first: most files are never parsed."""
    for (kind, version), found in scans.items():
        if kind == "sglang":
            assert found.files_parsed < found.files_read / 4, (version, found.files_parsed)
            assert not found.problems, (version, found.problems[:3])


DOCS = Path(__file__).parent.parent.parent / "docs"
ROW = re.compile(r"^\| (SGLang|FlashInfer) (\S+) \| ([\d,]+) \| ([\d,]+) \|((?: \d+ \|){4})$", re.M)


def test_the_docs_table_of_whole_releases_is_what_scan_reads_now(
    scans: dict[tuple[str, str], run.TargetScan],
    labelled_scans: dict[tuple[str, str], run.TargetScan],
) -> None:
    """docs/scan.md's table of gates per class on whole releases is the scans of this session
    (each release scanned once, shared with the tests above): a rule or a profile that moves a
    gate fails here until the table is written again from what `scan` prints."""
    rows = ROW.findall((DOCS / "scan.md").read_text("utf-8"))
    assert len(rows) >= 5, rows
    found = {**scans, **labelled_scans}
    for name, version, read, parsed, classes in rows:
        scan = found[(name.lower(), version)]
        counts = scan.counts()
        printed = [int(n) for n in classes.split("|") if n.strip()]
        assert [int(read.replace(",", "")), int(parsed.replace(",", ""))] == [
            scan.files_read, scan.files_parsed], (name, version)  # fmt: skip
        assert printed == [counts[c] for c in ("candidate", "covered", "upstream", "kernel")], (
            name, version, counts)  # fmt: skip
