"""Find a patch of the library by id, for tests."""

from __future__ import annotations

from sm120patch import catalog
from sm120patch.transform import Patch


def load_patch(patch_id: str) -> Patch:
    return catalog.load().patches[patch_id]
