"""Probe processes forked from an interpreter that has already imported torch.

Every behaviour probe is a fresh process of the dependency environment's interpreter that
imports torch (about a second of CPU) before SGLang, FlashInfer or vLLM. The server below is
that interpreter with torch imported once; each probe is a fork of it. A probe still runs as
the product runs it: `explain.run_probe` (or vLLM's probe runner) starts `python PROBE REQUEST
RESULT` as always, only `python` is `client()`, a small script that hands its argv,
environment, working directory and standard streams to the server and exits with the probe's
exit status.

A fork is the same process as a fresh interpreter only where what was imported before the fork
is what the fresh one would import. The forked child checks that, for the request it runs, and
otherwise runs the fresh interpreter itself (`fresh` in the reply):
- each module imported before the fork is found, on the request's sys.path, in a distribution
  whose RECORD (every file and its sha256) is the server's own, or not shadowed at all;
- no source file imported before the fork names a variable the request's environment sets (the
  probe sets them before it imports torch).
`SM120PATCH_BEHAVIOUR_FORK=0` turns the server off: every probe then starts fresh.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

FORK_ENV = "SM120PATCH_BEHAVIOUR_FORK"
PRELOAD = ("torch",)

# Run by the dependency environment's interpreter: `python SERVER SOCKET`.
SERVER = r'''
import array, ast, json, os, re, runpy, signal, socket, subprocess, sys, traceback, warnings

here = sys.path.pop(0)  # this file's directory: a probe's own sys.path[0] is its directory
before = set(sys.modules)
import torch  # noqa: E402  the one thing every probe imports first

LOADED = {}  # top-level name -> file of each module imported with torch, outside the stdlib
for name in set(sys.modules) - before:
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None) or ""
    if path and "-packages" in path:
        LOADED.setdefault(name.split(".")[0], []).append(path)
SITE = {top: paths[0][: paths[0].index(os.sep + top)] for top, paths in LOADED.items()
        if os.sep + top in paths[0]}
# Every upper-case word of the sources imported with torch: an environment variable the
# request sets that is one of them could have been read before the fork.
NAMES = set()
for paths in LOADED.values():
    for path in paths:
        if path.endswith(".py"):
            with open(path, "rb") as fh:
                NAMES.update(re.findall(rb"[A-Z][A-Z0-9_]{2,}", fh.read()))


def record(entry, top):
    """The RECORD of the distribution in `entry` holding `top`, as sorted lines, or None."""
    for name in sorted(os.listdir(entry)):
        if name.endswith(".dist-info") and os.path.isfile(os.path.join(entry, name, "RECORD")):
            with open(os.path.join(entry, name, "RECORD"), encoding="utf-8") as fh:
                lines = fh.read().splitlines()
            own = (top + "/", top + ".py,", top + ".libs/")  # its files, its vendored libraries
            if any(line.startswith(own) for line in lines):
                return sorted(line for line in lines if line.startswith(own))
    return None


def why_fresh(request):
    """Why this request needs a fresh interpreter, or None."""
    for entry in request.get("sys_path", []):
        for top in LOADED:
            there = os.path.join(entry, top)
            if not (os.path.isdir(there) or os.path.isfile(there + ".py")):
                continue
            if top not in SITE or record(entry, top) is None or (
                    record(entry, top) != record(SITE[top], top)):
                return f"{top} in {entry} is not the one imported before the fork"
    for name in request.get("env", {}):
        if name.encode() in NAMES:
            return f"{name}, which the request sets, is named by what was imported with torch"
    return None


def child(conn):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's choice, not a probe's
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    job = json.loads(msg.decode())
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    argv = job["argv"]  # PROBE REQUEST RESULT
    with open(argv[1], encoding="utf-8") as fh:
        why = why_fresh(json.load(fh))
    with open(LOG, "a", encoding="utf-8") as fh:  # one short line per probe: one write
        fh.write(f"fresh: {why}\n" if why else "forked\n")
    if why is not None:
        code = subprocess.call([sys.executable, *argv])
        conn.sendall(json.dumps({"code": code, "fresh": why}).encode())
        return
    if job["env"].get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    sys.dont_write_bytecode = bool(job["env"].get("PYTHONDONTWRITEBYTECODE"))
    sys.pycache_prefix = job["env"].get("PYTHONPYCACHEPREFIX") or None
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    conn.sendall(json.dumps({"code": code, "fresh": None}).encode())


signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
LOG = sys.argv[2]
server.listen(64)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    if os.fork() == 0:
        server.close()
        try:
            child(conn)
        finally:
            os._exit(0)
    conn.close()
'''

# Run by the dependency environment's interpreter, `-S`: `client PROBE REQUEST RESULT`.
CLIENT = r'''
import json, os, socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect({socket!r})
job = {{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}
socket.send_fds(conn, [json.dumps(job).encode()], [0, 1, 2])
reply = b""
while chunk := conn.recv(4096):
    reply += chunk
sys.exit(json.loads(reply)["code"] if reply else 70)
'''


class ForkServer:
    def __init__(self, python: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sm120patch-forkserver-"))
        self.socket = self.dir / "server.sock"
        server = self.dir / "server.py"
        server.write_text(SERVER, encoding="utf-8")
        self.client = self.dir / "python"
        self.client.write_text(f"#!{python} -S\n" + CLIENT.format(socket=str(self.socket)),
                               encoding="utf-8")
        self.client.chmod(0o755)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONDONTWRITEBYTECODE": "1"}
        self.log = self.dir / "probes.log"
        self.proc = subprocess.Popen([str(python), str(server), str(self.socket), str(self.log)],
                                     env=env,
                                     stdout=subprocess.PIPE, cwd="/")
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the probe fork server in {python} did not start")
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVERS: dict[Path, ForkServer] = {}
_LOCK = threading.Lock()


def python(deps: Path) -> Path:
    """The interpreter a probe is started with: the fork server's client for `deps`, or `deps`
    itself where the server is off."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return deps
    with _LOCK:
        if deps not in _SERVERS:
            _SERVERS[deps] = ForkServer(deps)
        return _SERVERS[deps].client


def counts() -> dict[str, int]:
    """How the session's probes ran: forked, or fresh (with each reason counted)."""
    out: dict[str, int] = {}
    for server in _SERVERS.values():
        if server.log.is_file():
            for line in server.log.read_text(encoding="utf-8").splitlines():
                out[line] = out.get(line, 0) + 1
    return out
