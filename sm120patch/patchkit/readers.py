"""What `sm120patch explain` reads at a patch's site: the patch's own reader (`Explain`).

A patch that has something to show declares it beside its transform, in its own module:

    def explain_read(site: Site) -> Reading:   # run in the TARGET's interpreter
        import importlib
        module = importlib.import_module(site.modules[0])
        ...
        return {"value": ...}

    def explain_row(answer: Answer) -> str:            # run in sm120patch
        return answer["value"]

    EXPLAIN = Explain(name="my_site", label="what the row says", read=explain_read,
                      row=explain_row)

and `explain=EXPLAIN` in its `Patch(...)`. `explain` sends the reader's source text to the probe
(`explain/probe.py`), which runs it in the interpreter that owns the target, beside torch,
SGLang and FlashInfer, where neither sm120patch nor libcst need be installed: the text is the
reader's one home, and nothing outside patches/ names a patch's site. So a reader:

- is a plain function at the module's top level, without decorators;
- imports what it needs inside itself (the stdlib, torch, the target's modules) and uses no
  other name of its module: no constants, no helpers (`problems` says which it uses);
- learns where its site is from its argument (`Site`: the patch's files as module names and
  the functions its facts name, newest release first), so the facts stay the one place a site
  is written;
- returns a dict of JSON values; an exception is caught by the probe and becomes
  `{"error": ..., "where": [...]}`.

Its answer is in the probe's result under `name` (tests/behaviour read it there); `row` turns
it into the words of `explain`'s table, under `field` in `explain --json`. A missing answer
(the target was not probed) is "not checked" without calling `row`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

Answer = Mapping[str, Any]  # what a reader answered, as the row reads it
Reading = dict[str, Any]  # what a reader returns: JSON values


class Site(Protocol):
    """What the probe hands a reader (built in explain/probe.py, which cannot import this)."""

    modules: tuple[str, ...]  # the patch's files as module names, the newest release's first
    functions: tuple[str, ...]  # the functions its facts name, newest first (`Class.method` too)
    simulate: str | None  # the simulated GPU ("sm120", "sm100", "sm90"), None on a real one
    multicast: bool | None  # the simulated driver's multicast; None: the real driver

    def error(self, exc: BaseException) -> str:
        """`Type: message`, the form every answer's `error` takes."""
        ...


Reader = Callable[[Site], Reading]
Row = Callable[[Answer], str]


@dataclass(frozen=True, kw_only=True)
class Explain:
    """What `explain` reads at one patch's site, and the row it shows."""

    name: str  # the key of the reader's answer in the probe's result
    label: str  # the row's words in `explain`'s table
    read: Reader  # run in the target's interpreter, from its source text
    row: Row  # the answer in words
    field: str = ""  # the row's key in `explain --json`; `name` when not given

    @property
    def key(self) -> str:
        return self.field or self.name

    def source(self) -> tuple[str, int, str]:
        """The reader's file, first line and source text (what the probe runs)."""
        import inspect
        import textwrap

        return (
            inspect.getsourcefile(self.read) or "<reader>",
            self.read.__code__.co_firstlineno,
            textwrap.dedent(inspect.getsource(self.read)),
        )

    def problems(self) -> list[str]:
        """Why the probe could not run the reader from its source text alone; [] when it can."""
        import inspect

        read = self.read
        if not self.name.isidentifier() or not (self.field or self.name).isidentifier():
            return [f"explain: {self.field or self.name!r} is not an identifier"]
        if not inspect.isfunction(read) or read.__qualname__ != read.__name__ or read.__closure__:
            return [f"explain: the reader {read!r} is not a plain function of the module"]
        try:
            text = self.source()[2]
        except (OSError, TypeError) as exc:
            return [f"explain: the reader {read.__name__} has no source text ({exc})"]
        return [f"explain: {p}" for p in standalone_problems(text, read.__name__)]


def error_row(answer: Answer, absent: str) -> str | None:
    """The row of an answer that is an error: "not in this release" where the error says
    `absent` (the words of a missing module or name), else the error; None for an answer."""
    if "error" not in answer:
        return None
    error = str(answer["error"])
    return "not in this release" if absent in error else error


def standalone_problems(text: str, name: str) -> list[str]:
    """Why the function `name`, whose whole source is `text`, would not run on its own in a
    namespace holding only the builtins: a decorator, or a name it reads but never binds
    (a module constant, a helper, an import made at module level). Annotations are left out:
    the probe compiles the text with `from __future__ import annotations`."""
    import ast
    import builtins

    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        return [f"{name} does not parse on its own ({exc.msg})"]
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return [f"the source of {name} is not one function"]
    func = tree.body[0]
    if func.decorator_list:
        return [f"{name} has a decorator; the probe runs the function alone"]
    skipped: set[int] = set()
    for node in ast.walk(func):
        notes: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes.append(node.returns)
        elif isinstance(node, ast.arg):
            notes.append(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
        skipped |= {id(sub) for note in notes if note is not None for sub in ast.walk(note)}
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(func):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    unbound = sorted(read - bound - set(dir(builtins)))
    if unbound:
        return [f"{name} reads {', '.join(unbound)} from outside itself; import or define "
                "it inside the function (the probe runs its text alone)"]
    return []
