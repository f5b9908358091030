"""`revert --all` on a pristine tree this run cannot write (a read-only mount: an image's
layer, a container's read-only root; or a tree of another user's) has nothing to undo: exit 0,
"nothing applied", as on a writable one. It must not need the lock to say so."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
from trees import make_tree, tree_hash

PY = shlex.quote(sys.executable)


def _read_only_mount(root: str, command: str) -> list[str]:
    """`command` in a mount namespace of its own where `root` is bind-mounted read-only."""
    r = shlex.quote(root)
    return ["unshare", "-m", "sh", "-c",
            f"mount --bind {r} {r} && mount -o remount,bind,ro {r} && {command}"]  # fmt: skip


def _other_user(root: str, command: str) -> list[str]:
    """`command` as a user who owns nothing of `root` (uid 65534): it can read, not write."""
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
            "sh", "-c", command]  # fmt: skip


def _can(wrap, root) -> str | None:
    """Why this box cannot run `wrap` (None: it can)."""
    tool = wrap(str(root), "true")[0]
    if shutil.which(tool) is None:
        return f"no {tool} here"
    if os.geteuid() != 0:
        return f"{tool} needs root to make a tree this run cannot write"
    probe = subprocess.run(
        wrap(str(root), f"touch {shlex.quote(str(root / '.probe'))}"), capture_output=True
    )
    (root / ".probe").unlink(missing_ok=True)
    if probe.returncode == 0:
        return f"{tool} did not make {root} unwritable here"
    if b"Read-only" not in probe.stderr and b"Permission denied" not in probe.stderr:
        return f"{tool} cannot run here: {probe.stderr.decode(errors='replace').strip()}"
    python = subprocess.run(wrap(str(root), f"cd / && {PY} -c 1"), capture_output=True)
    if python.returncode != 0:  # the other user cannot reach this Python (under /root)
        return f"{tool}: this Python cannot run there: {python.stderr.decode().strip()}"
    return None


@pytest.mark.parametrize("wrap", [_read_only_mount, _other_user], ids=["ro-mount", "other-uid"])
@pytest.mark.parametrize("layout", ["installed", "git"])
def test_revert_all_on_an_unwritable_pristine_tree_is_nothing_applied(wrap, layout, tmp_path):
    os.chmod(tmp_path, 0o755)  # readable by the other user on the way down
    for parent in tmp_path.parents:
        if not os.access(parent, os.X_OK, effective_ids=False):
            pytest.skip(f"{parent} cannot be passed through")
    tree = make_tree(tmp_path, "sglang", "0.5.8", layout)
    why = _can(wrap, tree)
    if why is not None:
        pytest.skip(why)
    before = tree_hash(tree)
    command = f"cd / && {PY} -m sm120patch revert --all --sglang {shlex.quote(str(tree))}"
    proc = subprocess.run(wrap(str(tree), command), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sm120patch has not applied anything on SGLang" in proc.stdout, proc.stdout
    assert tree_hash(tree) == before
