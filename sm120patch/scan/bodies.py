"""What a gate guards, read off the statements under it: the setting it chooses, a refusal,
an exit, the names it tests."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from sm120patch.patchkit import arch
from sm120patch.scan.evaluate import _compare_atom, spelled

# Expressions that can be a yes/no test (a call may be an arch check: `is_sm100_supported()`).
_TESTS = (ast.BoolOp, ast.Compare, ast.UnaryOp, ast.Name, ast.Attribute, ast.Call, ast.Subscript)
_NAME_VALUE = re.compile(r"[A-Za-z][\w.+-]{0,48}")

_LOGGING = re.compile(r"(?:^|\.)(?:logger|logging|log|warnings|print_warning_once)(?:\.|$)|^print$")


def _choice(value: ast.AST) -> str | None:
    """The name a value chooses: a string constant (`"flashinfer_cutlass"`), an enum member
    (`MoeRunnerBackend.MARLIN` -> "marlin"); else None."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        text = value.value
        return text if _NAME_VALUE.fullmatch(text) else None
    if isinstance(value, ast.Attribute) and value.attr.isupper():
        return value.attr.lower()
    return None


def setting(target: ast.AST | None) -> str:
    """The name of what a value is set into: `self.attention_backend` -> "attention_backend",
    `overrides["moe_runner_backend"]` -> "moe_runner_backend"; "" when unknown."""
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
        key = target.slice.value
        return key if isinstance(key, str) else ""
    name = spelled(target) if target is not None else None
    return name.rsplit(".", 1)[-1] if name else ""


def _chosen(body: list[ast.stmt], budget: int = 40) -> list[tuple[ast.stmt, str]]:
    """(statement, "setting=value" or "value") for each value a branch sets or returns:
    `x = "a"`, `return "a"`, `return {"attention_backend": "a"}`, `x = "a" if t else "b"`;
    nested blocks included, nested functions not."""
    out: list[tuple[ast.stmt, str]] = []
    stack = list(reversed(body))
    while stack and budget > 0:
        s = stack.pop()
        budget -= 1
        value = s.value if isinstance(s, (ast.Assign, ast.AnnAssign, ast.Return)) else None
        if value is not None:
            target = s.targets[0] if isinstance(s, ast.Assign) else getattr(s, "target", None)
            into = setting(target)
            parts = [(into, value)]
            if (
                isinstance(target, ast.Tuple)
                and isinstance(value, ast.Tuple)
                and len(target.elts) == len(value.elts)
            ):  # `self.attention_backend, platform = "trtllm_mha", "sm100"`
                parts = [(setting(t), v) for t, v in zip(target.elts, value.elts, strict=True)]
            elif isinstance(value, ast.IfExp):
                parts = [(into, value.body), (into, value.orelse)]
            elif isinstance(value, ast.Dict):
                parts = [
                    (setting(ast.Subscript(ast.Name("_"), k)) if k is not None else "", v)
                    for k, v in zip(value.keys, value.values, strict=True)
                ]
            for name, part in parts:
                chosen = _choice(part)
                if chosen:
                    out.append((s, f"{name}={chosen}" if name else chosen))
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("orelse", "body"):
            inner = getattr(s, name, None)
            if isinstance(inner, list):
                stack.extend(x for x in reversed(inner) if isinstance(x, ast.stmt))
    return out


def _refuses(body: list[ast.stmt]) -> bool:
    """Whether a branch refuses: its first statement that is not logging raises."""
    for s in body:
        if isinstance(s, ast.Expr) and isinstance(s.value, (ast.Constant, ast.Call)):
            if isinstance(s.value, ast.Constant) or _LOGGING.search(spelled(s.value.func) or ""):
                continue
        return isinstance(s, ast.Raise)
    return False


def _declines(body: list[ast.stmt]) -> bool:
    """Whether a branch declines: it returns False, None or nothing else first."""
    for s in body:
        if isinstance(s, ast.Expr):
            continue
        if isinstance(s, ast.Return):
            value = s.value
            return value is None or (
                isinstance(value, ast.Constant) and value.value in (None, False)
            )
        return False
    return False


def _name_tests(test: ast.AST) -> list[str] | None:
    """The string constants a test compares with (`backend == "x"`, `b in ("x", "y")`), when
    every operand of it that is no arch check is such a comparison; else None."""
    names: list[str] = []
    stack = [test]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.BoolOp):
            stack += node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            stack.append(node.operand)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            if _compare_atom(node.left, node.ops[0], node.comparators[0]) is not None:
                continue
            if not isinstance(node.ops[0], (ast.Eq, ast.In)):
                return None
            right = node.comparators[0]
            items = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
            found = [_choice(x) for x in items if isinstance(x, ast.Constant)]
            into = setting(node.left)
            if not found or not all(found) or not into:
                return None
            names += [f"{into}={f}" for f in found if f]
        elif arch.arch_predicate(spelled(node)) is None:
            return None
    return names


def _exits(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _walk(root: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """(node, parent) for every node under `root`, itself included."""
    stack: list[tuple[ast.AST, ast.AST | None]] = [(root, None)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        stack.extend((child, node) for child in ast.iter_child_nodes(node))


def _plain(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(v.value) if isinstance(v, ast.Constant) else "{...}" for v in node.values
        )
    return ast.unparse(node)


def _short(text: str, most: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 3] + "..."


def branch_words(body: list[ast.stmt]) -> str:
    """What a branch does, in words: the first value it chooses (a backend...), else
    its first statement that is not logging."""
    chosen = _chosen(body)
    if chosen:
        return statement_words(chosen[0][0])
    for s in body:
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
            continue  # a docstring or a bare string
        if isinstance(s, ast.Pass):
            continue
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
            if _LOGGING.search(spelled(s.value.func) or ""):
                continue
        inner = getattr(s, "body", None)
        if isinstance(inner, list) and not isinstance(s, (ast.FunctionDef, ast.ClassDef)):
            return branch_words(inner)
        return statement_words(s)
    return "nothing"


def statement_words(s: ast.stmt) -> str:
    """A statement in words: "calls f()", "sets x = ...", "returns ...", "raises E: text"."""
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
        return f"calls {spelled(s.value.func) or ast.unparse(s.value.func)}()"
    if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = s.targets if isinstance(s, ast.Assign) else [s.target]
        names = ", ".join(spelled(t) or ast.unparse(t) for t in targets)
        value = ast.unparse(s.value) if s.value is not None else ""
        return f"sets {names} = {_short(value, 60)}"
    if isinstance(s, ast.Return):
        return "returns " + (_short(ast.unparse(s.value), 60) if s.value else "None")
    if isinstance(s, ast.Raise):
        return "raises" + (message_words(s.exc) if s.exc else "")
    if isinstance(s, (ast.Import, ast.ImportFrom)):
        return "imports " + ", ".join(a.name for a in s.names)
    if isinstance(s, (ast.Continue, ast.Break)):
        return type(s).__name__.lower() + "s"
    return type(s).__name__.lower()


def message_words(node: ast.AST | None) -> str:
    """What is raised or asserted with, in words: " ValueError: text", ": text"."""
    if node is None:
        return ""
    if isinstance(node, ast.Call):
        exc = spelled(node.func) or ""
        args = [a for a in node.args if isinstance(a, (ast.Constant, ast.JoinedStr))]
        text = _short(_plain(args[0]), 60) if args else ""
        return f" {exc}" + (f": {text}" if text else "")
    if isinstance(node, (ast.Constant, ast.JoinedStr)):
        return f": {_short(_plain(node), 60)}"
    return f" {_short(ast.unparse(node), 60)}"
