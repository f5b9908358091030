"""Another user on the box, made for the attack tests: a local account (and a group it shares with
the tree's owner) created with `useradd`, whose steps run as that uid through `setpriv`.

Everything the attacker plants is written by the attacker's own process, so the kernel decides
what it may write, as it would on a shared GPU server. Where the tests do not run as root (no
`useradd`, no `setpriv`), the fixture skips and says why.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# The attacker's interpreter: the system's, which any user may run (the test venv's may live in
# a home directory no one else can enter). Its steps are plain file operations.
PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Attacker:
    name: str
    uid: int
    gid: int
    group: str  # a group the attacker is in: a "group-writable environment" is this group's
    group_gid: int

    def run(self, code: str, *args: str, cwd: str = "/") -> subprocess.CompletedProcess[str]:
        """`code` (Python) run as the attacker, with `args` in sys.argv[1:]."""
        return subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--",
             PYTHON, "-c", code, *args],
            capture_output=True, text=True, cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "HOME": "/", "LC_ALL": "C"},
        )  # fmt: skip

    def ok(self, code: str, *args: str, cwd: str = "/") -> str:
        proc = self.run(code, *args, cwd=cwd)
        assert proc.returncode == 0, f"the attacker's step failed: {proc.stderr}"
        return proc.stdout

    def write(self, path: Path, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file as the attacker (its parents made as the attacker too)."""
        blob = data.encode() if isinstance(data, str) else data
        self.ok(
            "import os, sys, base64\n"
            "p = sys.argv[1]\n"
            "os.makedirs(os.path.dirname(p), exist_ok=True)\n"
            "open(p, 'wb').write(base64.b64decode(sys.argv[2]))\n"
            "os.chmod(p, int(sys.argv[3], 8))\n",
            str(path), base64.b64encode(blob).decode(), oct(mode)[2:],
        )  # fmt: skip

    def mkdir(self, path: Path, mode: int = 0o755) -> None:
        self.ok("import os, sys\nos.makedirs(sys.argv[1], exist_ok=True)\n"
                "os.chmod(sys.argv[1], int(sys.argv[2], 8))", str(path), oct(mode)[2:])  # fmt: skip

    def give(self, path: Path, mode: int = 0o755) -> Path:
        """A directory of the attacker's own, made for them (as `useradd -m` makes a home)."""
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        path.chmod(mode)
        return path

    def symlink(self, target: Path, link: Path) -> None:
        self.ok("import os, sys\nos.symlink(sys.argv[1], sys.argv[2])", str(target), str(link))

    def can_write(self, path: Path) -> bool:
        """Whether the attacker can create a file in `path` (a directory) or open `path`."""
        proc = self.run(
            "import os, sys\np = sys.argv[1]\n"
            "t = os.path.join(p, '.probe') if os.path.isdir(p) else p\n"
            "try:\n    fd = os.open(t, os.O_WRONLY | os.O_CREAT, 0o644)\nexcept OSError:\n"
            "    sys.exit(3)\nos.close(fd)\nif t != p:\n    os.unlink(t)\n",
            str(path),
        )  # fmt: skip
        return proc.returncode == 0


def _retry(cmd: list[str]) -> None:
    """useradd and groupadd lock /etc/passwd: another engineer's run may hold it a moment."""
    for _ in range(20):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            return
        if "lock" not in proc.stderr:
            break
        time.sleep(0.5)
    raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


_MADE = itertools.count()


@pytest.fixture(scope="session", name="attacker")
def attacker_fixture():
    """A fresh local user (its own group, and a second group `group` to share trees through),
    removed at the end of the session."""
    if os.geteuid() != 0:
        pytest.skip("the attacks are planted by another user made for the test: needs root "
                    "(useradd, setpriv)")  # fmt: skip
    missing = [t for t in ("useradd", "userdel", "groupadd", "groupdel", "setpriv")
               if shutil.which(t) is None]  # fmt: skip
    if missing or not os.access(PYTHON, os.X_OK):
        pytest.skip(f"no {', '.join(missing) or PYTHON} here to make the attacking user with")
    import grp
    import pwd

    # Two test modules import this fixture, so a session may make two users: the pid alone
    # would name both alike.
    tag = f"{os.getpid() % 100000:05d}{next(_MADE)}"
    name, group = f"sm120a{tag}", f"sm120g{tag}"
    _retry(["groupadd", group])
    try:
        _retry(["useradd", "-M", "-N", "-g", group, "-s", "/usr/sbin/nologin", "-d", "/", name])
        try:
            user = pwd.getpwnam(name)
            yield Attacker(name, user.pw_uid, user.pw_gid, group, grp.getgrnam(group).gr_gid)
        finally:
            _retry(["userdel", name])
    finally:
        _retry(["groupdel", group])


@pytest.fixture(name="shared")
def shared_fixture(attacker):
    """A directory every user can enter (pytest's own tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="sm120atk-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def add_record(site: Path, kind: str, version: str) -> None:
    """The dist-info RECORD pip writes: each file of the package with its urlsafe-b64 sha256."""
    info = next(site.glob(f"*-{version}.dist-info"))
    rows = []
    for path in sorted((site / kind).rglob("*.py")):
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        rows.append(f"{path.relative_to(site).as_posix()},sha256={digest.rstrip(b'=').decode()},"
                    f"{path.stat().st_size}")  # fmt: skip
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def upgrade(site: Path, kind: str, old: str, new: str) -> dict[str, bytes]:
    """What `pip install` of another release does to an installed package: every file of the
    package replaced by the new release's (here: the old text and a line), a new dist-info
    with its own RECORD. Returns the new bytes, by path relative to `site`."""
    from trees import FLASHINFER_FILES, SGLANG_FILES

    out = {}
    for rel, text in (SGLANG_FILES if kind == "sglang" else FLASHINFER_FILES).items():
        data = f"{text}# {kind} {new}\n".encode()
        (site / rel).write_bytes(data)
        out[rel] = data
    info = next(site.glob(f"*-{old}.dist-info"))
    newer = info.with_name(info.name.replace(old, new))
    info.rename(newer)
    meta = newer / "METADATA"
    meta.write_text(meta.read_text().replace(f"Version: {old}", f"Version: {new}"))
    add_record(site, kind, new)
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def journal(files: list[dict], *, op: str = "apply", profile: str = "moe", **more) -> str:
    """A journal as an attacker writes one (the shape sm120patch reads)."""
    doc = {"schema": 1, "op": op, "profile": profile, "started": time.time(), "pid": 999999,
           "txn": None, "peers": [], "target": {"kind": "sglang", "version": "0.5.8"},
           "files": files, "git": None, **more}  # fmt: skip
    return json.dumps(doc)
