"""Find the GPU-arch gates in one file's text: text first, syntax only around the arch words.

A file whose bytes hold none of the arch words (`patchkit.arch.ARCH_TEXT`) is never parsed. In
one that does, only the innermost function around each such line (or, outside any function,
the module-level statement holding it) goes through Python's own parser, `ast`: a whole
SGLang release is 4,700 files and 68 MB, 400 of them naming an arch, and libcst reads a few
hundred kB a second. A region that does not parse alone (a docstring at column 0 cut it short)
sends the whole file to the parser instead.
The gates of each region are found by `gates.Finder`; the file's scan (`FileScan`) holds them in
line order, each with its key across two texts of the file.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from sm120patch.patchkit import arch
from sm120patch.scan.gates import Finder, Gate
from sm120patch.scan.regions import (
    _line_offsets,
    _outermost,
    _outside,
    _outside_comments,
    _parse_region,
    _Shape,
    _string_spans,
)

# A statement or def longer than this is generated code (FlashInfer's 500 kB module tables and
# 400 kB kernel bodies): not parsed, and said so (`FileScan.skipped`).
MAX_REGION = 200_000


@dataclass
class FileScan:
    file: str
    gates: list[Gate] = field(default_factory=list)
    parsed: bool = False  # some of it went through the parser
    problem: str = ""  # why it could not be read (a syntax error of the whole file)
    skipped: list[tuple[int, int]] = field(default_factory=list)  # (line, bytes) not parsed


def scan_text(file: str, text: str | bytes) -> FileScan:
    """The gates of one file (`file` relative to the package's parent; its text, or its bytes
    in UTF-8: most files are never decoded)."""
    out = FileScan(file)
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    hits = arch.arch_text_hits(data)
    if hits:
        hits = _outside_comments(data, hits)
    strings = _string_spans(data) if hits else []
    hits = _outside(strings, hits)
    if not hits:
        return out
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            out.problem = f"not UTF-8 (byte {exc.start})"
            return out
    lines = text.split("\n")
    starts = _line_offsets(data)
    wanted = sorted({bisect.bisect_right(starts, h) - 1 for h in hits})
    hit_lines = [n + 1 for n in wanted]  # 1-based, sorted
    in_strings: set[int] = set()
    for begin, end in strings:
        first = bisect.bisect_right(starts, begin)  # the line after the opening quotes'
        last = bisect.bisect_right(starts, end) - 1
        in_strings.update(range(first, last + 1))
    shape = _Shape(lines, in_strings)
    found_regions: set[tuple[int, int, str]] = set()
    span = (-1, -1)
    for n in wanted:
        if span[0] <= n < span[1]:
            continue  # inside the region of an earlier line
        region = shape.region(n)
        found_regions.add(region)
        span = region[:2]
    regions = _outermost(found_regions)
    # (tree, line offset, qualified name outside it, source, wrapped in `if 1:`)
    found: list[tuple[ast.AST, int, str, str, bool]] = []
    failed = False
    for start, end, qual in regions:
        size = starts[end] - starts[start] if end < len(starts) else len(data) - starts[start]
        if size > MAX_REGION:
            out.skipped.append((start + 1, size))
            continue
        parsed = _parse_region(lines, start, end)
        if parsed is None:
            failed = True
            break
        found.append((*parsed[:2], qual, parsed[2], parsed[1] != start))
    if failed:
        found, out.skipped = [], []
        if len(data) > 4 * MAX_REGION:
            out.problem = "a region does not parse alone and the file is too big to parse whole"
            return out
        try:
            found = [(ast.parse(text), 0, "", text, False)]
        except (SyntaxError, ValueError) as exc:
            out.problem = f"does not parse ({type(exc).__name__}: {exc})"
            return out
    out.parsed = bool(found)
    counts: dict[tuple[str, str, str], int] = {}
    for tree, offset, qual, source, wrapped in found:
        finder = Finder(file, text, source, offset, qual, hit_lines, wrapped)
        finder.run(tree)
        for gate in finder.gates:
            ident = (gate.function, gate.kind, gate.key[2])
            n = counts.get(ident, 0)
            counts[ident] = n + 1
            out.gates.append(_with_key(gate, (*ident, n)))
    out.gates.sort(key=lambda g: g.line)
    return out


def _with_key(gate: Gate, key: tuple[str, str, str, int]) -> Gate:
    from dataclasses import replace

    return replace(gate, key=key)


def iter_gates(scans: list[FileScan]) -> Iterator[Gate]:
    for s in scans:
        yield from s.gates
