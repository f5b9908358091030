"""Releases kept as their Python sources, never as their wheel: vLLM's wheels are 240 to 340 MB
(its compiled kernels), of which sm120patch reads only the `.py` files and the dist-info.

`tree(kind, version)` is `<cache>/trees/<kind>-<version>/`, laid out like site-packages: every
`.py` member of the release's wheel and its `*.dist-info/` files, with the tree record the
other trees carry (`trees.TREE_RECORD`: what was kept and each file's sha256), so that
`trees.tree` and `trees.tree_problem` take it as they take any tree.

How the members are read, in order:
1. a wheel the index lists at a local path (a `file:` URL, find-links): opened in place;
2. a wheel the index lists over HTTP(S), when the server answers range requests (PyPI's file
   host does): the zip's central directory at its end, then only the byte spans of the kept
   members, a few requests in all (about 15 MB of a 240 MB wheel);
3. else the whole wheel, by URL or by `pip download` into a temporary directory, its sha256
   checked against the index's, the members taken, and the wheel deleted.

What is checked. The index's sha256 is of the whole file, so it cannot be checked on a ranged
read (2). What is: each member's CRC32, against the zip's central directory (zipfile checks
it on reading a member to its end), and every kept file's sha256 against the wheel's own
RECORD (itself a kept member); a file the RECORD does not list, or lists with another digest,
refuses the release. With a whole wheel (1, 3) the same, and the index's sha256 when it
publishes one. A ranged read is consistent with itself, not proven the index's release: a
mirror serving another wheel under the genuine sha256 goes unnoticed. The tree record says
which (`index_sha256`: whether the index's digest was checked), and so does `matrix`
(`unchecked`).

What is kept is capped before a byte is inflated: a member whose central directory says more
than `MEMBER_LIMIT` bytes, or members over `TOTAL_LIMIT` in all, refuse the release (zipfile
never inflates past the size the directory states).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import json
import os
import shutil
import ssl
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from sm120patch.maintain import pipconfig
from sm120patch.maintain.dists import (
    DOWNLOAD_TIMEOUT_S,
    _listed_files,
    _pip_download,
    choose,
    pip_download_args,
    sha256_file,
)
from sm120patch.maintain.index import IndexFile, redact
from sm120patch.maintain.releases import (
    PACKAGE,
    SOURCES_ONLY,
    ReleaseError,
    check_kind,
    locked,
    sweep,
    trees_dir,
)
from sm120patch.maintain.trees import TREE_RECORD, TREE_SCHEMA, put_tree, tree_problem
from sm120patch.targets.files import atomic_write

# The most one kept member (a .py file, a dist-info file) and all of them may inflate to:
# vLLM's largest source file is under 1 MB and all its .py files about 40 MB.
MEMBER_LIMIT = 32 << 20
TOTAL_LIMIT = 512 << 20
# How each way of reading a wheel is recorded, and whether the index's sha256 was checked.
RANGED = "central directory and kept members by HTTP range requests"


# Spans of kept members closer than this are fetched as one request: fewer round trips for a
# few bytes of .so or data between them.
GAP = 1 << 20


def tree(kind: str, version: str) -> Path:
    """The release's sources in the cache (module docstring), fetched and checked when they are
    not there whole. Built in a temporary directory renamed into place, under the release's
    lock: a concurrent or killed run never leaves half a tree."""
    check_kind(kind)
    if kind not in SOURCES_ONLY:
        raise ValueError(f"{kind} releases are cached as their distribution (maintain.trees)")
    dest = trees_dir() / f"{kind}-{version}"
    if tree_problem(dest) is None:
        return dest
    with locked(trees_dir() / f".{kind}-{version}.lock"):
        if tree_problem(dest) is None:
            return dest
        sweep(trees_dir(), (".tmp-", ".old-"))
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-{version}-", dir=trees_dir()))
        try:
            _keep_sources(kind, version, staging)
            put_tree(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def package_files(kind: str, version: str) -> Iterator[tuple[str, bytes]]:
    """(path relative to the package's parent, bytes) of every `.py` file of the release's
    package, from its kept sources (`tree`): what `scan` reads of a whole release."""
    root = tree(kind, version)
    package = root / PACKAGE[kind]
    for path in sorted(package.rglob("*.py")):
        yield path.relative_to(root).as_posix(), path.read_bytes()


def kept(name: str) -> bool:
    """Whether a wheel member is kept: a `.py` file, or a file of the top dist-info."""
    parts = PurePosixPath(name).parts
    if not parts or name.endswith("/"):
        return False
    return name.endswith(".py") or (len(parts) == 2 and parts[0].endswith(".dist-info"))


def _keep_sources(kind: str, version: str, staging: Path) -> None:
    """Write the kept members and the tree record (with how the wheel was read) into
    `staging`."""
    entry = choose(f for f in _listed_files(kind, version) if f.wheel)
    if entry is None:
        raise ReleaseError(f"the index lists no wheel of {kind} {version}")
    if entry.url.startswith("file:"):
        from urllib.request import url2pathname

        local = url2pathname(entry.url.removeprefix("file:"))
        if entry.sha256 and sha256_file(Path(local)) != entry.sha256:
            raise ReleaseError(f"{entry.filename}: sha256 differs from the index's")
        with zipfile.ZipFile(local) as zf:
            _extract(zf, entry.filename, staging)
        how, checked = "read in place", bool(entry.sha256)
    else:
        try:
            with _ranged(entry) as zf:
                _extract(zf, entry.filename, staging)
            how, checked = RANGED, False
        except _NoRanges:
            _whole(kind, version, entry, staging)
            how, checked = "whole wheel downloaded, sha256 checked, deleted", bool(entry.sha256)
    _write_record(staging, kind, version, entry.filename, how, checked)


def unchecked(kind: str, version: str) -> str | None:
    """Why the kept sources of this release were not checked against the index's sha256 of
    the whole wheel (None when they were): what `matrix` says beside the release."""
    from sm120patch.maintain.trees import tree_record

    try:
        record = tree_record(trees_dir() / f"{kind}-{version}")
    except (OSError, ValueError):
        return None
    if record.get("index_sha256") is True:
        return None
    if record.get("read") == RANGED:
        return (
            "read by HTTP range requests: each member's CRC32 and the wheel's own RECORD "
            "checked, not the index's sha256 of the whole wheel"
        )
    return "the index lists no sha256 for its wheel (or an older sm120patch kept it)"


def _whole(kind: str, version: str, entry: IndexFile, staging: Path) -> None:
    """The fallback: the whole wheel into a temporary directory (by URL, else pip), checked
    against the index's sha256, its kept members taken, the wheel deleted with the directory."""
    from sm120patch.maintain.dists import _download_url

    with tempfile.TemporaryDirectory(prefix=f".dl-{kind}-{version}-", dir=trees_dir()) as tmp:
        try:
            wheel = _download_url(entry, Path(tmp))  # checks the index's sha256
        except ReleaseError:
            wheel = _pip_download(pip_download_args(kind, version), Path(tmp))
            if entry.sha256 and sha256_file(wheel) != entry.sha256:
                raise ReleaseError(f"{wheel.name}: sha256 differs from the index's") from None
        with zipfile.ZipFile(wheel) as zf:
            _extract(zf, wheel.name, staging)


def _extract(zf: zipfile.ZipFile, wheel: str, staging: Path) -> None:
    """Write the kept members of `zf` under `staging`, each read to its end (CRC32 checked) and
    held to the RECORD's sha256."""
    infos = [i for i in zf.infolist() if kept(i.filename)]
    for info in infos:
        if info.file_size > MEMBER_LIMIT:
            raise ReleaseError(
                f"{wheel}: member {info.filename!r} inflates to {info.file_size} bytes, more "
                f"than sm120patch keeps of one file ({MEMBER_LIMIT})"
            )
    total = sum(i.file_size for i in infos)
    if total > TOTAL_LIMIT:
        raise ReleaseError(
            f"{wheel}: its kept members inflate to {total} bytes, more than "
            f"sm120patch keeps of a release ({TOTAL_LIMIT})"
        )
    names = [i.filename for i in infos]
    records = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ReleaseError(f"{wheel}: expected one *.dist-info/RECORD, found {records}")
    digests = _record_digests(zf.read(records[0]))
    for name in names:
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise ReleaseError(f"{wheel}: member {name!r} leaves the tree")
        try:
            data = zf.read(name)
        except zipfile.BadZipFile as exc:  # a CRC32 that does not match, among others
            raise ReleaseError(f"{wheel}: {name}: {exc}") from None
        if name != records[0]:
            digest = hashlib.sha256(data).digest()
            if digests.get(name) != digest:
                said = "is not in its RECORD" if name not in digests else "differs from RECORD"
                raise ReleaseError(f"{wheel}: {name}'s sha256 {said}")
        atomic_write(staging / name, data, 0o644, durable=False)


def _record_digests(data: bytes) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for row in csv.reader(data.decode("utf-8").splitlines()):
        if len(row) >= 2 and row[1].startswith("sha256="):
            raw = row[1].removeprefix("sha256=")
            with contextlib.suppress(ValueError):
                out[row[0]] = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
    return out


def _write_record(
    staging: Path, kind: str, version: str, wheel: str, how: str, checked: bool
) -> None:
    written = {
        p.relative_to(staging).as_posix(): sha256_file(p)
        for p in sorted(staging.rglob("*"))
        if p.is_file()
    }
    package = PACKAGE[kind]
    record: dict[str, Any] = {
        "schema": TREE_SCHEMA,
        "kind": kind,
        "version": version,
        "source": wheel,
        "read": how,
        "index_sha256": checked,  # the index's sha256 of the whole wheel was checked
        # Every .py of the release is here; the version files count as wanted even where the
        # release has none, so that `trees.tree` takes this tree as covering them.
        "wanted": sorted({*written, f"{package}/version.py", f"{package}/_version.py"}),
        "present": sorted(written),
        "sha256": written,
    }
    atomic_write(staging / TREE_RECORD, json.dumps(record, indent=1).encode(), 0o644, durable=False)


# ---- a zip read by HTTP range requests ------------------------------------------------------
class _NoRanges(Exception):
    """The server sends the whole file for a range request: the fallback downloads it."""


class _Gap(Exception):
    """A read reached bytes not fetched yet (`start`, `end`)."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.start, self.end = start, end


class _Sparse(io.RawIOBase):
    """A remote file as spans fetched on demand: zipfile seeks and reads it like a local one;
    a read past what is fetched raises `_Gap` for the caller to fetch (`_ranged`)."""

    def __init__(self, size: int) -> None:
        self.size, self.pos = size, 0
        self.spans: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        for start, data in self.spans:
            if start <= self.pos and self.pos + want <= start + len(data):
                at = self.pos - start
                buffer[:want] = data[at : at + want]
                self.pos += want
                return want
        raise _Gap(self.pos, self.pos + want)


@contextlib.contextmanager
def _ranged(entry: IndexFile) -> Iterator[zipfile.ZipFile]:
    """The wheel at `entry.url` as a ZipFile that has fetched its central directory and the
    spans of its kept members; `_NoRanges` when the server does not answer ranges."""
    import httpx

    cert = pipconfig.pip_index().cert
    # pip's `cert` (a CA bundle) as an SSL context: httpx deprecates a path for `verify`.
    verify: Any = True
    if cert and os.path.isdir(cert):
        verify = ssl.create_default_context(capath=cert)
    elif cert and os.path.exists(cert):
        verify = ssl.create_default_context(cafile=cert)
    with httpx.Client(timeout=DOWNLOAD_TIMEOUT_S, verify=verify, follow_redirects=True) as client:

        def get(start: int, end: int) -> tuple[bytes, int]:
            """Bytes [start, end) and the file's size; end < 0 asks for the last -end bytes."""
            spec = f"bytes={end}" if end < 0 else f"bytes={start}-{end - 1}"
            try:
                response = client.get(entry.url, headers={"Range": spec})
            except httpx.HTTPError as exc:
                raise ReleaseError(f"cannot read {redact(entry.url)}: {exc}") from exc
            if response.status_code != 206:
                response.close()
                raise _NoRanges
            total = response.headers.get("content-range", "").rpartition("/")[2]
            if not total.isdigit():
                raise _NoRanges
            return response.content, int(total)

        tail, size = get(0, -(1 << 20))
        sparse = _Sparse(size)
        sparse.spans.append((size - len(tail), tail))
        zf = None
        for _ in range(8):  # the central directory may start before the tail fetched
            try:
                zf = zipfile.ZipFile(sparse)
                break
            except _Gap as gap:
                sparse.spans.append((gap.start, get(gap.start, min(size, gap.end + GAP))[0]))
        if zf is None:
            raise ReleaseError(f"{entry.filename}: cannot read its central directory")
        for start, end in _member_spans(zf, size):
            sparse.spans.append((start, get(start, end)[0]))
        with zf:
            yield zf


def _member_spans(zf: zipfile.ZipFile, size: int) -> list[tuple[int, int]]:
    """The byte spans of the kept members (each from its local header to the next member's),
    close ones merged (`GAP`)."""
    infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
    ends = [i.header_offset for i in infos[1:]] + [zf.start_dir if zf.start_dir else size]
    spans: list[tuple[int, int]] = []
    for info, end in zip(infos, ends, strict=True):
        if not kept(info.filename):
            continue
        if spans and info.header_offset - spans[-1][1] <= GAP:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((info.header_offset, end))
    return spans
