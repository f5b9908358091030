"""The house's own rules that are not about imports (tests/test_imports.py holds those): no
module is a warehouse, and nothing cites a document the repository does not hold or an issue
of this project's tracker, which users cannot open."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST_LINES = 700
# Everything a user or a newcomer reads: the code, the patch library and its data, the docs.
READ = ("sm120patch", "patches", "docs", "benchmarks", "examples", "ansible_collections", "tests")
# Issues of upstream projects may be cited: the word before "issue N" names the project.
UPSTREAM = re.compile(
    r"(flashinfer|sglang|sgl-project/sglang|flashinfer-ai/flashinfer|cutlass|NVIDIA/cutlass|vllm"
    r"|vLLM|FlashInfer|SGLang|vllm-project/vllm)$"
)
ISSUE = re.compile(r"\b(\S+)\s+issues?\s+#?\d+|\bIssue\s+#?\d+", re.IGNORECASE)


def _files() -> list[Path]:
    out = []
    for top in READ:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".md", ".toml", ".yml", ".yaml", ".j2", ".cfg") and (
                "__pycache__" not in path.parts
            ):
                out.append(path)
    return out + [ROOT / "README.md"]


def citations(text: str) -> list[str]:
    """The references to DESIGN or to a project issue in `text`."""
    found = [m.group(0) for m in re.finditer(r"\bDESIGN\b", text)]
    for m in ISSUE.finditer(text):
        before = m.group(1) if m.group(1) else ""
        if not UPSTREAM.search(before.strip("(`'\",")):
            found.append(m.group(0))
    return found


def test_no_module_over_700_lines():
    for path in (ROOT / "sm120patch").rglob("*.py"):
        lines = path.read_text(encoding="utf-8").count("\n")
        assert lines <= MOST_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


# The size cap a module is held to, met by splitting by responsibility: a `# fmt: skip` (or
# `# fmt: off`) that keeps lines packed to stay under it does not count.
MOST_LINES_SPLIT = 600
PACKED = re.compile(r"#.*\bfmt:\s*(?:skip|off)\b")  # also "# why; fmt: skip"


def packed_or_long(root: Path = ROOT) -> dict[str, str]:
    """The modules under sm120patch/ and patches/ over MOST_LINES_SPLIT lines or holding a
    formatter escape, each with what is wrong with it."""
    found = {}
    for path in sorted([*(root / "sm120patch").rglob("*.py"), *(root / "patches").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        wrong = []
        if (lines := text.count("\n")) > MOST_LINES_SPLIT:
            wrong.append(f"{lines} lines")
        if packed := len(PACKED.findall(text)):
            wrong.append(f"{packed} fmt: skip")
        if wrong:
            found[path.relative_to(root).as_posix()] = ", ".join(wrong)
    return found


def test_no_module_is_packed_or_over_600_lines():
    assert packed_or_long() == {}


def test_the_size_check_finds_a_packed_and_a_long_module(tmp_path):
    (tmp_path / "sm120patch" / "plan").mkdir(parents=True)
    (tmp_path / "patches").mkdir()
    (tmp_path / "sm120patch" / "plan" / "long.py").write_text("x = 1\n" * 601)
    (tmp_path / "sm120patch" / "plan" / "short.py").write_text("x = 1\n" * 600)
    (tmp_path / "patches" / "p_one.py").write_text("X = (1,\n     2)  # kept; fmt: skip\n")
    assert packed_or_long(tmp_path) == {
        "patches/p_one.py": "1 fmt: skip",
        "sm120patch/plan/long.py": "601 lines",
    }


# The command layer's three shared modules stay small: each verb family lives in commands/ and
# cmdline/, never packed back into them.
COMMAND_LAYER = ("cli.py", "render.py", "app.py")
MOST_COMMAND_LAYER_LINES = 450


def test_the_command_layers_shared_modules_stay_under_450_lines():
    long = {
        name: lines
        for name in COMMAND_LAYER
        if (lines := (ROOT / "sm120patch" / name).read_text(encoding="utf-8").count("\n"))
        >= MOST_COMMAND_LAYER_LINES
    }
    assert long == {}, long


def test_nothing_cites_a_document_or_issue_users_cannot_open():
    here = Path(__file__).resolve()
    bad = {
        str(p.relative_to(ROOT)): c
        for p in _files()
        if p.resolve() != here and (c := citations(p.read_text(encoding="utf-8")))
    }
    assert bad == {}


def test_the_citation_check_tells_upstream_issues_from_ours():
    assert citations("see flashinfer issue 2723 and sgl-project/sglang issue 9140") == []
    assert citations("DESIGN s4 A") == ["DESIGN"]
    assert citations("reported in sm120patch issue 11") == ["sm120patch issue 11"]
    assert citations("Issue 3's done when") == ["Issue 3"]


# An upstream issue or pull request named by number, which a reader has to look up by hand.
BARE = re.compile(
    r"\b(?:sgl-project/sglang|flashinfer-ai/flashinfer|sglang|flashinfer|vllm)\s+"
    r"(?:issue|PR|pull request)\s+#?(\d+)",
    re.IGNORECASE,
)


def bare_references(text: str) -> list[str]:
    """Upstream issues and PRs named by number with no link to them nearby (the same number in
    a github.com URL within the next 160 characters counts as the link)."""
    found = []
    for m in BARE.finditer(text):
        near = text[m.end() : m.end() + 160]
        if not re.search(rf"github\.com/\S+/(?:issues|pull)/{m.group(1)}\b", near):
            found.append(m.group(0))
    return found


def test_upstream_issues_and_prs_are_named_by_their_links():
    """What the tool prints about the field (the patch library: profiles, known outcomes,
    patch texts) and what users read (README, docs) names upstream issues by URL."""
    paths = [*(ROOT / "patches").iterdir(), ROOT / "README.md", ROOT / "CHANGELOG.md",
             *(ROOT / "docs").glob("*.md")]  # fmt: skip
    bad = {
        str(p.relative_to(ROOT)): refs
        for p in paths
        if p.suffix in (".py", ".toml", ".md")
        and (refs := bare_references(p.read_text(encoding="utf-8")))
    }
    assert bad == {}


def test_the_link_check_finds_bare_numbers():
    assert bare_references("reported (flashinfer issue 2723), so") == ["flashinfer issue 2723"]
    assert bare_references("as sgl-project/sglang PR 38170 does") == ["sgl-project/sglang PR 38170"]
    assert bare_references("https://github.com/flashinfer-ai/flashinfer/issues/2723") == []
    assert bare_references(
        "FlashInfer PR 3903 (https://github.com/flashinfer-ai/flashinfer/pull/3903)"
    ) == []
    assert bare_references("FlashInfer PR 3903 (https://github.com/x/y/pull/3904)") != []


def test_every_exit_code_is_documented():
    """The operator guide's table and the README's line name every code the tool exits with:
    each error class's, the measured verdicts' (5, 6), explain's (7), unfinished (75) and
    interrupted (130)."""
    from sm120patch import errors

    raised = {
        c.exit_code
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.Sm120Error)
    }
    codes = raised | {0, 5, 6, 7, 75, 130}
    guide = (ROOT / "docs" / "operator.md").read_text(encoding="utf-8")
    table = guide[guide.index("## Exit codes") :]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert documented == codes
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = re.sub(r"\s+", " ", readme[readme.index("Exit codes:") :][:700])
    for code in sorted(codes):
        assert re.search(rf"\b{code} [a-z`]", line), (code, line)


def test_the_readmes_map_names_every_wing():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    map_ = readme[readme.index("## Map of the code") :]
    wings = sorted(
        p.name for p in (ROOT / "sm120patch").iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    )  # fmt: skip
    assert wings and [w for w in wings if f"`{w}/`" not in map_] == []


def unnamed_modules(doc: str, root: Path = ROOT) -> list[str]:
    """The modules under sm120patch/ and patches/ that docs/ARCHITECTURE.md does not name: a
    module of a wing by its file name in that wing's row of the table, or by its path
    (`engine/pristine.py`) or dotted name (`plan.planner`) anywhere; a top-level module, a patch
    module or a package's `__init__.py` with any code in it by its file name or path. An empty
    `__init__.py` is packaging, not a module."""
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_]+)/` \|.*$", doc, re.M)}
    missing = []
    for path in sorted([*(root / "sm120patch").rglob("*.py"), *(root / "patches").rglob("*.py")]):
        rel = path.relative_to(root)
        if path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip():
            continue
        inner = rel.parts[1:]  # below sm120patch/ or patches/
        if len(inner) == 1:
            named = f"`{path.name}`" in doc or rel.as_posix() in doc
        else:
            wing = inner[0]
            named = (
                (path.name != "__init__.py" and f"`{path.name}`" in rows.get(wing, ""))
                or f"{wing}/{path.name}" in doc
                or (path.name != "__init__.py" and f"{wing}.{path.stem}" in doc)
            )
        if not named:
            missing.append(rel.as_posix())
    return missing


def test_the_architecture_names_every_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert unnamed_modules(doc) == []


def test_the_module_check_finds_an_unnamed_module(tmp_path):
    (tmp_path / "sm120patch" / "plan").mkdir(parents=True)
    (tmp_path / "patches").mkdir()
    for rel in ("sm120patch/plan/planner.py", "sm120patch/plan/extra.py", "patches/p_one.py",
                "sm120patch/plan/__init__.py"):  # fmt: skip
        (tmp_path / rel).write_text("x = 1\n" if "__init__" not in rel else "")
    doc = "| `plan/` | q | the planner (`planner.py`) |\n\n`p_one.py`\n\nsee `extra.py`\n"
    assert unnamed_modules(doc, tmp_path) == ["sm120patch/plan/extra.py"]


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    """.ci/run times the README's test command one step at a time: its steps, joined by &&,
    are that command, in its order."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (command,) = {m.strip() for m in re.findall(r"^ *(pip install -e .*)$", readme, re.M)}
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    steps = [shlex.split(line)[2:] for line in ci.splitlines() if line.startswith("timed ")]
    assert " && ".join(shlex.join(s) for s in steps) == shlex.join(shlex.split(command)).replace(
        " '&&' ", " && "
    )
