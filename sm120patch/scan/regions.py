"""The regions of a file worth parsing: the outermost statements around each arch word, cut
from the text by indentation so that a whole release parses only what mentions an arch."""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Iterator

_DEF = re.compile(r"(\s*)(?:async\s+def|def|class)\s+(\w+)")
_CONTINUES = re.compile(r"\s*(?:elif\b|else\s*:|except\b|finally\s*:|case\b)")


class _Shape:
    """Indentation and statement starts of a file's lines, read from the text alone."""

    def __init__(self, lines: list[str], in_strings: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.lines = lines
        self.in_strings = in_strings  # lines inside a triple-quoted string (not its first)
        self._indent: dict[int, int | None] = {}
        self._ends: dict[tuple[int, int], int] = {}

    def indent(self, n: int) -> int | None:
        """The indentation of line n, None for a blank or comment line or one that closes a
        bracket (it cannot start a statement)."""
        found = self._indent.get(n, -1)
        if found != -1:
            return found
        line = self.lines[n]
        stripped = line.lstrip()
        value = None if not stripped or stripped[0] in "#)]}" else len(line) - len(stripped)
        if n in self.in_strings:
            value = None
        self._indent[n] = value
        return value

    def region(self, n: int) -> tuple[int, int, str]:
        """(first line, end line, qualified name of the scope holding it) around line n: the
        innermost def holding it; in a class body outside any def, the class-level statement;
        else the module-level statement."""
        level = self.indent(n)
        level = len(self.lines[n]) - len(self.lines[n].lstrip()) if level is None else level
        top = n
        for k, ind in self._enclosing(n, level):
            if _DEF.match(self.lines[k]):
                qual = self._qualname(k, ind)
                if not self.lines[k].lstrip().startswith("class"):
                    return k, self._end(k, ind), qual.rpartition(".")[0]
                head = self._head(top)
                return head, self._end(head, self.indent(head) or 0), qual
            top = k
        head = self._head(top) if self.indent(top) == 0 else top
        while head > 0 and self.indent(head) != 0:
            head -= 1
        head = self._head(head)
        return head, self._end(head, 0), ""

    def _head(self, n: int) -> int:
        """The `if` (or `try`) an `elif`/`else`/`except` line n belongs to."""
        level = self.indent(n)
        while n > 0 and level is not None and _CONTINUES.match(self.lines[n]):
            n -= 1
            while n > 0 and self.indent(n) != level:
                n -= 1
        return n

    def _end(self, start: int, level: int) -> int:
        """The first line after the statement starting at `start` (decorators and the def or
        class they decorate count as one statement)."""
        key = (start, level)
        if key not in self._ends:
            decorating = self.lines[start].lstrip().startswith("@")
            n = start + 1
            while n < len(self.lines):
                ind = self.indent(n)
                if ind is not None and ind <= level and not _CONTINUES.match(self.lines[n]):
                    head = self.lines[n].lstrip()
                    if not (decorating and ind == level):
                        break
                    if not head.startswith("@"):
                        decorating = False  # the decorated def or class itself
                        if not _DEF.match(self.lines[n]):
                            break
                n += 1
            self._ends[key] = n
        return self._ends[key]

    def _enclosing(self, n: int, level: int) -> Iterator[tuple[int, int]]:
        """(line, indentation) of each statement line above line n that is less indented
        than everything after it so far: the statements holding line n, innermost first."""
        k = n
        while k > 0 and level > 0:
            k -= 1
            ind = self.indent(k)
            if ind is not None and ind < level:
                yield k, ind
                level = ind

    def _qualname(self, k: int, level: int) -> str:
        names = [_DEF.match(self.lines[k])[2]]  # type: ignore[index]
        for line, _ in self._enclosing(k, level):
            m = _DEF.match(self.lines[line])
            if m:
                names.append(m[2])
        return ".".join(reversed(names))


def _outermost(regions: set[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The regions not inside another, in file order."""
    out: list[tuple[int, int, str]] = []
    for start, end, qual in sorted(regions, key=lambda r: (r[0], -r[1])):
        if out and start >= out[-1][0] and end <= out[-1][1]:
            continue
        out.append((start, end, qual))
    return out


def _parse_region(lines: list[str], start: int, end: int) -> tuple[ast.AST, int, str] | None:
    """(tree, line offset, source) of lines [start, end); an indented def is parsed under an
    `if 1:` so its indentation stands. None when it does not parse alone."""
    body = "\n".join(lines[start:end])
    indented = bool(lines[start][:1].isspace())
    source = "if 1:\n" + body if indented else body
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    return tree, start - (1 if indented else 0), source


_TRIPLE = re.compile(rb'"""|\'\'\'')


def _string_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) offsets of the triple-quoted strings, by pairing the quotes: a rough
    reading (a quote inside a one-line string fools it) that the parser then checks."""
    if b'"""' not in data and b"'''" not in data:
        return []
    spans: list[tuple[int, int]] = []
    inside: bytes | None = None
    begin = 0
    for m in _TRIPLE.finditer(data):
        q = m.group()
        if inside is None:
            inside, begin = q, m.start()
        elif q == inside:  # a ''' inside a """ string is text, and so on
            spans.append((begin, m.end()))
            inside = None
    if inside is not None:
        spans.append((begin, len(data)))
    return spans


def _outside(spans: list[tuple[int, int]], hits: list[int]) -> list[int]:
    """The hits not inside one of `spans` (docstrings name archs all the time)."""
    if not spans:
        return hits
    starts = [a for a, _ in spans]
    out = []
    for h in hits:
        i = bisect.bisect_right(starts, h) - 1
        if i < 0 or h >= spans[i][1]:
            out.append(h)
    return out


def _outside_comments(data: bytes, hits: list[int]) -> list[int]:
    """The hits not in a comment: after a `#` that no quote before it on the line hides."""
    out = []
    for h in hits:
        prefix = data[data.rfind(b"\n", 0, h) + 1 : h]
        hash_at = prefix.find(b"#")
        if hash_at < 0:
            out.append(h)
            continue
        before = prefix[:hash_at]
        if before.count(b'"') % 2 or before.count(b"'") % 2:
            out.append(h)  # the `#` is inside a string
    return out


def _line_offsets(data: bytes) -> list[int]:
    offsets = [0]
    offsets += [m.end() for m in re.finditer(rb"\n", data)]
    return offsets
