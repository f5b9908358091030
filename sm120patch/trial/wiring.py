"""Wiring evidence: did a patch's path run in the server? A patch may declare, in its
`wiring` attribute, the server log lines that show its path ran or was skipped at run time
(fusion: "FlashInfer AllReduce Fusion enabled and workspace initialized" against "Skipping
allreduce fusion"). A patch can apply and start cleanly and never run its path (a runtime
check upstream turns the feature off): only the log tells. Each run's output is read line by
line as it comes, per patch: `ran`, `skipped` or `not-seen`, and the line that showed it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Wiring:
    """A patch's declared log lines: regular expressions searched in each server line; one
    matching `ran` shows its path ran, one matching `skipped` that it was turned off."""

    patch: str
    ran: tuple[str, ...]
    skipped: tuple[str, ...] = ()


def wiring_of(patch: Any) -> Wiring | None:
    """What a patch declares in its `wiring` attribute (an object with `ran` and `skipped`
    sequences of regular expressions); None where it declares nothing."""
    declared = getattr(patch, "wiring", None)
    if declared is None:
        return None
    ran, skipped = getattr(declared, "ran", ()), getattr(declared, "skipped", ())
    return Wiring(patch.id, tuple(_strings(ran)), tuple(_strings(skipped)))


def _strings(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value or ()]


def declared(profile: str) -> list[Wiring]:
    """The wiring of each patch of `profile` that declares one."""
    from sm120patch.plan import catalog

    cat = catalog.load()
    found = (wiring_of(p) for p in cat.patches_of(cat.profile(profile)))
    return [w for w in found if w is not None and (w.ran or w.skipped)]


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error:
        return re.compile(re.escape(pattern))  # a declaration that is not a regex: its text


class Scan:
    """Reads a server's output line by line as it comes (a log is never held whole). The last
    line matching either side decides, per patch: a path that ran and was turned off later
    counts as skipped, and the other way round."""

    def __init__(self, wiring: Sequence[Wiring]) -> None:
        self.wiring = [
            (w.patch, [_compile(p) for p in w.ran], [_compile(p) for p in w.skipped])
            for w in wiring
        ]
        self.seen: dict[str, dict[str, str]] = {
            w.patch: {"seen": "not-seen", "line": ""} for w in wiring
        }

    def feed(self, line: str) -> None:
        for patch, ran, skipped in self.wiring:
            if any(p.search(line) for p in skipped):
                self.seen[patch] = {"seen": "skipped", "line": line.strip()}
            elif any(p.search(line) for p in ran):
                self.seen[patch] = {"seen": "ran", "line": line.strip()}

    def result(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in self.seen.items()}


def read(wiring: Sequence[Wiring], lines: Iterable[str]) -> dict[str, dict[str, str]]:
    """Per declared patch: ran, skipped or not-seen in `lines` (a server's output)."""
    scan = Scan(wiring)
    for line in lines:
        scan.feed(line)
    return scan.result()


def skipped(seen: Mapping[str, Mapping[str, str]]) -> tuple[str, str] | None:
    """(patch, line) of the first patch whose path one run's wiring shows skipped."""
    for patch, ev in seen.items():
        if ev.get("seen") == "skipped":
            return patch, ev.get("line", "")
    return None
