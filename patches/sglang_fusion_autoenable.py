"""sglang.fusion-autoenable: placeholder until the transform lands; refuses everywhere."""

from __future__ import annotations

from sm120patch.transform import Patch, Result, refused


def transform(module: object) -> Result:
    return refused("<module>", "an implemented patch", "a placeholder")


PATCH = Patch(
    id="sglang.fusion-autoenable",
    target="sglang",
    title="(placeholder)",
    why="(placeholder)",
    files=("sglang/srt/server_args.py",),
    marker="",
    shapes=(),
    transform=transform,
)
