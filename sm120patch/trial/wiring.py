"""Wiring evidence: did a patch's path run in the server? A patch declares in `Patch.wiring`
(patchkit.model.Wiring) the server log lines that show its path ran or was skipped at run time
(fusion: "FlashInfer AllReduce Fusion enabled and workspace initialized" against "Skipping
allreduce fusion"). A patch can apply and start cleanly and never run its path (a runtime
check upstream turns the feature off): only the log tells. Each run's output is read here line
by line as it comes, never held whole, with the model's own reading (`Wiring.read`, the last
matching line decides): per patch `ran`, `skipped` or `not-seen`, and the line that showed it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sm120patch.plan.catalog import Catalog

from collections.abc import Iterable, Mapping, Sequence

from sm120patch.patchkit.model import Seen, Wiring

Declared = tuple[str, Wiring]  # a patch's id and its wiring


def declared(profile: str, cat: Catalog) -> list[Declared]:
    """The wiring of each patch of `profile` (of the command's catalog, `cat`) that declares
    one."""
    return [(p.id, p.wiring) for p in cat.patches_of(cat.profile(profile)) if p.wiring]


class Scan:
    """One run's output, fed a line at a time: a path that ran and was turned off later counts
    as skipped, and the other way round (the last matching line decides, as in Wiring.read)."""

    def __init__(self, wiring: Sequence[Declared]) -> None:
        self.wiring = list(wiring)
        self.seen: dict[str, dict[str, str]] = {
            patch: {"seen": Seen.NOT_SEEN.value, "line": ""} for patch, _ in self.wiring
        }

    def feed(self, line: str) -> None:
        for patch, w in self.wiring:
            evidence = w.read(line)
            if evidence.seen is not Seen.NOT_SEEN:
                self.seen[patch] = evidence.to_dict()

    def result(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in self.seen.items()}


def read(wiring: Sequence[Declared], lines: Iterable[str]) -> dict[str, dict[str, str]]:
    """Per declared patch: ran, skipped or not-seen in `lines` (a server's output)."""
    scan = Scan(wiring)
    for line in lines:
        scan.feed(line)
    return scan.result()


def skipped(seen: Mapping[str, Mapping[str, str]]) -> tuple[str, str] | None:
    """(patch, line) of the first patch whose path one run's wiring shows skipped."""
    for patch, evidence in seen.items():
        if evidence.get("seen") == Seen.SKIPPED.value:
            return patch, evidence.get("line", "")
    return None
