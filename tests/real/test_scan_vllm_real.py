"""`scan` on vLLM 0.34.0's own `.py` files: vLLM's capability checks are read as the kit's words
say (counted against a plain search of the bytes), the counts are those #32 states, and the
gates read by hand in `tests/data/scan_labels_vllm.toml` have the class their reading gives.

The release comes from the release cache as its `.py` files and dist-info (`maintain/sources.py`:
never the ~240 MB wheel). Without the network the tests skip, saying so."""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from sm120patch.maintain import releases, sources
from sm120patch.patchkit import arch
from sm120patch.scan import evaluate, report, run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.real

LABELS = Path(__file__).parent.parent / "data" / "scan_labels_vllm.toml"
VERSION = "0.34.0"


@pytest.fixture(scope="module")
def vllm_dir() -> Path:
    """vLLM's package directory of `.py` files, from the release cache (its sources alone, read
    from the wheel by range requests: `maintain/sources.py`)."""
    if not releases.index_reachable():
        pytest.skip(f"the index ({releases.index_sources()}) is unreachable: vLLM's sources "
                    "are fetched from it")  # fmt: skip
    return sources.tree("vllm", VERSION) / "vllm"


@pytest.fixture(scope="module")
def vllm_scan(vllm_dir: Path) -> run.Report:
    """`sm120patch scan --vllm TREE` on the release, once for every test here: the report the
    command prints (`report.text`) and the gates the tests read."""
    return run.scan({"vllm": str(vllm_dir.parent)})


def checks_by_call(root: Path) -> Counter[tuple[str, object]]:
    """Every vLLM capability check with a constant argument the kit reads as one, by (method,
    argument), over every `.py` of the package."""
    out: Counter[tuple[str, object]] = Counter()
    # A call the kit reads names its method in the source, and every method it reads holds
    # "capability": a file without that word holds none (parsing only the rest is sound).
    assert all("capability" in m for m in arch.VLLM_CAPABILITY_CHECKS)
    for path in root.rglob("*.py"):
        data = path.read_bytes()
        if b"capability" not in data:
            continue
        for node in ast.walk(ast.parse(data)):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            spelled = evaluate.spelled(node.func)
            argument = evaluate._constant(node.args[0])
            if arch.capability_check(spelled, argument) is not None:
                method = (spelled or "").rsplit(".", 1)[-1].removesuffix("()")
                out[method, argument] += 1
    return out


def test_vllm_capability_checks_are_all_read(vllm_dir: Path) -> None:
    """What a plain search of the bytes counts (a call spelled `family(100` on one line or
    across two), the kit reads as an arch check: #32's "128 SM100-family capability checks and
    39 SM120 ones"."""
    text = "\n".join(p.read_text("utf-8") for p in vllm_dir.rglob("*.py"))

    def plain(method: str, number: str) -> int:
        return len(re.findall(rf"\.{method}\(\s*{re.escape(number)}\s*[,)]", text))

    read = checks_by_call(vllm_dir)
    family = "is_device_capability_family"
    assert read[family, 100] == plain(family, "100")
    assert read[family, 120] == plain(family, "120")
    assert read["is_device_capability", 90] == plain("is_device_capability", "90")
    assert read["has_device_capability", 100] == plain("has_device_capability", "100")
    # #32's figures, counted as the family calls: 39 SM120 ones exactly; the SM100 family is
    # 115 `is_device_capability_family(100)` and 135 with every exact 10.x check
    assert read[family, 120] == 39
    sm100 = sum(
        n for (method, argument), n in read.items()
        if method != "has_device_capability"
        and (argument[0] if isinstance(argument, tuple) else argument // 10) == 10  # type: ignore[operator,index]
    )  # fmt: skip
    assert 115 <= read[family, 100] <= sm100 <= 140, (read[family, 100], sm100)
    # docs/scan.md prints these counts of this release: they are the ones read here.
    doc = " ".join((Path(__file__).parent.parent.parent / "docs" / "scan.md").read_text("utf-8")
                   .split())  # fmt: skip
    said = re.search(r"capability checks: (\d+) `is_device_capability_family\(100\)`, (\d+) "
                     r"`is_device_capability_family\(120\)` .*?, (\d+) exact 10\.x checks .*?, "
                     r"(\d+) `has_device_capability\(100\)`", doc)  # fmt: skip
    assert said, "docs/scan.md no longer prints vLLM's capability checks"
    assert [int(n) for n in said.groups()] == [
        read[family, 100], read[family, 120], sm100 - read[family, 100],
        read["has_device_capability", 100]]  # fmt: skip


def test_vllm_gates_are_found_and_classed(vllm_dir: Path, vllm_scan: run.Report) -> None:
    (out,) = vllm_scan.targets
    counts = out.counts()
    assert counts["covered"] == 3  # the gates the vLLM profiles patch
    assert counts["candidate"] > 50 and counts["kernel"] > 50 and counts["upstream"] > 10, counts
    by_predicate = Counter(
        word
        for x in out.gates
        for word in ("is_device_capability_family(100)", "has_device_capability(100)",
                     "is_device_capability(90)")  # fmt: skip
        if word in x.gate.expression
    )
    assert by_predicate["is_device_capability_family(100)"] > 50, by_predicate
    assert by_predicate["has_device_capability(100)"] > 5, by_predicate

    labels = tomllib.loads(LABELS.read_text("utf-8"))
    assert labels["version"] == VERSION
    for label in labels["gate"]:
        found = [
            x for x in out.gates
            if x.gate.file == label["file"] and x.gate.function == label["function"]
            and label["expression"] in x.gate.expression
        ]  # fmt: skip
        if label["label"] == "none":  # code #32 names that is no gate: there, and unlisted
            assert _in_function(vllm_dir.parent, label), label
            assert not [x for x in out.gates if x.gate.file == label["file"]
                        and x.gate.function == label["function"]], label  # fmt: skip
            continue
        assert len(found) == 1, (label, [x.gate.expression for x in found])
        assert found[0].cls == label["label"], (label, found[0].reason)


def _in_function(parent: Path, label: dict[str, str]) -> bool:
    """Whether the label's expression is in its function, as `ast` writes it back."""
    tree = ast.parse((parent / label["file"]).read_bytes())
    *owner, name = label["function"].split(".")
    scope: list[ast.stmt] = tree.body
    for cls in owner:
        scope = next(n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == cls)
    func = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    return label["expression"].removeprefix("or ") in ast.unparse(func)


DOCS = Path(__file__).parent.parent.parent / "docs"


def test_the_docs_print_the_counts_the_scan_command_prints(vllm_scan: run.Report) -> None:
    """Every figure docs/vllm.md and docs/scan.md print of `scan` on this release is the line
    the command prints for it (the seconds left out: they are the machine's, not the
    release's), so a release or a rule that moves a gate fails here until the docs follow."""
    printed = report.text(vllm_scan).splitlines()
    (line,) = [x for x in printed if x.startswith(f"vllm {VERSION}: ")]
    line = re.sub(r", [0-9.]+ s$", "", line)
    (summary,) = [x for x in printed if x.startswith("summary: ")]
    for name in ("vllm.md", "scan.md"):
        text = " ".join((DOCS / name).read_text("utf-8").split())
        assert f"`{line}`" in text, (name, line)
        # No other count of this release's scan is printed beside it.
        said = re.findall(rf"On vLLM {re.escape(VERSION)}[^.]*?(\d+) candidate", text)
        assert all(n == str(vllm_scan.counts()["candidate"]) for n in said), (name, said)
    assert summary.removeprefix("summary: ") in line
