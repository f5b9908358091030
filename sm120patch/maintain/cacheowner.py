"""Whose the release cache is: it is used only when it is the effective user's own.

A user's cache (root run with their HOME) or a shared one could hold a planted tree or a lock
link; like the state, the release cache is trusted only when no one but the
user running sm120patch (or root, above it) could have written it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

PARTS = ("dist", "trees", "index")


def own_cache(base: Path, warn: Callable[[str], None]) -> Path:
    """`base` when it and its `dist/`, `trees/` and `index/` are the effective user's own
    (`files.untrusted_by`, owner only); otherwise, after one warning, a new private directory
    of this process's own, into which releases are fetched afresh."""
    from sm120patch.targets.files import owner_name, untrusted_by

    uid = os.geteuid()
    for path in (base, *(base / part for part in PARTS)):
        problem = untrusted_by(path, uid, owner_only=True)
        if problem is not None:
            break
    else:
        return base
    private = Path(tempfile.mkdtemp(prefix="sm120patch-releases-"))
    warn(
        f"ignoring the release cache {base}: {problem}; a cache must be {owner_name(uid)}'s "
        f"own (owned by them, writable by no one else), so releases are fetched afresh into "
        f"{private}"
    )
    return private
