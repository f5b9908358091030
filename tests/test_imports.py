"""The house's import rules, read from the code: the import graph of sm120patch/ (and of the
patch library) has no circle and no import from a wing to a wing after it, counting the imports
inside functions and under `if TYPE_CHECKING:` (a type-only import is a dependency a reader
follows too; only `__main__` guards are left out). Runtime code never imports torch, SGLang
or FlashInfer. docs/ARCHITECTURE.md describes the wings and their order."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sm120patch"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.with_suffix("").relative_to(PACKAGE.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _skipped(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)


def _imports(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if _skipped(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        found |= _imports(node, modules)
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# The wings in import order: a module may import only its own wing and the wings before it.
# `sm120patch` is the package's face (its version) and errors.py the typed errors every wing
# raises; the patch library (patches/, shipped as sm120patch.patches) stands on the kit alone.
WINGS = (
    "sm120patch",
    "sm120patch.errors",
    "sm120patch.safeio",
    "sm120patch.handle",
    "sm120patch.patchkit",
    "sm120patch.patches",
    "sm120patch.config",
    "sm120patch.targets",
    "sm120patch.plan",
    "sm120patch.engine",
    "sm120patch.trial",
    "sm120patch.explain",
    "sm120patch.scan",
    "sm120patch.maintain",
    "sm120patch.app",
    "sm120patch.commands",
    "sm120patch.terminal",
    "sm120patch.render",
    "sm120patch.cmdline",
    "sm120patch.cli",
    "sm120patch.__main__",
)
LIBRARY = PACKAGE.parent / "patches"


def wing_of(module: str) -> int:
    """The floor of `module`: the index of the longest wing name that contains it."""
    best = max((w for w in WINGS if module == w or module.startswith(w + ".")), key=len)
    return WINGS.index(best)


def graph() -> dict[str, set[str]]:
    """Each module's imports, plus its package: Python runs a package's `__init__.py` before
    any module of it, so an init importing a module of its own package is a circle too."""
    modules = _modules()
    for path in LIBRARY.glob("*.py"):
        stem = path.stem
        modules["sm120patch.patches" + ("" if stem == "__init__" else f".{stem}")] = path
    return {
        name: ({m for m in _imports(ast.parse(path.read_text()), modules) if m in modules}
               | {name.rpartition(".")[0]} & set(modules)) - {name}
        for name, path in modules.items()
    }  # fmt: skip


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (a, b) for a, deps in edges.items() for b in deps if wing_of(b) > wing_of(a)
    )


def test_the_import_graph_has_no_cycle():
    edges = graph()
    # the graph reads what it should: the engine's apply reads the store and the layouts
    assert any("sm120patch.engine.store" in deps for name, deps in edges.items()
               if name.startswith("sm120patch.engine"))  # fmt: skip
    assert cycles(edges) == []


def test_no_wing_imports_a_later_wing():
    edges = graph()
    assert {wing_of(m) for m in edges} >= {WINGS.index(w) for w in ("sm120patch.patchkit",
        "sm120patch.targets", "sm120patch.plan", "sm120patch.engine", "sm120patch.cli")}  # fmt: skip
    assert upward(edges) == []


def test_the_order_check_finds_an_upward_import():
    edges = {"sm120patch.plan.lockfile": {"sm120patch.engine.assess"},
             "sm120patch.engine.assess": {"sm120patch.targets"}}  # fmt: skip
    assert upward(edges) == [("sm120patch.plan.lockfile", "sm120patch.engine.assess")]


def test_every_module_has_a_wing():
    for name in graph():
        assert wing_of(name) >= 0, name
        assert name == "sm120patch" or wing_of(name) > 0, f"{name} belongs to no wing"


def test_a_package_init_importing_its_own_module_is_a_circle(tmp_path, monkeypatch):
    """The circle the import statements alone do not show: `pkg/__init__.py` importing
    `pkg.mod`, which Python can only import after running `pkg/__init__.py`."""
    pkg = tmp_path / "sm120patch" / "targets"
    pkg.mkdir(parents=True)
    (tmp_path / "sm120patch" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from sm120patch.targets import git\n")
    (pkg / "git.py").write_text("import os\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "sm120patch")
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", tmp_path / "none")
    assert cycles(graph()) == [["sm120patch.targets", "sm120patch.targets.git"]]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_code_never_imports_torch_sglang_or_flashinfer():
    for name, path in _modules().items():
        if name == "sm120patch.explain.probe":
            continue  # run by path in the target's own interpreter (explain), never imported
        top = {m.split(".")[0] for m in _imports(ast.parse(path.read_text()), {})}
        assert not top & {"torch", "sglang", "flashinfer"}, name


def test_the_cli_imports_only_the_command_layer_the_renderer_and_errors():
    """cli.py and its families (cmdline/) parse and render: everything they do goes through
    the command layer (app.py and commands/). A family reads a wing only for words (a trial's
    or a scan's report, the matrix's tables, a version range's text), and at runtime never
    the wings that find, plan or change a tree."""
    edges = graph()
    families = {m for m in edges if m.startswith("sm120patch.cmdline.")}
    allowed = {"sm120patch", "sm120patch.app", "sm120patch.render", "sm120patch.errors"}
    assert edges["sm120patch.cli"] <= allowed | families
    assert "sm120patch.app" in edges["sm120patch.cli"]
    modules = _modules()
    doing = ("sm120patch.engine", "sm120patch.targets", "sm120patch.plan", "sm120patch.explain")
    assert families
    for family in families:
        typed = _type_only(ast.parse(modules[family].read_text()), modules)
        assert [m for m in edges[family] - typed if m.startswith(doing)] == [], family
        assert any(m.startswith("sm120patch.commands.") for m in edges[family]), family


def _type_only(tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    """What a module imports under `if TYPE_CHECKING:` (the types its text is drawn from)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            found |= _imports(node, modules)
    return found
