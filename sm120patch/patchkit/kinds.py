"""The kinds of target. A module of its own, importing nothing, because every command that finds
a target needs them and most (`status`, `ensure` on an applied tree) need nothing else of the
kit."""

from __future__ import annotations

from enum import Enum


class Kind(str, Enum):
    """What a target is. A str enum: equal to its value, so JSON, TOML, state files and pack
    modules (`Patch(target="sglang")`) keep the plain words."""

    SGLANG = "sglang"
    FLASHINFER = "flashinfer"

    def __str__(self) -> str:
        return self.value


TARGETS: tuple[Kind, ...] = tuple(Kind)
