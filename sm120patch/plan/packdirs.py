"""Which pack directories this process loads: `--patches` (through `use_packs`), then
SM120PATCH_PATCHES. A module of its own, importing nothing, so that a command which never loads
the catalog (`status`, `--help`) does not pay for importing it to say "no packs"."""

from __future__ import annotations

import os
from collections.abc import Iterable

PACKS_ENV = "SM120PATCH_PATCHES"

# Process-wide, as the catalog it selects is cached process-wide (`catalog._load`).
_CHOSEN: list[str] = []


def use_packs(dirs: Iterable[str]) -> None:
    """Load the pack directories `dirs` too (the CLI's --patches), before SM120PATCH_PATCHES."""
    _CHOSEN[:] = [str(d) for d in dirs]


def pack_dirs() -> tuple[str, ...]:
    """The pack directories in effect: `use_packs` (--patches), then SM120PATCH_PATCHES."""
    env = tuple(d for d in os.environ.get(PACKS_ENV, "").split(os.pathsep) if d)
    return (*_CHOSEN, *env)
