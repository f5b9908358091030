"""The GPU-arch gates of one parsed region of a file (`filescan.py` finds the regions: text
first, syntax only around the arch words).

Every test found (an `if`/`elif`/`while` test, an `assert`, a returned or assigned value, a
keyword argument, an `x if test else y`, a list of majors or compile targets) is evaluated on
the GPUs of `patchkit.arch.ARCH_POINTS`, every operand that is no arch check taking both values.
A test is a gate when SM120 gets a different answer than one of the archs upstream favours
(SM90, SM100, SM103, SM110). It leaves SM120 out when SM120 then gets what an older GPU
(SM80) gets; otherwise it admits SM120 (it takes the path of the archs it favours). A test that
names SM120 is SM120-aware code, not a gate, unless it names SM120 to leave it out.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from sm120patch.patchkit import arch
from sm120patch.scan.bodies import (
    _TESTS,
    _choice,
    _chosen,
    _declines,
    _exits,
    _name_tests,
    _refuses,
    _short,
    _walk,
    branch_words,
    message_words,
    setting,
)
from sm120patch.scan.evaluate import (
    ADMITS,
    LEAVES_OUT,
    Reading,
    _Expr,
    _members_atom,
    judge,
    spelled,
)

SHOWN = 160  # characters of an expression shown


@dataclass(frozen=True)
class Gate:
    file: str  # relative to the package's parent
    line: int
    function: str  # qualified name; "<module>" at module level
    kind: str  # if, elif, while, assert, return, assign, argument, ifexp, list
    expression: str  # the source, on one line
    gates: str  # what it guards, in words
    verdict: str  # LEAVES_OUT, ADMITS or EXCLUDES
    favoured: tuple[str, ...]  # the archs that get another answer than SM120 ("sm90", ...)
    sibling: str = ""  # a sibling test routing SM120 elsewhere: "line N: <test>"
    arch_specific: tuple[str, ...] = ()  # `a` compile targets it names ("sm_100a")
    choices: tuple[str, ...] = ()  # the values (backend names...) the guarded code chooses
    # Where the gate admits SM120 and its chain's arch tests alone decide SM120's branch: the
    # values the branch SM120 takes chooses (0.5.23's NVFP4 MoE `auto`: the `else` of
    # `(8, 0) <= capability < (10, 0)`, FLASHINFER_TRTLLM). A path that ends in a kernel
    # SM120 cannot run is a gap, not upstream's (classify.py).
    sm120_choices: tuple[str, ...] = ()
    # The names (backends...) this gate refuses outside the archs it favours: a check that
    # raises when `backend == "x"` and the GPU is not one of them, nothing else asked.
    requires: tuple[str, ...] = ()
    # It refuses the GPUs it leaves out: raises, asserts, or returns False or None there.
    refuses: bool = False
    context: str = field(default="", repr=False)  # what the kernel table is matched against
    key: tuple[str, str, str, int] = ("", "", "", 0)  # identity across two texts of a file


_ARCH_CONTEXT = re.compile(r"major|arch|(?:^|_)sm(?:_|s?$)|capabilit|(?:^|_)cc(?:_|$)")


# Where a statement sits: its qualified name, the innermost def, and the `if` branches around
# it ((test, which branch) for each, outermost first).
Where = tuple[list[str], "ast.AST | None", list[tuple[ast.If, bool]]]


class Finder:
    """Every gate of one parsed region."""

    def __init__(
        self,
        file: str,
        text: str,
        source: str,
        offset: int,
        qual: str,
        hits: list[int],
        wrapped: bool = False,
    ) -> None:
        self.file = file
        self.hits = hits  # the file's lines holding an arch word, sorted
        self.wrapped = wrapped
        self.text = text  # the whole file (for a twin function's name)
        self.source = source
        self.lines = source.split("\n")
        self.offset = offset
        self.outer = qual
        self.gates: list[Gate] = []

    def _mentions(self, node: ast.AST) -> bool:
        """Whether the node's lines hold an arch word: nothing else can be a gate."""
        decorators = getattr(node, "decorator_list", None)
        first = int(getattr(decorators[0] if decorators else node, "lineno", 0)) + self.offset
        last = int(getattr(node, "end_lineno", None) or first - self.offset) + self.offset
        i = bisect.bisect_left(self.hits, first)
        return i < len(self.hits) and self.hits[i] <= last

    def run(self, tree: ast.AST) -> None:
        qual = self.outer.split(".") if self.outer else []
        body = getattr(tree, "body", [])
        if self.wrapped:  # `if 1:` around an indented region
            body = body[0].body
        self._block(body, qual, None, [])

    # Each statement list is walked with the qualified name, the innermost def, and the `if`
    # branches around it: (test, which branch) for each, outermost first.
    def _block(
        self,
        stmts: list[ast.stmt],
        qual: list[str],
        func: ast.AST | None,
        around: list[tuple[ast.If, bool]],
    ) -> None:
        for stmt in stmts:
            self._stmt(stmt, stmts, qual, func, around)
            if isinstance(stmt, ast.If) and self._exits_on_sm120(stmt):
                return  # what follows never runs on SM120: no gate of SM120's there

    def _exits_on_sm120(self, node: ast.If) -> bool:
        """Whether SM120 surely takes a branch of this if/elif/else that returns or raises."""
        while True:
            answers = self._sm120_answers(node.test)
            if answers is None:
                return False
            taken, full = answers
            if taken == full:
                return _exits(node.body)
            if taken != 0:
                return False
            if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                node = node.orelse[0]
                continue
            return bool(node.orelse) and _exits(node.orelse)

    def _sm120_branch(self, tests: Sequence[ast.AST]) -> int | None:
        """Which branch of a chain (these tests, then its `else`) SM120 surely takes: the
        index of the first test SM120 surely passes after tests it surely fails, len(tests)
        for the `else`; None where something besides the GPU decides."""
        for i, test in enumerate(tests):
            answers = self._sm120_answers(test)
            if answers is None:
                return None
            taken, full = answers
            if taken == full:
                return i
            if taken != 0:
                return None
        return len(tests)

    def _sm120_answers(self, test: ast.AST) -> tuple[int, int] | None:
        """(SM120's answers, the mask of every assignment) of a test that has arch atoms."""
        if not self._mentions(test):
            return None
        expr = _Expr(test, self.file)
        if not expr.atoms:
            return None
        return expr.table()[arch.SM120], expr.full

    def _stmt(
        self,
        stmt: ast.stmt,
        block: list[ast.stmt],
        qual: list[str],
        func: ast.AST | None,
        around: list[tuple[ast.If, bool]],
    ) -> None:
        if not self._mentions(stmt):
            return
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = [*qual, stmt.name]
            self._decorators(stmt, (inner, stmt, around))
            func = stmt if not isinstance(stmt, ast.ClassDef) else None
            self._block(stmt.body, inner, func, [])
            return
        where = (qual, func, around)
        if isinstance(stmt, ast.If):
            self._chain(stmt, block, where)
            return
        if isinstance(stmt, ast.While):
            self._test(stmt.test, "while", branch_words(stmt.body), where, stmt.body)
        elif isinstance(stmt, ast.Assert):
            self._test(stmt.test, "assert", "asserts" + message_words(stmt.msg), where, [])
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            if not self._defines_arch(func):
                self._value(stmt.value, "return", f"returned by {self._name(qual)}", where)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and stmt.value:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = [spelled(t) or ast.unparse(t) for t in targets]
            if any(arch.arch_predicate(n, self.file) for n in names):
                return  # `_is_sm100_supported = ...` defines a word: its uses are the gates
            into = setting(targets[0]) if len(targets) == 1 else ""
            self._value(stmt.value, "assign", f"sets {', '.join(names)}", where, names, into)
        self._inner(stmt, where)
        for name in ("body", "orelse", "handlers", "finalbody"):
            stmts = getattr(stmt, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.AST):
                for s in stmts:
                    if isinstance(s, ast.ExceptHandler):
                        self._block(s.body, qual, func, around)
                    elif isinstance(s, ast.stmt):
                        self._stmt(s, stmts, qual, func, around)
        for case in getattr(stmt, "cases", []) or []:
            self._block(case.body, qual, func, around)

    def _decorators(self, stmt: ast.AST, where: Where) -> None:
        """`@supported_compute_capability([100, 103])` and the like: the archs a def is for."""
        for deco in getattr(stmt, "decorator_list", []):
            if not (isinstance(deco, ast.Call) and self._mentions(deco)):
                continue
            func = spelled(deco.func) or ""
            what = f"@{func}(...) on {getattr(stmt, 'name', '')}"
            for arg in [*deco.args, *(k.value for k in deco.keywords)]:
                if isinstance(arg, (ast.List, ast.Tuple, ast.Set)):
                    self._list(arg, "decorator", what, where, func)

    def _chain(self, head: ast.If, block: list[ast.stmt], where: Where) -> None:
        """An if/elif chain: each test a gate, each branch walked inside it."""
        qual, func, around = where
        chain: list[ast.If] = [head]
        while len(chain[-1].orelse) == 1 and isinstance(chain[-1].orelse[0], ast.If):
            nxt = chain[-1].orelse[0]
            if not self._line_text(nxt).lstrip().startswith("elif"):
                break
            chain.append(nxt)
        # The other `if`s of the block give SM120 a path only where their branch does not
        # refuse, and only to a gate that does not refuse itself: a check refusing SM120
        # something beside a check refusing it something else is no path.
        others: list[ast.AST] = [
            s.test
            for s in block
            if isinstance(s, ast.If) and s is not head and not _refuses(s.body)
        ]
        tests: list[ast.AST] = [c.test for c in chain if not _refuses(c.body)]
        branches = list(around)
        bodies = [c.body for c in chain] + [chain[-1].orelse]
        for i, node in enumerate(chain):
            siblings = [t for t in tests if t is not node.test]
            if not _refuses(node.body):
                siblings += others
            taken = self._sm120_branch([c.test for c in chain[i:]])
            path = bodies[i + taken] if taken is not None else []
            sm120 = tuple(dict.fromkeys(v for _, v in _chosen(path))) if path else ()
            self._test(
                node.test,
                "elif" if i else "if",
                branch_words(node.body),
                (qual, func, branches),
                node.body,
                siblings,
                sm120_choices=sm120,
            )
            self._block(node.body, qual, func, [*branches, (node, True)])
            branches = [*branches, (node, False)]
        last = chain[-1]
        if last.orelse:
            self._block(last.orelse, qual, func, branches)

    # -------------------------------------------------------------------- one test

    def _test(
        self,
        node: ast.AST,
        kind: str,
        what: str,
        where: Where,
        body: list[ast.stmt],
        siblings: list[ast.AST] = (),  # type: ignore[assignment]
        choices: tuple[str, ...] = (),
        sm120_choices: tuple[str, ...] = (),
    ) -> None:
        if not self._mentions(node):
            return
        expr = _Expr(node, self.file)
        if not expr.atoms:
            return
        reading = judge(expr.table(), expr.names_sm120)
        if reading.verdict is None:
            return
        self._add(node, kind, what, reading, where, body, siblings, (), choices, sm120_choices)

    def _add(
        self,
        node: ast.AST,
        kind: str,
        what: str,
        reading: Reading,
        where: Where,
        body: list[ast.stmt],
        siblings: list[ast.AST],
        arch_specific: list[str] | tuple[str, ...],
        choices: tuple[str, ...] = (),
        sm120_choices: tuple[str, ...] = (),
    ) -> None:
        qual, func, around = where
        if self._unreachable_on_sm120(around):
            return  # inside a gate that already keeps SM120 away
        sibling = self._sibling(siblings, around)
        if not sibling and reading.verdict != ADMITS:
            sibling = self._twin(func)
        body_text = " ".join(_short(ast.unparse(s), 300) for s in body[:6])
        context = " ".join([self._comment_above(node), self._shown(node), what, body_text])
        if not choices and body and not any(isinstance(s, ast.Raise) for s in body):
            choices = tuple(dict.fromkeys(v for _, v in _chosen(body)))
        requires: tuple[str, ...] = ()
        refuses = kind == "assert" or _refuses(body)
        if reading.verdict == LEAVES_OUT and refuses:
            requires = self._required(node, around)
        self.gates.append(
            Gate(
                file=self.file,
                line=self._line(node),
                function=self._name(qual),
                kind=kind,
                expression=_short(self._shown(node), SHOWN),
                gates=_short(what, 100),
                verdict=reading.verdict,  # type: ignore[arg-type]
                favoured=reading.favoured,
                sibling=sibling,
                arch_specific=tuple(dict.fromkeys(arch_specific)),
                choices=choices,
                sm120_choices=sm120_choices if reading.verdict == ADMITS else (),
                requires=requires,
                refuses=refuses or _declines(body),
                context=context,
                key=("", "", ast.unparse(node), 0),
            )
        )

    def _value(
        self,
        value: ast.AST,
        kind: str,
        what: str,
        where: Where,
        names: list[str] = (),  # type: ignore[assignment]
        into: str = "",
    ) -> None:
        """A returned or assigned value (into the setting `into`): a yes/no test, a choice
        (`a if test else b`), or a list of archs."""
        if isinstance(value, ast.IfExp):
            self._ifexp(value, what, where, into)
            return
        if isinstance(value, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
            context = " ".join(names) or what
            if isinstance(value, ast.Dict):  # "# Max size ... per device capability" (vLLM)
                context += " " + self._comment_above(value, whole=True)
            self._list(value, kind, what, where, context)
            return
        if isinstance(value, _TESTS):
            self._test(value, kind, what, where, [])

    def _ifexp(self, node: ast.IfExp, what: str, where: Where, into: str = "") -> None:
        chain = [node]
        while isinstance(chain[-1].orelse, ast.IfExp):
            chain.append(chain[-1].orelse)
        tests = [c.test for c in chain]
        values = [_choice(v) for v in [*(c.body for c in chain), chain[-1].orelse]]
        named = [(f"{into}={v}" if into else v) if v else "" for v in values]
        for i, c in enumerate(chain):
            picked = _short(ast.unparse(c.body), 60)
            taken = self._sm120_branch(tests[i:])
            sm120 = named[i + taken] if taken is not None else ""
            self._test(
                c.test,
                "ifexp",
                f"{what} = {picked}",
                where,
                [],
                [t for t in tests if t is not c.test],
                (named[i],) if named[i] else (),
                (sm120,) if sm120 else (),
            )

    def _inner(self, stmt: ast.stmt, where: Where) -> None:
        """Keyword arguments, lists and `x if t else y` inside a simple statement's
        expressions (a compound statement's header only)."""
        if isinstance(stmt, (ast.If, ast.While)):
            return
        parts: list[ast.AST] = []
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            parts = [stmt.iter]
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            parts = list(stmt.items)
        elif isinstance(
            stmt,
            (ast.Expr, ast.Return, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Raise, ast.Assert),
        ):
            parts = [stmt]
        for part in parts:
            self._inner_expr(part, where, top=stmt)

    def _inner_expr(self, root: ast.AST, where: Where, top: ast.AST | None = None) -> None:
        for node, parent in _walk(root):
            if not self._mentions(node):
                continue
            if isinstance(node, ast.Call):
                func = spelled(node.func) or ""
                for kw in node.keywords:
                    if kw.arg is None:
                        continue
                    what = f"argument {kw.arg}= of {func}()"
                    if isinstance(kw.value, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
                        self._list(kw.value, "argument", what, where, f"{kw.arg} {func}")
                    elif isinstance(kw.value, ast.IfExp):
                        self._ifexp(kw.value, f"{kw.arg}=", where, kw.arg)
                    elif isinstance(kw.value, _TESTS):
                        self._test(kw.value, "argument", what, where, [])
                checks = func.rpartition(".")[2] in arch.VLLM_CAPABILITY_CHECKS  # one arch
                for arg in [] if checks else node.args:  # (vLLM's `(10, 7)` is a capability)
                    if isinstance(arg, (ast.List, ast.Tuple, ast.Set)):
                        self._list(arg, "argument", f"an argument of {func}()", where, func)
            elif isinstance(node, ast.IfExp) and not self._is_value_of(node, top):
                if not isinstance(parent, (ast.keyword, ast.IfExp)):
                    self._ifexp(node, "chooses", where)

    def _is_value_of(self, node: ast.AST, top: ast.AST | None) -> bool:
        return top is not None and getattr(top, "value", None) is node

    def _list(self, node: ast.AST, kind: str, what: str, where: Where, context: str) -> None:
        """A list (tuple, set, dict keys) of majors, sm numbers or compile targets."""
        members = self._arch_members(node, context)
        if members is None:
            return
        caps, names_sm120, specific = members
        table = _members_atom(caps)
        reading = judge(table, names_sm120)
        if reading.verdict is None:
            return
        self._add(
            node, "list" if kind == "assign" else kind, what, reading, where, [], [], specific
        )

    def _arch_members(
        self, node: ast.AST, context: str
    ) -> tuple[frozenset[arch.Capability], bool, list[str]] | None:
        elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
        if not elts or any(e is None for e in elts):
            return None
        strings = [
            e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        ]
        dotted = isinstance(node, ast.Dict)  # vLLM's tables keyed by "10.0"
        targets = [(s, arch.arch_string(s, dotted=dotted)) for s in strings]
        found = [(s, t) for s, t in targets if t is not None]
        # A list of targets, or of compiler flags with targets among them; not a tuple of
        # settings or tags that names an arch beside other things.
        others = [s for s, t in targets if t is None and not s.startswith("-")]
        if found and not others and len(strings) == len(elts):
            caps = frozenset().union(*(t[0] for _, t in found))
            names_sm120 = any(c[0] == 12 for c in caps)
            return caps, names_sm120, [s for s, t in found if t[1]]
        ints = [e.value for e in elts if isinstance(e, ast.Constant) and type(e.value) is int]
        if len(ints) != len(elts) or not _ARCH_CONTEXT.search(context.lower()):
            return None
        kinds = {arch.plausible_arch_number("major", i) for i in ints}
        if len(kinds) != 1 or None in kinds:
            return None
        kind = kinds.pop() or "major"
        numbers: set[object] = set(ints)
        caps = frozenset(c for c in arch.ARCH_POINTS if arch.arch_value(kind, c) in numbers)
        return caps, any(i in (12, 120, 121) for i in ints), []

    # -------------------------------------------------------------------- around a gate

    def _required(self, node: ast.AST, around: list[tuple[ast.If, bool]]) -> tuple[str, ...]:
        """The names a refusing check is about, where nothing but them and the GPU decides:
        `if backend == "x": if not is_sm100(): raise` (0.5.8's trtllm_mha) names "backend=x";
        with another condition beside or around it (`and cp_size > 1`) it names nothing."""
        names: list[str] = []
        for test in [node, *(n.test for n, branch in around if branch)]:
            found = _name_tests(test)
            if found is None:
                return ()  # something else decides too
            names += found
        return tuple(dict.fromkeys(names))

    def _unreachable_on_sm120(self, around: list[tuple[ast.If, bool]]) -> bool:
        for node, branch in around:
            answers = self._sm120_answers(node.test)
            if answers is not None and answers[0] == (0 if branch else answers[1]):
                return True
        return False

    def _routes(self, test: ast.AST) -> bool:
        if not self._mentions(test):
            return False
        expr = _Expr(test, self.file)
        if not expr.atoms:
            return False
        return judge(expr.table(), expr.names_sm120).routes_sm120

    def _sibling(self, siblings: list[ast.AST], around: list[tuple[ast.If, bool]]) -> str:
        """A test beside this one (same chain or block) that gives SM120 a path of its own, or
        an `if` around this one whose other branch SM120 takes."""
        for test in siblings:
            if self._routes(test):
                return f"line {self._line(test)}: {_short(ast.unparse(test), 80)}"
        for node, branch in reversed(around):
            if not branch and self._routes(node.test):
                return f"line {self._line(node.test)}: {_short(ast.unparse(node.test), 80)}"
        return ""

    def _twin(self, func: ast.AST | None) -> str:
        name = getattr(func, "name", "")
        for twin in arch.arch_twin_names(name) if name else ():
            if re.search(rf"\bdef\s+{re.escape(twin)}\b", self.text):
                return f"def {twin}"
        return ""

    def _defines_arch(self, func: ast.AST | None) -> bool:
        """A function that is itself an arch check (`def is_sm100a_supported`): its returns
        define the word, the gates are where it is used."""
        return func is not None and arch.arch_predicate(getattr(func, "name", "")) is not None

    # -------------------------------------------------------------------- where

    def _name(self, qual: list[str]) -> str:
        return ".".join(qual) or "<module>"

    def _line(self, node: ast.AST) -> int:
        return int(getattr(node, "lineno", 1)) + self.offset

    def _comment_above(self, node: ast.AST, whole: bool = False) -> str:
        """The comment lines right above the line a test starts on (its statement's, where the
        test opens it): authors say there which kernel a test is for ("This kernel uses tcgen05
        + TMEM ... not on Blackwell desktop SM120")."""
        lines = self.text.split("\n") if whole else self.lines  # whole: above the region too
        n = int(getattr(node, "lineno", 1)) - 2 + (self.offset if whole else 0)  # 0-based
        found: list[str] = []
        while n >= 0 and len(found) < 8 and lines[n].lstrip().startswith("#"):
            found.append(lines[n].lstrip().lstrip("#").strip())
            n -= 1
        return " ".join(reversed(found))

    def _line_text(self, node: ast.AST) -> str:
        n = int(getattr(node, "lineno", 1)) - 1
        return self.lines[n] if 0 <= n < len(self.lines) else ""

    def _shown(self, node: ast.AST) -> str:
        """The expression as written, on one line; as ast writes it back where the source
        holds a comment."""
        text = self._segment(node)
        return " ".join((ast.unparse(node) if "#" in text else text).split())

    def _segment(self, node: ast.AST) -> str:
        """The node's own source text (ast's offsets count UTF-8 bytes)."""
        first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[attr-defined]
        start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
        if last < first or last >= len(self.lines) or end is None:
            return ast.unparse(node)
        chunk = [line.encode() for line in self.lines[first : last + 1]]
        if first == last:
            return chunk[0][start:end].decode(errors="replace")
        chunk[0], chunk[-1] = chunk[0][start:], chunk[-1][:end]
        return b"\n".join(chunk).decode(errors="replace")
