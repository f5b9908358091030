"""The import graph of sm120patch/ has no cycle, counting the imports inside functions too
(only `if TYPE_CHECKING:` blocks and `__main__` guards are left out: they never run on import
or in a call). Runtime code never imports torch, SGLang or FlashInfer."""

from __future__ import annotations

import ast
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
    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    return test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or "__name__" in test


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


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(ast.parse(path.read_text()), modules) if m in modules} - {name}
        for name, path in modules.items()
    }


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


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert edges["sm120patch.engine"] >= {"sm120patch.engine.state", "sm120patch.engine.layouts"}  # it reads
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_code_never_imports_torch_sglang_or_flashinfer():
    for name, path in _modules().items():
        if name == "sm120patch.explain.probe":
            continue  # run by path in the target's own interpreter (explain), never imported
        top = {m.split(".")[0] for m in _imports(ast.parse(path.read_text()), {})}
        assert not top & {"torch", "sglang", "flashinfer"}, name
