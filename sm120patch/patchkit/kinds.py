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
    VLLM = "vllm"

    def __str__(self) -> str:
        return self.value


TARGETS: tuple[Kind, ...] = tuple(Kind)

# The kinds a command looks for where it names none (the one importable here, the FlashInfer
# beside an installed SGLang): every profile of the library needs one of them. A vLLM is
# found only where the command line names it (`--vllm PATH`), so that a command about SGLang
# never searches for, nor reads, a vLLM it was not asked about.
LOOKED_FOR: tuple[Kind, ...] = (Kind.SGLANG, Kind.FLASHINFER)

# Data about each kind, here rather than in targets/ (whose package init is at its size limit):
# the name a line shows, and the distribution names whose dist-info records an install.
DISPLAY: dict[str, str] = {"sglang": "SGLang", "flashinfer": "FlashInfer", "vllm": "vLLM"}
DIST_NAMES: dict[str, tuple[str, ...]] = {
    "sglang": ("sglang",),
    "flashinfer": ("flashinfer_python", "flashinfer"),
    "vllm": ("vllm",),
}
