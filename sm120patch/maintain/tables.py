"""The per-site tables of the documentation, made from the patches' facts.

`python -m sm120patch.maintain.tables` prints them; a test holds the page to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sm120patch.patchkit.model import Patch


def markdown(patches: Iterable[Patch]) -> str:
    """One table per patch: releases, outcome, file and function, shape (docs/compatibility.md)."""
    out: list[str] = []
    for patch in patches:
        out += [
            f"`{patch.id}` ({patch.target}): {patch.title}",
            "",
            "| releases | outcome | where | shape |",
            "|---|---|---|---|",
        ]
        for f in patch.facts:
            where = f"`{f.file}`" + (f" `{f.function}`" if f.function else "") if f.file else ""
            shape = f.shape.replace("|", "\\|")
            out.append(f"| `{f.releases or '*'}` | {f.status.value} | {where} | {shape} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":  # `python -m sm120patch.maintain.tables`: the per-site tables
    from sm120patch.plan import catalog

    print(markdown(catalog.load().patches.values()), end="")
