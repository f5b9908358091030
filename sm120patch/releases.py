"""The cache of real SGLang and FlashInfer releases that tests/real and benchmarks/ run against.

A release is downloaded once into `<cache>/dist/` and the few files the patches read are
unpacked into `<cache>/trees/<kind>-<version>/`, laid out like a site-packages directory
(package files plus a `<dist>-<version>.dist-info/METADATA`), so `targets.find(kind, tree)`
sees an installed target and reads its version from the dist-info.

The cache lives outside any repository: `$SM120PATCH_CACHE`, else the user cache directory.
Nothing here prints; failures raise `ReleaseError` with what went wrong.

How a release is fetched:
- wheels with `pip download --no-deps`, run by this interpreter. SGLang 0.5.11 and later only
  ship cp3xx manylinux_2_34 wheels, so we ask pip for the cp311 x86_64 one whatever this
  interpreter is (the Python sources we read are the same in every one of them);
- releases that are sdists only (FlashInfer 0.2.8 to 0.4.1) straight from PyPI's simple API,
  checked against the sha256 the index publishes. `pip download` of an sdist runs the
  package's build backend just to read metadata we do not need: it takes about a minute for
  FlashInfer 0.3.1 and fails outright for 0.4.0 and 0.4.1, whose pinned build requirement is
  gone from PyPI. Only when the index cannot be read that way do we fall back to pip, first
  with build isolation, then with `--no-build-isolation` when setuptools, packaging and
  apache-tvm-ffi are importable here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path, PurePosixPath

from packaging.specifiers import SpecifierSet
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

KINDS = ("sglang", "flashinfer")
# PyPI project of each target kind, and the import package inside it.
PROJECT = {"sglang": "sglang", "flashinfer": "flashinfer-python"}
PACKAGE = {"sglang": "sglang", "flashinfer": "flashinfer"}

SIMPLE_URL = "https://pypi.org/simple/{project}/"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
TIMEOUT_S = 30.0

# The releases tests/real runs by default: one or two per shape of every site (DESIGN s4).
DEFAULT_RELEASES: dict[str, tuple[str, ...]] = {
    "sglang": (
        "0.5.4",
        "0.5.6",
        "0.5.7",
        "0.5.8",
        "0.5.9",
        "0.5.13",
        "0.5.14",
        "0.5.16",
        "0.5.19",
        "0.5.22",
        "0.5.23",
    ),
    "flashinfer": ("0.3.1", "0.6.1", "0.6.15", "0.6.17"),
}
# The span of the opt-in full run (SM120PATCH_FULL_RELEASES=1): every final release inside it.
FULL_RANGE: dict[str, str] = {"sglang": ">=0.4.6,<=0.5.23", "flashinfer": ">=0.2.8,<=0.7.4"}

# Files that hold a site in some release (DESIGN s4), relative to the package's parent. The
# catalog's own `Patch.files` are added to these; listing them here as well keeps a tree built
# while a patch module is still a placeholder complete for the real one.
SITE_FILES: dict[str, tuple[str, ...]] = {
    "sglang": (
        "sglang/srt/layers/communicator.py",
        "sglang/srt/layers/layer_boundary/residual/add_norm.py",
        "sglang/srt/server_args.py",
        "sglang/srt/arg_groups/overrides.py",
        "sglang/srt/arg_groups/model_overrides/glm4_moe.py",
        "sglang/srt/layers/flashinfer_comm_fusion.py",
        "sglang/srt/distributed/device_communicators/custom_all_reduce.py",
        "sglang/srt/distributed/device_communicators/custom_all_reduce_utils.py",
    ),
    "flashinfer": ("flashinfer/comm/trtllm_ar.py", "flashinfer/jit/comm.py"),
}
# Files that say what a patched site may rely on: sglang.srt.utils defines the
# `is_sm120_supported` the SM120 flag imports (a module up to 0.4.x, a package after).
SUPPORT_FILES: dict[str, tuple[str, ...]] = {
    "sglang": ("sglang/srt/utils.py", "sglang/srt/utils/__init__.py", "sglang/srt/utils/common.py"),
    "flashinfer": (),
}
TREE_RECORD = ".sm120patch-tree.json"
TREE_SCHEMA = 1


class ReleaseError(RuntimeError):
    """A release could not be listed, fetched or unpacked."""


# ----------------------------------------------------------------------------- cache layout


def cache_dir() -> Path:
    """`$SM120PATCH_CACHE`, else the per-user cache directory of sm120patch."""
    env = os.environ.get("SM120PATCH_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("sm120patch"))


def dist_dir() -> Path:
    return cache_dir() / "dist"


def trees_dir() -> Path:
    return cache_dir() / "trees"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown target kind {kind!r}; expected one of {KINDS}")


STALE_S = 3600.0


def _sweep(directory: Path, prefixes: tuple[str, ...]) -> None:
    """Remove the staging directories a killed run left behind (never read: their names start
    with a dot and are unique), once they are old enough not to belong to a live run."""
    import time

    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            old = time.time() - entry.stat().st_mtime > STALE_S
        except OSError:
            continue
        if entry.is_dir() and entry.name.startswith(prefixes) and old:
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise work on one release across processes (pytest-xdist workers, parallel CI jobs)."""
    import filelock

    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path)):
        yield


# ----------------------------------------------------------------------------- the index


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    version: Version
    wheel: bool
    yanked: bool


def _fetch_json(url: str, timeout: float) -> dict:
    request = urllib.request.Request(url, headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


@cache
def index(kind: str) -> tuple[IndexFile, ...]:
    """Every file PyPI lists for `kind`, from the JSON simple API (PEP 691)."""
    _check_kind(kind)
    url = SIMPLE_URL.format(project=PROJECT[kind])
    try:
        data = _fetch_json(url, TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise ReleaseError(f"cannot read the PyPI index {url}: {exc}") from exc
    files = []
    for raw in data.get("files", []):
        parsed = _parse_filename(raw.get("filename", ""))
        if parsed is None:
            continue
        name, version, wheel = parsed
        if name != canonicalize_name(PROJECT[kind]):
            continue
        files.append(
            IndexFile(
                filename=raw["filename"],
                url=raw["url"],
                sha256=(raw.get("hashes") or {}).get("sha256"),
                version=version,
                wheel=wheel,
                yanked=bool(raw.get("yanked")),
            )
        )
    return tuple(files)


def _parse_filename(filename: str) -> tuple[str, Version, bool] | None:
    """(canonical project name, version, is a wheel) of a distribution file name, or None."""
    try:
        if filename.endswith(".whl"):
            name, version, _build, _tags = parse_wheel_filename(filename)
            return name, version, True
        if filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
            return name, version, False
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return None


def available(
    kind: str, spec: str | SpecifierSet | None = None, *, posts: bool = False
) -> list[str]:
    """The final releases of `kind` on PyPI inside `spec` (default: the full-run range), oldest
    first. Pre-releases and dev releases never count; post releases only with `posts`, since
    they carry the source of the release they follow and would double the downloads."""
    _check_kind(kind)
    spec = SpecifierSet(str(spec if spec is not None else FULL_RANGE[kind]))
    found: set[Version] = set()
    for file in index(kind):
        v = file.version
        if v.is_prerelease or v.is_devrelease or (v.is_postrelease and not posts):
            continue
        if spec.contains(v):
            found.add(v)
    return [str(v) for v in sorted(found)]


@lru_cache(maxsize=1)
def pypi_reachable(timeout: float = 5.0) -> bool:
    """Whether PyPI's simple API answers: one small HEAD request, remembered per process."""
    url = SIMPLE_URL.format(project=PROJECT["flashinfer"])
    request = urllib.request.Request(url, method="HEAD", headers={"Accept": SIMPLE_JSON})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return 200 <= response.status < 400
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- fetch


def cached(kind: str, version: str) -> Path | None:
    """The distribution file of this release already in the cache (a wheel before an sdist)."""
    _check_kind(kind)
    want_name = canonicalize_name(PROJECT[kind])
    want = Version(version)
    directory = dist_dir()
    if not directory.is_dir():
        return None
    hits = []
    for path in directory.iterdir():
        parsed = _parse_filename(path.name)
        if parsed and parsed[0] == want_name and parsed[1] == want and path.is_file():
            hits.append((not parsed[2], path.name, path))  # wheels first, then by name
    return min(hits)[2] if hits else None


def is_sdist_only(kind: str, version: str) -> bool:
    """Releases PyPI holds as an sdist and no wheel: FlashInfer before 0.5.0."""
    return kind == "flashinfer" and Version(version) < Version("0.5.0")


def pip_download_args(kind: str, version: str) -> list[str]:
    """The `pip download` command that fetches this release's wheel, whatever runs it."""
    args = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        f"{PROJECT[kind]}=={version}",
    ]
    if kind == "sglang" and Version(version) >= Version("0.5.11"):
        # cp310..cp313 manylinux_2_34 wheels only: name one so any interpreter can fetch it.
        args += [
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_34_x86_64",
            "--only-binary=:all:",
        ]
    elif not is_sdist_only(kind, version):
        # A py3-none-any wheel exists; never let pip fall back to building the sdist.
        args += ["--only-binary=:all:"]
    return args


def fetch(kind: str, version: str) -> Path:
    """The distribution file of `kind` `version` in `<cache>/dist/`, downloaded if missing."""
    _check_kind(kind)
    Version(version)  # a clear InvalidVersion before any download
    found = cached(kind, version)
    if found:
        return found
    dist = dist_dir()
    with _locked(dist / f".{kind}-{version}.lock"):
        found = cached(kind, version)  # another process may have fetched it while we waited
        if found:
            return found
        _sweep(dist, (".dl-",))
        with tempfile.TemporaryDirectory(prefix=f".dl-{kind}-{version}-", dir=dist) as tmp:
            staging = Path(tmp)
            if is_sdist_only(kind, version):
                file = _fetch_sdist(kind, version, staging)
            else:
                file = _pip_download(pip_download_args(kind, version), staging)
            final = dist / file.name
            # Same filesystem: the file appears whole or not at all.
            os.replace(file, final)
        return final


def _pip_download(args: list[str], staging: Path) -> Path:
    proc = subprocess.run(
        [*args, "--dest", str(staging)], capture_output=True, text=True, check=False
    )
    files = [p for p in staging.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise ReleaseError(
            f"`{' '.join(args[2:])}` failed (exit {proc.returncode}, {len(files)} files):\n"
            + "\n".join(tail)
        )
    return files[0]


def _fetch_sdist(kind: str, version: str, staging: Path) -> Path:
    try:
        return _download_from_index(kind, version, staging)
    except ReleaseError as direct:
        args = [*pip_download_args(kind, version), "--no-binary=:all:"]
        try:
            return _pip_download(args, staging)
        except ReleaseError as isolated:
            if not _have_build_requirements():
                raise ReleaseError(
                    f"{direct}\nthen {isolated}\n(with setuptools, packaging and apache-tvm-ffi "
                    "installed here, pip is retried with --no-build-isolation)"
                ) from None
            return _pip_download([*args, "--no-build-isolation"], staging)


def _have_build_requirements() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("setuptools", "packaging", "tvm_ffi"))


def _download_from_index(kind: str, version: str, staging: Path) -> Path:
    want = Version(version)
    sdists = [f for f in index(kind) if f.version == want and not f.wheel]
    if not sdists:
        raise ReleaseError(f"PyPI lists no sdist of {PROJECT[kind]} {version}")
    entry = sdists[0]
    if not entry.sha256:
        raise ReleaseError(f"PyPI publishes no sha256 for {entry.filename}")
    target = staging / entry.filename
    digest = hashlib.sha256()
    try:
        with (
            urllib.request.urlopen(entry.url, timeout=TIMEOUT_S) as response,
            target.open("wb") as out,
        ):
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        raise ReleaseError(f"cannot download {entry.url}: {exc}") from exc
    if digest.hexdigest() != entry.sha256:
        raise ReleaseError(f"{entry.filename}: sha256 {digest.hexdigest()} != index {entry.sha256}")
    return target


# ----------------------------------------------------------------------------- trees


def wanted_files(kind: str) -> tuple[str, ...]:
    """Every file a tree of `kind` holds, relative to the package's parent: the files any patch
    of the catalog may read, the known site files, the support files and the version files."""
    from sm120patch import catalog

    pkg = PACKAGE[kind]
    files = set(SITE_FILES[kind]) | set(SUPPORT_FILES[kind])
    files |= {f"{pkg}/__init__.py", f"{pkg}/version.py", f"{pkg}/_version.py"}
    for patch in catalog.load().patches.values():
        if patch.target == kind:
            files.update(patch.files)
    return tuple(sorted(files))


def tree(kind: str, version: str) -> Path:
    """`<cache>/trees/<kind>-<version>/`: the release's `wanted_files` and its dist-info METADATA,
    laid out like site-packages. Built once, atomically: a temporary directory renamed into
    place, so a concurrent or killed run never leaves a half tree behind. Rebuilt (again by a
    rename) when the catalog now reads a file the existing tree was not built with."""
    _check_kind(kind)
    wanted = wanted_files(kind)
    dest = trees_dir() / f"{kind}-{version}"
    if _tree_covers(dest, wanted):
        return dest
    source = fetch(kind, version)
    with _locked(trees_dir() / f".{kind}-{version}.lock"):
        if _tree_covers(dest, wanted):
            return dest
        _sweep(trees_dir(), (".tmp-", ".old-"))
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-{version}-", dir=trees_dir()))
        try:
            present = _unpack(kind, version, source, wanted, staging)
            record = {
                "schema": TREE_SCHEMA,
                "kind": kind,
                "version": version,
                "source": source.name,
                "wanted": list(wanted),
                "present": present,
            }
            (staging / TREE_RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")
            if dest.exists():
                # A stale tree: move it aside first, since a directory cannot be renamed over a
                # non-empty one; readers see the old or the new tree, never a mix.
                old = Path(tempfile.mkdtemp(prefix=f".old-{kind}-{version}-", dir=trees_dir()))
                os.replace(dest, old / "tree")
                os.replace(staging, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def tree_record(path: Path) -> dict:
    """What a tree was built from and with (`source`, `wanted`, `present`)."""
    return json.loads((path / TREE_RECORD).read_text(encoding="utf-8"))


def _tree_covers(dest: Path, wanted: Iterable[str]) -> bool:
    try:
        record = tree_record(dest)
    except (OSError, ValueError):
        return False
    return record.get("schema") == TREE_SCHEMA and set(wanted) <= set(record.get("wanted", []))


def _unpack(
    kind: str, version: str, source: Path, wanted: tuple[str, ...], dest: Path
) -> list[str]:
    if source.name.endswith(".whl"):
        members = _wheel_members(source)
    elif source.name.endswith(".tar.gz"):
        members = _sdist_members(source, kind)
    else:
        raise ReleaseError(f"{source.name}: not a wheel or a .tar.gz sdist")
    with members as (read, names, metadata_name):
        present = []
        for rel in wanted:
            if rel in names:
                _write(dest / rel, read(rel))
                present.append(rel)
        if f"{PACKAGE[kind]}/__init__.py" not in present:
            raise ReleaseError(f"{source.name}: no {PACKAGE[kind]}/__init__.py inside")
        metadata = read(metadata_name)
        info = f"{canonicalize_name(PROJECT[kind]).replace('-', '_')}-{version}.dist-info"
        _write(dest / info / "METADATA", metadata)
    return present


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)  # bytes as released: line endings and encoding untouched


# (read a member by its path, the member paths, the name of the METADATA member)
Members = tuple[Callable[[str], bytes], set[str], str]


@contextlib.contextmanager
def _wheel_members(source: Path) -> Iterator[Members]:
    with zipfile.ZipFile(source) as zf:
        names = set(zf.namelist())
        infos = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(infos) != 1:
            raise ReleaseError(f"{source.name}: expected one *.dist-info/METADATA, found {infos}")
        yield zf.read, names, infos[0]


@contextlib.contextmanager
def _sdist_members(source: Path, kind: str) -> Iterator[Members]:
    """An sdist's files relative to the directory that holds the package (its top directory,
    or a subdirectory such as `python/`), and its PKG-INFO as the METADATA."""
    with tarfile.open(source, "r:gz") as tf:
        members = {m.name: m for m in tf.getmembers() if m.isfile() or m.issym()}
        init = f"{PACKAGE[kind]}/__init__.py"
        roots = sorted(
            (n[: -len(init)] for n in members if n == init or n.endswith("/" + init)),
            key=lambda r: r.count("/"),
        )
        if not roots:
            raise ReleaseError(f"{source.name}: no {init} inside")
        root = roots[0]
        top = PurePosixPath(root).parts[0] if root else ""
        pkg_info = f"{top}/PKG-INFO" if top else "PKG-INFO"
        if pkg_info not in members:
            raise ReleaseError(f"{source.name}: no {pkg_info}")
        names = {n[len(root) :] for n in members if n.startswith(root)}
        names.add(pkg_info)  # `read` takes it by its archive name

        def read(rel: str) -> bytes:
            name = rel if rel == pkg_info else root + rel
            handle = tf.extractfile(members[name])  # follows symlinks inside the archive
            if handle is None:
                raise ReleaseError(f"{source.name}: {name} is not a regular file")
            with handle:
                return handle.read()

        yield read, names, pkg_info
