"""Find a patch of the library by id, for tests."""

from __future__ import annotations

from sm120patch.patchkit.model import Patch
from sm120patch.plan import catalog


def load_patch(patch_id: str) -> Patch:
    return catalog.load().patches[patch_id]
