"""Unified diffs that `git apply` accepts, and applying one back to a text exactly."""

from __future__ import annotations

from sm120patch.patchkit.runner import FileResult
from sm120patch.targets import Target


def unified_diff(target: Target, result: FileResult) -> str:
    """A `git apply`-able diff of one file, paths relative to the target root."""
    return diff_texts(target.rel(result.file), result.before, result.after)


def diff_header(rel: str) -> str:
    """What `diff_texts` writes before a file's first hunk."""
    return f"diff --git a/{rel} b/{rel}\n--- a/{rel}\n+++ b/{rel}\n"


def diff_texts(rel: str, before: str, after: str) -> str:
    """A `git apply`-able diff of one file's two texts, `a/` and `b/` prefixed."""
    import difflib

    lines = []
    old, new = _lines(before), _lines(after)
    for line in difflib.unified_diff(old, new, n=3, lineterm="\n"):
        if not line.endswith("\n"):
            # The file's last line has no newline: say so the way git does.
            line += "\n\\ No newline at end of file\n"
        lines.append(line)
    if not lines:
        return ""
    return diff_header(rel) + "".join(lines[2:])  # difflib's own ---/+++ lines replaced


def apply_diff(before: str, diff: str) -> str | None:
    """`before` with one of `diff_texts`'s diffs applied, or None where its context does not
    match exactly (then the caller plans instead: a wrong text is never guessed)."""
    import re

    old = _lines(before)
    out: list[str] = []
    at = 0  # next line of `old` not yet copied
    lines = diff.split("\n")
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        i += 1
    while i < len(lines):
        head = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", lines[i])
        if head is None:
            return None
        start = int(head[1]) - (0 if head[2] == "0" else 1)
        if start < at:
            return None
        out.extend(old[at:start])
        at = start
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            line = lines[i]
            eol = "\n"
            if i + 1 < len(lines) and lines[i + 1] == "\\ No newline at end of file":
                eol = ""
            if line.startswith((" ", "-")):
                if at >= len(old) or old[at] != line[1:] + eol:
                    return None
                if line[0] == " ":
                    out.append(old[at])
                at += 1
            elif line.startswith("+"):
                out.append(line[1:] + eol)
            elif line and not line.startswith("\\"):
                return None
            i += 1
    out.extend(old[at:])
    return "".join(out)


def _lines(text: str) -> list[str]:
    """Lines split on \\n only, as git sees them (str.splitlines also splits on \\f, \\r, ...)."""
    import re

    return re.findall(r"[^\n]*\n|[^\n]+$", text)
