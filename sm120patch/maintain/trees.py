"""Unpacked release trees in the release cache: only the files the patches read, from a cached
wheel or sdist, checked against a record of what was unpacked (a killed unpack is redone)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.utils import canonicalize_name

from sm120patch.maintain.dists import fetch, sha256_file
from sm120patch.maintain.releases import (
    PACKAGE,
    PROJECT,
    SUPPORT_FILES,
    ReleaseError,
    check_kind,
    locked,
    sweep,
    trees_dir,
)
from sm120patch.targets.files import atomic_write

TREE_RECORD = ".sm120patch-tree.json"


TREE_SCHEMA = 1


def site_files(kind: str) -> tuple[str, ...]:
    """The files that hold a site in some release, relative to the package's parent: the files
    the catalog's patches of `kind` read (`Patch.files`: the files their facts name)."""
    from sm120patch.plan import catalog

    patches = catalog.load().patches.values()
    return tuple(sorted({f for p in patches if p.target == kind for f in p.files}))


def wanted_files(kind: str) -> tuple[str, ...]:
    """Every file a tree of `kind` holds, relative to the package's parent: the site files,
    the support files and the version files."""
    pkg = PACKAGE[kind]
    files = set(site_files(kind)) | set(SUPPORT_FILES[kind])
    files |= {f"{pkg}/__init__.py", f"{pkg}/version.py", f"{pkg}/_version.py"}
    return tuple(sorted(files))


def tree(kind: str, version: str) -> Path:
    """`<cache>/trees/<kind>-<version>/`: the release's `wanted_files` and its dist-info METADATA,
    laid out like site-packages. Built once, atomically: a temporary directory renamed into
    place, so a concurrent or killed run never leaves a half tree behind. Rebuilt (again by a
    rename) when the catalog now reads a file the existing tree was not built with, and when a
    file of it no longer has the sha256 recorded when it was unpacked (an edited tree)."""
    check_kind(kind)
    wanted = wanted_files(kind)
    dest = trees_dir() / f"{kind}-{version}"
    if _tree_covers(dest, wanted):
        return dest
    source = fetch(kind, version)
    with locked(trees_dir() / f".{kind}-{version}.lock"):
        if _tree_covers(dest, wanted):
            return dest
        sweep(trees_dir(), (".tmp-", ".old-"))
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{kind}-{version}-", dir=trees_dir()))
        try:
            written = _unpack(kind, version, source, wanted, staging)
            present = [rel for rel in wanted if rel in written]
            record = {
                "schema": TREE_SCHEMA,
                "kind": kind,
                "version": version,
                "source": source.name,
                "wanted": list(wanted),
                "present": present,
                "source_sha256": sha256_file(source),
                "sha256": written,
            }
            atomic_write(
                staging / TREE_RECORD, json.dumps(record, indent=1).encode(), 0o644, durable=False
            )
            put_tree(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def put_tree(staging: Path, dest: Path) -> None:
    """Rename a built tree into place. A stale tree there is moved aside first, since a
    directory cannot be renamed over a non-empty one; readers see the old or the new tree,
    never a mix."""
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{dest.name}-", dir=dest.parent))
        os.replace(dest, old / "tree")
        os.replace(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, dest)


def tree_record(path: Path) -> dict[str, Any]:
    """What a tree was built from and with (`source`, `wanted`, `present`, `sha256`)."""
    return dict(json.loads((path / TREE_RECORD).read_text(encoding="utf-8")))


def tree_problem(dest: Path, wanted: Iterable[str] = ()) -> str | None:
    """None when the tree at `dest` holds `wanted` and every file it was built with still has
    its recorded sha256, else what is wrong."""
    try:
        record = tree_record(dest)
    except (OSError, ValueError):
        return "no readable tree record"
    if record.get("schema") != TREE_SCHEMA:
        return f"tree schema {record.get('schema')!r}, not {TREE_SCHEMA}"
    if not set(wanted) <= set(record.get("wanted", [])):
        return "built without a file the patches now read"
    digests = record.get("sha256")
    if not isinstance(digests, dict) or not digests:
        # Built by an sm120patch that recorded no digests: rebuilt once. The schema stays 1 so
        # such a version sharing this cache keeps accepting the rebuilt tree.
        return "no recorded sha256"
    for rel, digest in digests.items():
        try:
            if hashlib.sha256((dest / rel).read_bytes()).hexdigest() != digest:
                return f"{rel} was changed"
        except OSError:
            return f"{rel} is missing"
    return None


def _tree_covers(dest: Path, wanted: Iterable[str]) -> bool:
    return tree_problem(dest, wanted) is None


def _unpack(
    kind: str, version: str, source: Path, wanted: tuple[str, ...], dest: Path
) -> dict[str, str]:
    """Write the wanted files present in `source` and its METADATA under `dest`; the sha256 of
    each file written, by its path relative to `dest`."""
    members = _members(source, kind)
    written: dict[str, str] = {}

    def write(rel: str, data: bytes) -> None:
        # Bytes as released (line endings and encoding untouched), readable as a package is.
        atomic_write(dest / rel, data, 0o644, durable=False)
        written[rel] = hashlib.sha256(data).hexdigest()

    with members as (read, names, metadata_name):
        for rel in wanted:
            if rel in names:
                write(rel, read(rel))
        if f"{PACKAGE[kind]}/__init__.py" not in written:
            raise ReleaseError(f"{source.name}: no {PACKAGE[kind]}/__init__.py inside")
        info = f"{canonicalize_name(PROJECT[kind]).replace('-', '_')}-{version}.dist-info"
        write(f"{info}/METADATA", read(metadata_name))
    return written


def package_files(kind: str, version: str) -> Iterator[tuple[str, bytes]]:
    """(path relative to the package's parent, bytes) of every `.py` file of the release's
    package, read from its distribution file in the cache (fetched when missing) without
    unpacking it: what `sm120patch scan` reads of a whole release (an SGLang wheel holds
    4,700 of them, 68 MB; a tree of them per release would fill the cache)."""
    check_kind(kind)
    prefix = PACKAGE[kind] + "/"
    with _members(fetch(kind, version), kind) as (read, names, _metadata):
        for rel in sorted(names):
            if rel.startswith(prefix) and rel.endswith(".py"):
                yield rel, read(rel)


# (read a member by its path, the member paths, the name of the METADATA member)
Members = tuple[Callable[[str], bytes], set[str], str]


def _members(source: Path, kind: str) -> contextlib.AbstractContextManager[Members]:
    """The members of a wheel or an sdist, by their path relative to the package's parent."""
    if source.name.endswith(".whl"):
        return _wheel_members(source)
    if source.name.endswith(".tar.gz"):
        return _sdist_members(source, kind)
    raise ReleaseError(f"{source.name}: not a wheel or a .tar.gz sdist")


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
