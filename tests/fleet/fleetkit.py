"""Helpers of the fleet tier: the image recipe run without a container runtime, playbook runs,
tree snapshots.

`run_containerfile` reads `examples/Containerfile` and performs its own steps (ARG, ENV, COPY,
RUN, ENTRYPOINT, CMD) in a host directory, with the image's paths remapped through build
arguments, so the test runs the recipe users build rather than a copy of it. Anything else in
the file is an error here: a new instruction must be taught to this runner (and so tested).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
COLLECTION = ROOT / "ansible_collections" / "sm120" / "sm120patch"
PLAYBOOKS = Path(__file__).resolve().parent / "playbooks"
FQCN = "sm120.sm120patch.sm120patch"

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def substitute(text: str, env: dict[str, str]) -> str:
    """Docker's `${VAR}` / `$VAR` substitution in ARG, ENV and COPY (unknown names: empty)."""
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), text)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: the last instruction ends with a continuation"
    return out


@dataclass
class Image:
    """What a Containerfile run left: its environment, entrypoint and command."""

    env: dict[str, str]
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)


def run_containerfile(
    containerfile: Path,
    context: Path,
    build_args: dict[str, str],
    run_env: dict[str, str],
    log: Path,
    only: Callable[[str, str], bool] | None = None,
) -> Image:
    """Perform the Containerfile's steps on this host: RUN in `sh -c` with `run_env` (PATH first
    to the fresh venv, standing in for the image's Python), COPY from `context`. With `only`,
    just the COPY and RUN steps it takes (word, rest) for, ARG and ENV all the same."""
    scope: dict[str, str] = {}
    image = Image(env={})
    for word, rest in instructions(containerfile):
        if word in ("COPY", "RUN") and only is not None and not only(word, rest):
            continue
        if word == "FROM":
            scope = {}  # build arguments declared before FROM are out of scope after it
        elif word == "ARG":
            name, _, default = rest.partition("=")
            scope[name] = build_args.get(name, substitute(default, {**scope, **image.env}))
        elif word == "ENV":
            name, _, value = rest.partition("=")
            image.env[name] = substitute(value, {**scope, **image.env})
        elif word == "COPY":
            src, dst = (substitute(p, {**scope, **image.env}) for p in shlex.split(rest))
            source = context / src
            if source.is_dir():
                shutil.copytree(source, dst, dirs_exist_ok=True, symlinks=True)
            else:
                Path(dst).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dst)
        elif word == "RUN":
            env = {**run_env, **scope, **image.env}
            image.steps.append(rest)
            with log.open("a", encoding="utf-8") as fh:
                fh.write(f"\n$ {rest}\n")
                fh.flush()
                started = time.monotonic()
                proc = subprocess.run(
                    ["/bin/sh", "-c", rest], env=env, stdout=fh, stderr=subprocess.STDOUT
                )
                fh.write(f"({time.monotonic() - started:.1f} s)\n")
            if proc.returncode != 0:
                raise AssertionError(
                    f"RUN {rest} exited {proc.returncode}:\n{log.read_text()[-4000:]}"
                )
        elif word == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif word == "CMD":
            image.cmd = json.loads(rest)
        else:
            raise AssertionError(f"{containerfile}: this test does not know {word}; teach it")
    return image


# What a checkout that has been worked in holds besides its files (a virtual environment, the
# git directory, a stale build, caches): the build context starts from these too, so the tests
# see what .dockerignore keeps out of the image and the wheel.
LEFTOVERS = {
    ".venv/pyvenv.cfg": "home = /usr/bin\n",
    ".git/HEAD": "ref: refs/heads/main\n",
    "build/lib/sm120patch/stale_leftover.py": "raise SystemExit('a stale build/ reached the wheel')\n",
    "sm120patch.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: sm120patch\nVersion: 0.0.0\n",
    "sm120patch/__pycache__/stale_leftover.cpython-311.pyc": "not bytecode\n",
}


def _ignore_pattern(pattern: str) -> re.Pattern[str]:
    """One .dockerignore line as Docker reads it: relative to the context root, `*` and `?`
    within a path segment, `**` across segments."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(rel: str, lines: list[str]) -> bool:
    """Whether Docker leaves `rel` out of the context: the last pattern matching it or one of
    its parent directories decides, `!` patterns taking back in."""
    parents = ["/".join(rel.split("/")[: n + 1]) for n in range(rel.count("/") + 1)]
    ignored = False
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = _ignore_pattern(line[1:] if keep else line)
        if any(pattern.fullmatch(p) for p in parents):
            ignored = not keep
    return ignored


def checkout_files() -> list[str]:
    """The files of this checkout git tracks or would track, relative to its root."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return list(filter(None, listed.split("\0")))


def build_context(dest: Path, rules: list[str] | None = None) -> Path:
    """What `docker build .` sends from a checkout: the files git tracks or would track, and
    a worked-in checkout's LEFTOVERS, less what the .dockerignore `rules` leave out (by
    default the repository's)."""
    if rules is None:
        rules = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    for rel in checkout_files():
        source = ROOT / rel
        if source.is_file() and not dockerignored(rel, rules):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for rel, text in LEFTOVERS.items():
        if not dockerignored(rel, rules):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text, encoding="utf-8")
    return dest


STATE_DIR = ".sm120patch"  # the tool's own state beside an installed target (not importable)


def snapshot(root: Path, *, with_state: bool = False) -> dict[str, str]:
    """sha256 of every file under `root`: a byte-for-byte picture of a tree. Bytecode caches
    aside (the tool drops stale ones on purpose), and the tool's state directory unless
    `with_state` (for what must write nothing anywhere: check mode, a refused lock)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or "__pycache__" in rel.parts:
            continue
        if rel.parts[0] == STATE_DIR and not with_state:
            continue
        out[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@dataclass
class PlaybookRun:
    rc: int
    output: str
    result: dict

    @property
    def recap(self) -> dict[str, int]:
        """localhost's PLAY RECAP counters (ok, changed, failed, ...)."""
        line = next(x for x in self.output.splitlines() if x.startswith("localhost "))
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def ansible_bin(name: str) -> str:
    """The ansible-core entry point next to this interpreter (the test venv's)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def ansible_playbook(
    book: Path,
    collections: Path,
    extra: dict,
    tmp: Path,
    *flags: str,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """ansible-playbook BOOK against localhost, with `extra` as its extra variables."""
    vars_file = tmp / f"vars-{len(list(tmp.glob('vars-*')))}.json"
    vars_file.write_text(json.dumps(extra))
    return subprocess.run(
        [
            ansible_bin("ansible-playbook"),
            "-i",
            "localhost,",
            str(book),
            "-e",
            f"@{vars_file}",
            *flags,
        ],
        env={
            **(env or os.environ),
            "ANSIBLE_COLLECTIONS_PATH": str(collections),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_RETRY_FILES_ENABLED": "0",
            "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-local"),
            "ANSIBLE_HOME": str(tmp / "ansible-home"),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def playbook(
    name: str,
    collections: Path,
    extra: dict,
    tmp: Path,
    *flags: str,
    env: dict[str, str] | None = None,
) -> PlaybookRun:
    """ansible-playbook PLAYBOOKS/name against localhost; `result` is what the playbook wrote
    to `result_file` (the module's registered result), or {} when it wrote nothing."""
    result_file = tmp / f"result-{len(list(tmp.glob('result-*')))}.json"
    proc = ansible_playbook(
        PLAYBOOKS / name,
        collections,
        {**extra, "result_file": str(result_file)},
        tmp,
        *flags,
        env=env,
    )
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return PlaybookRun(proc.returncode, proc.stdout + proc.stderr, result)
