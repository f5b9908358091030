"""The distribution files of the release cache: `<cache>/dist/`, each with its sha256 recorded
next to it in `<file>.sha256` and checked on every use (`fetch`, `verify`). The cache's place,
its kinds and the index listing are `releases.py`'s.

How a release is fetched: the file the index lists (a pure-Python wheel, else the cp311
x86_64 manylinux one that SGLang 0.5.11 and later ship, else the sdist FlashInfer 0.2.8 to
0.4.1 ship), downloaded from its URL and checked against the sha256 the index publishes. Only
when that fails do we run `pip download --no-deps` (it knows credentials we do not); for an
sdist first with build isolation, then with `--no-build-isolation` when setuptools, packaging
and apache-tvm-ffi are importable here (FlashInfer 0.4.0 and 0.4.1 pin a build requirement gone
from PyPI, and building metadata takes a minute for 0.3.1 anyway).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from sm120patch import safeio
from sm120patch.maintain import pipconfig
from sm120patch.maintain.index import READ_ERRORS, IndexFile, open_url, parse_filename, redact
from sm120patch.maintain.releases import (
    PROJECT,
    SOURCES_ONLY,
    ReleaseError,
    _load_listing,
    check_kind,
    dist_dir,
    listing,
    locked,
    sweep,
    write_atomic,
)

DOWNLOAD_TIMEOUT_S = 60.0


DIGEST_SUFFIX = ".sha256"


def cached(kind: str, version: str) -> Path | None:
    """The distribution file of this release already in the cache (a wheel before an sdist),
    as it is: `fetch` is the way to a verified one."""
    check_kind(kind)
    want_name = canonicalize_name(PROJECT[kind])
    want = Version(version)
    directory = dist_dir()
    if not directory.is_dir():
        return None
    hits = []
    for path in directory.iterdir():
        parsed = parse_filename(path.name)
        if parsed and parsed[0] == want_name and parsed[1] == want and path.is_file():
            hits.append((not parsed[2], path.name, path))  # wheels first, then by name
    return min(hits)[2] if hits else None


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def recorded_digest(path: Path) -> str | None:
    """The sha256 recorded next to a cached distribution (`sha256sum -c` format)."""
    try:
        return _digest_path(path).read_text(encoding="utf-8").split()[0]
    except (OSError, IndexError):
        return None


def _record_digest(path: Path, digest: str) -> None:
    write_atomic(_digest_path(path), f"{digest}  {path.name}\n".encode())


def _listed_digest(kind: str, path: Path) -> str | None:
    saved = _load_listing(kind)
    for file in saved.files if saved else ():
        if file.filename == path.name and file.sha256:
            return file.sha256
    return None


def verify(kind: str, path: Path) -> str | None:
    """None when a cached distribution is the one recorded, else what is wrong with it. The
    sha256 is the one recorded when it was fetched, else the one the saved index listing
    publishes; a file with neither (fetched by an older sm120patch) is adopted, its sha256
    recorded, when it reads whole as an archive."""
    actual = sha256_file(path)
    expected = recorded_digest(path) or _listed_digest(kind, path)
    if expected is None:
        if not _reads_whole(path):
            return f"{path.name} does not read as a whole archive"
        with contextlib.suppress(OSError):
            _record_digest(path, actual)
        return None
    if actual != expected:
        return f"{path.name}: sha256 {actual} is not the recorded {expected}"
    if recorded_digest(path) is None:
        with contextlib.suppress(OSError):
            _record_digest(path, actual)
    return None


def _reads_whole(path: Path) -> bool:
    try:
        if path.name.endswith(".whl"):
            with zipfile.ZipFile(path) as zf:
                return zf.testzip() is None
        with tarfile.open(path, "r:*") as tf:
            tf.getmembers()  # reads to the end: a truncated archive raises
        return True
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError):
        return False


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_sdist_only(kind: str, version: str) -> bool:
    """Releases PyPI holds as an sdist and no wheel: FlashInfer before 0.5.0."""
    return kind == "flashinfer" and Version(version) < Version("0.5.0")


def pip_download_args(kind: str, version: str) -> list[str]:
    """The `pip download` command that fetches this release's wheel, whatever runs it: the
    fallback when the file cannot be downloaded from the URL the index lists."""
    args = [
        *safeio.python_command(sys.executable),
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
    """The distribution file of `kind` `version` in `<cache>/dist/`, verified against its
    recorded sha256 (`verify`); downloaded when missing, downloaded again when it does not
    match."""
    check_kind(kind)
    Version(version)  # a clear InvalidVersion before any download
    if kind in SOURCES_ONLY:
        raise ReleaseError(
            f"{PROJECT[kind]} wheels are not cached; its sources are "
            "(sm120patch.maintain.sources.tree)"
        )
    found = cached(kind, version)
    if found and verify(kind, found) is None:
        return found
    dist = dist_dir()
    with locked(dist / f".{kind}-{version}.lock"):
        # Another process may have fetched it while we waited; a bad file goes, under the lock.
        while (found := cached(kind, version)) is not None:
            if verify(kind, found) is None:
                return found
            found.unlink(missing_ok=True)
            _digest_path(found).unlink(missing_ok=True)
        sweep(dist, (".dl-",))
        with tempfile.TemporaryDirectory(prefix=f".dl-{kind}-{version}-", dir=dist) as tmp:
            file = _download(kind, version, Path(tmp))
            final = dist / file.name
            # The record first: a file in dist/ is never without the digest it must match.
            _record_digest(final, sha256_file(file))
            os.replace(file, final)  # same filesystem: the file appears whole or not at all
        return final


def _listed_files(kind: str, version: str) -> list[IndexFile]:
    """The files listed for this release: the saved listing when it has them (worker
    processes of `matrix` read it instead of the index), else the live one."""
    want = Version(version)
    saved = _load_listing(kind)
    files = [f for f in saved.files if f.version == want] if saved else []
    if not files:
        try:
            files = [f for f in listing(kind).files if f.version == want]
        except ReleaseError:
            return []
    return files


def choose(files: Iterable[IndexFile]) -> IndexFile | None:
    """The file of one release we unpack: a pure-Python wheel, else an x86_64 manylinux CPython
    wheel (cp311 first: the sources we read are the same in each), else a .tar.gz sdist."""

    def rank(file: IndexFile) -> int | None:
        if not file.wheel:
            return 3 if file.filename.endswith(".tar.gz") else None
        tags = parse_wheel_filename(file.filename)[3]
        if any(t.platform == "any" for t in tags):
            return 0
        linux = [t for t in tags if t.platform.startswith("manylinux") and "x86_64" in t.platform]
        if any(t.interpreter == "cp311" for t in linux):
            return 1
        return 2 if linux else None

    ranked = [(r, f.yanked, f.filename, f) for f in files if (r := rank(f)) is not None]
    return min(ranked)[3] if ranked else None


def _download(kind: str, version: str, staging: Path) -> Path:
    entry = choose(_listed_files(kind, version))
    problem = f"the index lists no file of {PROJECT[kind]} {version}"
    if entry is not None:
        try:
            return _download_url(entry, staging)
        except ReleaseError as exc:
            problem = str(exc)
    # pip does what a plain download cannot (keyring or netrc credentials, an index that hides
    # file URLs); an sdist through pip may need its build requirements.
    if (entry is not None and not entry.wheel) or (entry is None and is_sdist_only(kind, version)):
        file = _pip_sdist(kind, version, staging, problem)
    else:
        file = _pip_download(pip_download_args(kind, version), staging)
    if entry is not None and entry.filename == file.name and entry.sha256:
        if sha256_file(file) != entry.sha256:
            raise ReleaseError(f"{file.name}: sha256 differs from the index's {entry.sha256}")
    return file


def _download_url(entry: IndexFile, staging: Path) -> Path:
    target = staging / entry.filename
    digest = hashlib.sha256()
    try:
        with (
            open_url(
                entry.url, cert=pipconfig.pip_index().cert, timeout=DOWNLOAD_TIMEOUT_S
            ) as response,
            target.open("wb") as out,
        ):
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except READ_ERRORS as exc:
        target.unlink(missing_ok=True)
        raise ReleaseError(f"cannot download {redact(entry.url)}: {exc}") from exc
    if entry.sha256 and digest.hexdigest() != entry.sha256:
        target.unlink(missing_ok=True)
        raise ReleaseError(f"{entry.filename}: sha256 {digest.hexdigest()} != index {entry.sha256}")
    return target


def _pip_download(args: list[str], staging: Path) -> Path:
    proc = subprocess.run(
        [*args, "--dest", str(staging.absolute())],
        capture_output=True,
        text=True,
        check=False,
        cwd=safeio.CHILD_CWD,
        env=safeio.pip_env(),
    )
    files = [p for p in staging.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        shown = " ".join(args[args.index("-m") + 1 :])  # `pip download ...`
        raise ReleaseError(
            f"`{shown}` failed (exit {proc.returncode}, {len(files)} files):\n" + "\n".join(tail)
        )
    return files[0]


def _pip_sdist(kind: str, version: str, staging: Path, direct: str) -> Path:
    """An sdist through pip: first with build isolation, then without when the build
    requirements are importable here (FlashInfer 0.4.0's pinned one is gone from PyPI)."""
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
