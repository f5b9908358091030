"""Importable copies of real releases over one shared dependency environment, in the cache.

Layout under `<cache>/behaviour/` (outside the repository, kept across sessions):
- `deps-<key>/`: one virtual environment with a CPU build of torch and what SGLang's and
  FlashInfer's decision modules import (`DEPS`), made once; `<key>` hashes `DEPS`, so a change
  of the list makes a new one.
- `transformers-<version>-<key>/`: a `pip install --target` prefix with the transformers a
  release pins when it is not the one in `deps` (SGLang 0.5.10 on pin 5.x), put before it on
  sys.path; torch and numpy are held to `deps`' versions.
- `<kind>-<version>/`: the release's own wheel, `pip install --no-deps --target`.
- `vllm-deps-<key>/`: a `pip install --target` prefix with what vLLM's decision modules import
  beyond `deps` (`VLLM_DEPS`, transformers 5 among them), put before it on sys.path, torch and
  numpy held to `deps`' versions, so that `deps` (SGLang's and FlashInfer's) is not rebuilt.
  vLLM itself is not installed: its releases are read from their source trees in the cache
  (`maintain.sources.tree`, the `.py` files and the dist-info, no compiled extension).

Each is built in a staging directory and renamed into place under a file lock, so a killed
or concurrent run never leaves half of one. Nothing here downloads torch from an index
unpinned: every install runs with `torch==TORCH` as a constraint.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from sm120patch.maintain import dists, releases

TORCH = "2.13.0"
# What `import sglang.srt.server_args`, the fusion gate modules, `flashinfer_comm_fusion` and
# `flashinfer.jit.comm` need on CPU, found by importing each release of the default set
# (0.5.8 ... 0.5.23, FlashInfer 0.6.1, 0.6.15) and adding what was missing, at the versions
# that worked. Deliberately absent: sgl-kernel and other compiled CUDA extensions (1.6 GB
# that cannot load without a GPU; the probe stands a placeholder in for them when simulating).
DEPS = (
    f"torch=={TORCH}",
    "numpy==2.4.6",
    "transformers==4.57.1",
    "torchvision==0.28.0",
    "triton==3.9.0",
    "compressed-tensors==0.20.1",
    "apache-tvm-ffi==0.1.15.post2",
    "nvidia-ml-py",
    # libcudart, which FlashInfer's comm module wants loaded (the probe loads it when simulating).
    "nvidia-cuda-runtime-cu12==12.9.79",
    "aiohttp==3.14.5",
    "dill==0.4.1",
    "einops==0.8.2",
    "gguf==0.19.0",
    "ipython==9.18.1",
    "msgspec==0.23.0",
    "openai==3.57.0",
    "orjson==3.13.0",
    "partial-json-parser==0.2.1.1.post7",
    "pillow==13.0.0",
    "pybase64==1.5.1",
    "pydantic==2.14.4",
    "pyzmq==27.3.0",
    "sentencepiece==0.2.3",
    "starlette==1.10.0",
    "tqdm==4.70.1",
    "xgrammar==0.2.9",
)


# What `vllm.model_executor.layers.fused_moe.oracle.nvfp4`, `vllm.config.vllm` and
# `vllm.distributed.device_communicators.custom_all_reduce` import on CPU beyond DEPS, found by
# importing vLLM 0.30.0 and 0.34.0 and adding what was missing (a few of the first batch may
# be more than the minimum). transformers 5.17.0 is inside every pinned release's range
# (0.30.0: >=5.10.4; 0.31.0: <5.18.0; 0.32.0 to 0.34.0: >=5.16.1). vLLM's compiled extensions
# and its FlashInfer are not here: the vLLM probe stands placeholders in for them.
VLLM_DEPS = (
    "transformers==5.17.0",
    "blake3==1.0.11",
    "cachetools==8.0.2",
    "cbor2==6.3.0",
    "cloudpickle==3.1.3",
    "fastapi==0.136.3",
    "ijson==3.6.0",
    "llguidance==1.7.6",
    "openai-harmony==0.0.8",
    "prometheus-client==0.26.0",
    "psutil==7.2.2",
    "py-cpuinfo==9.0.0",
    "python-json-logger==4.2.0",
    "setproctitle==1.3.8",
    "uvloop==0.23.0",
)


class EnvError(RuntimeError):
    """A dependency environment or a release copy could not be made."""


def root() -> Path:
    return releases.cache_dir() / "behaviour"


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _building(dest: Path) -> Iterator[Path | None]:
    """Yield a staging directory to fill, renamed to `dest` afterwards; None if `dest` is
    already there (another process built it while we waited for the lock)."""
    import filelock

    dest.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(dest.parent / f".{dest.name}.lock")):
        if (dest / ".complete").exists():
            yield None
            return
        shutil.rmtree(dest, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            yield staging
            (staging / ".complete").write_text("ok\n")
            os.replace(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _run(args: list[str], what: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise EnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _constraints(directory: Path, lines: list[str]) -> Path:
    path = directory / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def deps_python() -> Path:
    """The shared environment's interpreter, made on first use."""
    dest = root() / f"deps-{_key(sys.version, *DEPS)}"
    with _building(dest) as staging:
        if staging is not None:
            # A venv works from its new place after the rename: pip runs as `python -m pip`.
            _run([sys.executable, "-m", "venv", str(staging)], "python -m venv")
            cons = _constraints(staging, [f"torch=={TORCH}"])
            _run(
                [str(_python_in(staging)), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", "-c", str(cons), *DEPS],
                f"pip install of the behaviour dependencies into {dest}",
            )
    return _python_in(dest)


def _python_in(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _held() -> list[str]:
    """torch and numpy (compiled, shared with everything) at the shared environment's
    versions: every prefix is installed with these as constraints."""
    return [d for d in DEPS if d.startswith(("torch==", "numpy=="))]


def _prefix(dest: Path, requirements: list[str], what: str) -> Path:
    """`dest/site`: a `pip install --target` of `requirements`, held to `_held()`, made once."""
    python = deps_python()
    with _building(dest) as staging:
        if staging is not None:
            _run(
                [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 "--target", str(staging / "site"), "-c", str(_constraints(staging, _held())),
                 *requirements],
                f"pip install --target of {what}",
            )
    return dest / "site"


def transformers_prefix(version: str) -> Path:
    """A prefix with transformers `version` and what it needs at the versions it needs,
    before the shared environment on sys.path."""
    return _prefix(root() / f"transformers-{version}-{_key(sys.version, *_held())}",
                   [f"transformers=={version}"], f"transformers {version}")


def vllm_prefix() -> Path:
    """The prefix with VLLM_DEPS (module docstring), made on first use."""
    return _prefix(root() / f"vllm-deps-{_key(sys.version, *_held(), *VLLM_DEPS)}",
                   list(VLLM_DEPS), "vLLM's decision-module dependencies")


def vllm_sys_path(version: str) -> list[str]:
    """What goes before the shared environment on sys.path to import vLLM `version`: its
    source tree from the cache, then VLLM_DEPS."""
    from sm120patch.maintain import sources

    return [str(sources.tree("vllm", version)), str(vllm_prefix())]


def release_prefix(kind: str, version: str) -> Path:
    """`<cache>/behaviour/<kind>-<version>/`: the release installed from its cached wheel."""
    dist = dists.fetch(kind, version)
    if not dist.name.endswith(".whl"):
        raise EnvError(f"{kind} {version} ships no wheel ({dist.name}); not importable here")
    dest = root() / f"{kind}-{version}"
    with _building(dest) as staging:
        if staging is not None:
            _run(
                [str(deps_python()), "-m", "pip", "install", "-q", "--no-deps",
                 "--disable-pip-version-check", "--target", str(staging / "site"), str(dist)],
                f"pip install --no-deps --target of {dist.name}",
            )
    return dest / "site"


def pinned(kind: str, version: str, project: str) -> str | None:
    """The version of `project` a release pins unconditionally, from its wheel's METADATA."""
    from packaging.utils import canonicalize_name

    dist = dists.fetch(kind, version)
    with zipfile.ZipFile(dist) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1
                    and n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if canonicalize_name(req.name) == canonicalize_name(project) and not req.marker:
            pins = [s.version for s in req.specifier if s.operator == "=="]
            return pins[0] if pins else None
    return None


def sys_path_for(kind: str, version: str) -> list[str]:
    """What goes before the shared environment on sys.path to import this release: the
    release, and for SGLang the FlashInfer and the transformers it pins (some modules the
    server arguments import, such as modelopt_quant from 0.5.19, import flashinfer)."""
    paths = [str(release_prefix(kind, version))]
    if kind == "sglang":
        flashinfer = pinned(kind, version, releases.PROJECT["flashinfer"])
        if flashinfer:
            paths.append(str(release_prefix("flashinfer", flashinfer)))
        wanted = pinned(kind, version, "transformers")
        shared = next(d.split("==")[1] for d in DEPS if d.startswith("transformers=="))
        if wanted and Version(wanted) != Version(shared):
            paths.append(str(transformers_prefix(wanted)))
    return paths
