"""Every `next:` line the tool can print is a command that works when pasted.

The hints are collected from the code, not listed by hand: every string that can reach the
hint of a typed error (the second argument or `hint=` of a call to an `Sm120Error` class or to
a function returning one, through the variables and the module's own functions it is built
from). Each `sm120patch ...` command in them is completed as the CLI completes it, for a
command line given with relative paths, pasted through `sh` from another directory, and:
- names every path absolutely;
- is no usage error (exit 2);
- is not the command that printed it (an `<again>` adds words to the user's command);
- is printed once: the hint's words name it ("the command above"), not print it again.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import make_tree

from sm120patch.cli import main
from sm120patch.errors import AGAIN
from sm120patch.render import path_options
from sm120patch.terminal import absolute_paths, hint_lines, pasteable

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "sm120patch").rglob("*.py"), *(ROOT / "patches").rglob("*.py")])
# Not run, only parsed: these start servers, probes in another interpreter or downloads.
PARSED_ONLY = frozenset({"trial", "explain", "matrix", "scan", "tables", "serve"})


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """The names of Sm120Error and every class deriving from it, anywhere in the code."""
    names = {"Sm120Error"}
    changed = True
    while changed:
        changed = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names and any(
                    _name(b) in names for b in node.bases
                ):
                    names.add(node.name)
                    changed = True
    return names


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _makers(trees: dict[Path, ast.Module], classes: set[str]) -> set[str]:
    """Functions returning an error (annotated so): `not_writable`, `not_named`, ..."""
    found = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.returns is not None:
                if _name(node.returns) in classes or (
                    isinstance(node.returns, ast.Constant) and node.returns.value in classes
                ):
                    found.add(node.name)
    return found


def _template(node: ast.AST) -> str | None:
    """A string or f-string as text, each hole written `{source}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    return None


def _strings(node: ast.AST, scope: ast.AST, functions: dict[str, ast.FunctionDef]) -> list[str]:
    """Every text `node` can be: its strings (adjacent ones joined, as Python does), a variable's
    assignments in `scope`, a local function's returns."""
    out: list[str] = []
    seen: set[int] = set()

    def visit(n: ast.AST) -> None:
        if id(n) in seen:
            return
        seen.add(id(n))
        text = _template(n)
        if text is not None:
            out.append(text)
            return
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            left, right = _strings(n.left, scope, functions), _strings(n.right, scope, functions)
            hole = ["{" + ast.unparse(n.left) + "}"], ["{" + ast.unparse(n.right) + "}"]
            out.extend(a + b for a in left or hole[0] for b in right or hole[1])
            return
        if isinstance(n, ast.Name):
            for a in ast.walk(scope):
                targets = a.targets if isinstance(a, ast.Assign) else (
                    [a.target] if isinstance(a, (ast.AnnAssign, ast.AugAssign)) else [])
                if any(isinstance(t, ast.Name) and t.id == n.id for t in targets) and a.value:
                    visit(a.value)
            return
        if isinstance(n, ast.Call) and _name(n.func) in functions:
            fn = functions[_name(n.func)]  # type: ignore[index]
            for r in ast.walk(fn):
                if isinstance(r, ast.Return) and r.value is not None:
                    out.extend(_strings(r.value, fn, functions))
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    return out


@functools.cache
def collect_hints() -> list[tuple[str, str]]:
    """(where, hint template) for every hint the code can give an error."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in SOURCES}
    classes = _error_classes(trees)
    makers = _makers(trees, classes)
    hints = []
    for path, tree in trees.items():
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _name(node.func) in classes | makers):
                continue
            if _name(node.func) in makers - classes:
                continue  # its hints are collected where it builds the error
            args = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg == "hint"]
            scope: ast.AST = node
            while scope in parents and not isinstance(scope, ast.FunctionDef):
                scope = parents[scope]
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            hints += [(where, text) for a in args for text in _strings(a, scope, functions)]
    return hints


_HOLE = re.compile(r"\{([^{}]*)\}")


def _fill(template: str, places: dict[str, str]) -> str:
    """The template with each hole given a value of its kind: `<again>`, a profile, a path."""

    def value(match: re.Match[str]) -> str:
        hole = match.group(1).lower()
        if "again" in hole:
            return AGAIN
        if "profile" in hole or hole in ("other", "name", "wanted") or hole.endswith(".name"):
            return "moe"
        if hole == "out":  # lockfile.remake_hint's: the lock's path and --force (it is there)
            return shlex.quote(places["abs"] + "/sm120patch.lock") + " --force"
        if "output" in hole or "lock" in hole:
            return shlex.quote(places["abs"] + "/sm120patch.lock")
        if any(w in hole for w in ("path", "root", "where", "dir", "parent", "file", "lock",
                                   "shown", "quote", "target.at", "here", "out")):  # fmt: skip
            return shlex.quote(places["abs"])
        if "kind" in hole:
            return "sglang"
        if "verb" in hole or hole.endswith("op"):
            return "apply"
        if "trial" in hole or "id" in hole:
            return "x"
        return "moe"

    return _HOLE.sub(value, template)


COMMANDS = [c for c in dict.fromkeys(t for _, t in collect_hints()) if "sm120patch" in c]


def test_the_collection_finds_the_hints_it_must():
    texts = [_fill(t, {"abs": "/x"}) for _, t in collect_hints()]
    # a typed error's own hint, one built in a variable, one from a maker function, the pins'
    assert any("`sm120patch recover`" in t for t in texts)
    assert any("give it as --" in t and AGAIN in t for t in texts)
    assert any("remount it read-write" in t for t in texts)
    assert any("apply anyway" in t for t in texts)
    assert len(COMMANDS) > 40, len(COMMANDS)


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    base = tmp_path_factory.mktemp("hints")
    work = base / "work"
    make_tree(work / "t", "sglang", "0.5.8", "installed")
    make_tree(work / "t", "flashinfer", "0.6.8", "installed")
    make_tree(work / "t", "vllm", "0.34.0", "installed")
    (base / "elsewhere").mkdir()
    return base


ARGV = ("apply", "moe", "--sglang", "t/sglang-installed", "--flashinfer",
        "t/flashinfer-installed", "--vllm", "t/vllm-installed", "--no-gpu-check")  # fmt: skip


def _pasted(template: str, box: Path) -> list[tuple[str, list[str], list[str]]]:
    """Each `next:` line the template gives, completed for a command line with relative paths
    (run in `work`), as sh reads it pasted: (the line, its words, the command line)."""
    work = box / "work"
    argv = list(ARGV)
    paths = {"sglang": "t/sglang-installed", "flashinfer": "t/flashinfer-installed",
             "vllm": "t/vllm-installed"}  # fmt: skip
    filled = _fill(template, {"abs": str(work / "t")})
    if f"{AGAIN} moe" in filled:  # a hint for a command line without a profile
        argv.remove("moe")
    here = os.getcwd()
    os.chdir(work)
    try:
        text = pasteable(filled, paths, (), argv,
                         path_options(main))  # fmt: skip
    finally:
        os.chdir(here)
    printed = hint_lines(text)
    lines = [line[len("  next: "):] for line in printed if line.startswith("  next: ")]
    prose = [line for line in printed if not line.startswith("  next: ")]
    for line in lines:  # each command once: on its `next:` line, never again in the words
        assert not any(line in words for words in prose), (line, prose)
    out = []
    for line in lines:
        first = shlex.split(line)[0]
        assert first == "sm120patch" or shutil.which(first), f"not a command: {line}"
        if first != "sm120patch":
            continue  # another tool's command (`python3 -c ...`, `git ...`)
        read = subprocess.run(
            ["sh", "-c", f"sm120patch() {{ printf '%s\\0' \"$@\"; }}; {line}"],
            capture_output=True, cwd=box / "elsewhere", timeout=30,
        )  # fmt: skip
        assert read.returncode == 0, (line, read.stderr)
        out.append((line, read.stdout.decode().split("\0")[:-1], argv))
    return out


def _paths_in(words: list[str]) -> list[str]:
    return [w.split("=", 1)[-1] for w in words if "/" in w and not w.startswith("-c")]


@pytest.mark.parametrize("template", COMMANDS, ids=range(len(COMMANDS)))
def test_every_hint_pastes_as_a_working_command(template, box):
    for line, words, argv in _pasted(template, box):
        relative = [p for p in _paths_in(words) if not os.path.isabs(p)]
        assert not relative, (template, line)
        given = absolute_paths(argv, path_options(main))
        if words[: len(given)] == given:  # the user's own command (`<again>`), completed
            assert len(words) > len(given), f"repeats the command that printed it: {line}"
        verb = next((w for w in words if not w.startswith("-") and "/" not in w), "")
        here = os.getcwd()
        os.chdir(box / "elsewhere")
        try:
            if verb in PARSED_ONLY or "--help" in words:
                code = _parsed(words)
            else:
                code = CliRunner().invoke(main, words).exit_code
        finally:
            os.chdir(here)
        assert code != 2, f"a usage error: {line} (from {template!r})"


def _parsed(words: list[str]) -> int:
    """Exit 2 where click cannot parse `words`, else 0: the command is not run."""
    import click

    try:
        with main.make_context("sm120patch", list(words), resilient_parsing=False) as ctx:
            with warnings.catch_warnings():  # click 8.2 keeps the subcommand there still
                warnings.simplefilter("ignore", DeprecationWarning)
                words_left = [*ctx.protected_args, *ctx.args]
            name, sub, rest = main.resolve_command(ctx, words_left)
            assert sub is not None
            sub.make_context(name, rest, parent=ctx)
    except click.UsageError:
        return 2
    except click.exceptions.Exit:
        return 0
    return 0




def test_the_refusal_of_a_dry_run_does_not_send_to_the_same_dry_run(tmp_path):
    from test_vllm_fp8_cutlass_moe import FILE, custom_ops

    site = make_tree(tmp_path, "vllm", "0.34.0", "installed")
    (site / FILE).write_text(custom_ops())
    for extra in ([], ["--dry-run"]):
        words = ["apply", "vllm-fp8-moe", "--vllm", str(site), "--no-gpu-check", *extra]
        out = CliRunner().invoke(main, words)
        assert out.exit_code == 1 and "refused at 1 site" in out.stderr, out.output
        nexts = [x[len("  next: "):] for x in out.stderr.splitlines() if x.startswith("  next: ")]
        for line in nexts:
            assert sorted(shlex.split(line)[1:]) != sorted(words), f"repeats itself: {line}"
        assert ("--dry-run" in " ".join(nexts)) == (extra == []), out.stderr
