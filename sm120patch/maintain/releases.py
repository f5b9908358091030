"""The cache of real SGLang and FlashInfer releases that tests/real, benchmarks/ and `matrix`
run against: maintainer tooling, never imported by the runtime commands.

A release is downloaded once into `<cache>/dist/` (its sha256 recorded next to it in
`<file>.sha256`) and the few files the patches read are unpacked into
`<cache>/trees/<kind>-<version>/`, laid out like a site-packages directory (package files plus
a `<dist>-<version>.dist-info/METADATA`), so `targets.finding.find(kind, tree)` sees an installed
target and reads its version from the dist-info. Every use checks a file's sha256 against its
record and fetches or rebuilds what does not match.

The cache lives outside any repository: `$SM120PATCH_CACHE`, else the user cache directory.
Nothing here prints; failures raise `ReleaseError` with what went wrong. The distribution
files are fetched and verified by `dists.py`.

Where releases come from: the index pages and find-links pip is configured with (`pip config`,
PIP_INDEX_URL, PIP_EXTRA_INDEX_URL; pipconfig.py, index.py). The listing is saved in
`<cache>/index/` with its time; when an index cannot be read the saved listing is used and
`Listing.stale` says why, so a warm cache works offline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from sm120patch.errors import Sm120Error
from sm120patch.maintain import pipconfig
from sm120patch.maintain.cacheowner import own_cache
from sm120patch.maintain.index import (
    READ_ERRORS,
    IndexFile,
    make_file,
    read_location,
    read_project,
    redact,
)
from sm120patch.patchkit.model import TARGETS
from sm120patch.targets.files import atomic_write

# The kinds whose cache keeps only the Python sources, never the distribution (a vLLM wheel is
# 240 to 340 MB): maintain/sources.py. KINDS, the kinds kept as distributions, are the ones the
# real tier sweeps and `matrix` reads.
SOURCES_ONLY = ("vllm",)
KINDS = tuple(k for k in TARGETS if k not in SOURCES_ONLY)


# PyPI project of each target kind, and the import package inside it.
PROJECT = {"sglang": "sglang", "flashinfer": "flashinfer-python", "vllm": "vllm"}


PACKAGE = {"sglang": "sglang", "flashinfer": "flashinfer", "vllm": "vllm"}


LISTING_SCHEMA = 1


# The releases tests/real runs by default: at least one in every range of releases a fact
# gives a shape of, wherever a profile pins it (tests/real/test_facts.py holds the two to each
# other; the facts are the patches' own, docs/compatibility.md shows them).
DEFAULT_RELEASES: dict[str, tuple[str, ...]] = {
    "sglang": (
        "0.5.4",
        "0.5.4.post3",
        "0.5.6",
        "0.5.7",
        "0.5.8",
        "0.5.9",
        "0.5.11",
        "0.5.13",
        "0.5.14",
        "0.5.16",
        "0.5.18",
        "0.5.19",
        "0.5.21",
        "0.5.22",
        "0.5.23",
    ),
    "flashinfer": ("0.3.1", "0.6.1", "0.6.15", "0.6.16", "0.6.17"),
    "vllm": ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),  # the five newest on the index
}


def full_range(kind: str) -> str:
    """The span of the opt-in full run (SM120PATCH_FULL_RELEASES=1) and of `matrix` by default,
    from the facts: from the lowest release a fact of `kind` starts at to the highest one a
    fact or a profile's pin stops before (exclusive, so that its post releases are inside).
    Every release inside it counts, and the latest post release of each (`select`)."""
    from packaging.specifiers import SpecifierSet

    from sm120patch.plan import catalog

    cat = catalog.load()
    facts = [SpecifierSet(f.releases) for p in cat.patches.values() if p.target == kind
             for f in p.facts]
    pins = [p.pins[kind] for p in cat.profiles.values() if kind in p.pins]
    lows = [Version(s.version) for spec in facts for s in spec if s.operator in (">=", "==")]
    highs = [Version(s.version) for spec in [*facts, *pins] for s in spec if s.operator == "<"]
    if not lows or not highs:
        raise ReleaseError(f"no fact of the catalog bounds the {kind} releases")
    return f">={min(lows)},<{max(highs)}"


# Files that say what a patched site may rely on: sglang.srt.utils defines the
# `is_sm120_supported` the SM120 flag imports (a module up to 0.4.x, a package after);
# environ.py and parallel_state.py say where upstream's PCIe-IPC allreduce exists (0.5.21 on)
# and that the custom allreduce is tried before it (pcie-allreduce's refusal). The fp4-gemm
# and attention tiers read what their helpers rely on: FlashInfer's mm_fp4 backends and
# CUDA-version probe, SGLang's attention hook (its SM120 refusals), environ and hybrid_arch.
SUPPORT_FILES: dict[str, tuple[str, ...]] = {
    "sglang": (
        "sglang/srt/utils.py",
        "sglang/srt/utils/__init__.py",
        "sglang/srt/utils/common.py",
        "sglang/srt/environ.py",
        "sglang/srt/distributed/parallel_state.py",
        "sglang/srt/arg_groups/attention_hook.py",
        "sglang/srt/configs/hybrid_arch.py",
        "sglang/srt/layers/quantization/modelopt_quant.py",
    ),
    "flashinfer": ("flashinfer/gemm/gemm_base.py", "flashinfer/jit/cpp_ext.py"),
    "vllm": (),  # its cache keeps every .py (maintain/sources.py)
}


class ReleaseError(Sm120Error):
    """A release could not be listed, fetched or unpacked (exit 1: nothing was changed)."""

    exit_code = 1


def _stderr(text: str) -> None:
    print(f"sm120patch: warning: {text}", file=sys.stderr)


# How the one warning of an ignored cache reaches the user (the caller may point it elsewhere).
warn: Callable[[str], None] = _stderr
_judged: dict[str, Path] = {}


def cache_dir() -> Path:
    """`$SM120PATCH_CACHE`, else the per-user cache directory of sm120patch, when it is the
    effective user's own: it and its `dist/`, `trees/` and `index/` owned by that user and
    writable by no one else (as is every directory above it, or root's). Otherwise it is
    ignored with one warning (a user's cache, when root runs with their
    HOME, or a shared one could hold a planted tree or a lock link): this process then
    fetches into a private directory of its own."""
    env = os.environ.get("SM120PATCH_CACHE")
    if env:
        base = Path(env).expanduser().absolute()
    else:
        import platformdirs

        base = Path(platformdirs.user_cache_dir("sm120patch"))
    key = str(base)
    if key not in _judged:
        _judged[key] = own_cache(base, warn)
    return _judged[key]


def dist_dir() -> Path:
    return cache_dir() / "dist"


def trees_dir() -> Path:
    return cache_dir() / "trees"


def check_kind(kind: str) -> None:
    if kind not in TARGETS:
        raise ValueError(f"unknown target kind {kind!r}; expected one of {', '.join(TARGETS)}")


STALE_S = 3600.0


def sweep(directory: Path, prefixes: tuple[str, ...]) -> None:
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
def locked(path: Path) -> Iterator[None]:
    """Serialise work on one release across processes (pytest-xdist workers, parallel CI jobs):
    an flock on `path`, opened without following a link at its name and never truncated
    (filelock before 3.20.1 followed one, so a planted link truncated and chmod'ed its
    target); anything but a regular file there is an error."""
    import fcntl
    import stat

    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ReleaseError(
            f"cannot open the lock {path} ({exc.strerror})",
            f"move {path} aside, then run the command again",
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ReleaseError(
                f"the lock {path} is not a regular file",
                f"move {path} aside, then run the command again",
            )
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Listing:
    """What the configured indexes list for one kind, and where and when it was read."""

    kind: str
    files: tuple[IndexFile, ...]
    sources: tuple[str, ...]
    fetched_at: float  # seconds since the epoch
    stale: str | None = None  # why the live indexes were not used: this is a cached listing
    from_dist: bool = False  # no saved listing: the distributions in the cache, listed

    def describe(self) -> str:
        if self.from_dist:
            return f"{PROJECT[self.kind]} as cached in {dist_dir()}"
        return f"{PROJECT[self.kind]} as listed {self.when()}"

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.fetched_at))


def index_dir() -> Path:
    return cache_dir() / "index"


def _listing_path(kind: str) -> Path:
    return index_dir() / f"{canonicalize_name(PROJECT[kind])}.json"


def _save_listing(listing: Listing) -> None:
    doc = {
        "schema": LISTING_SCHEMA,
        "project": PROJECT[listing.kind],
        "fetched_at": listing.fetched_at,
        "sources": list(listing.sources),
        "files": [
            {"filename": f.filename, "url": redact(f.url), "sha256": f.sha256, "yanked": f.yanked}
            for f in listing.files
        ],
    }
    write_atomic(_listing_path(listing.kind), json.dumps(doc, indent=1).encode())


def _load_listing(kind: str) -> Listing | None:
    """The listing the last successful read of the indexes saved, or None."""
    try:
        doc = json.loads(_listing_path(kind).read_text(encoding="utf-8"))
        if doc.get("schema") != LISTING_SCHEMA:
            return None
        found = (
            make_file(PROJECT[kind], f["filename"], f["url"], f["sha256"], bool(f["yanked"]))
            for f in doc["files"]
        )
        return Listing(
            kind, tuple(f for f in found if f), tuple(doc["sources"]), float(doc["fetched_at"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _listing_from_dist(kind: str) -> Listing | None:
    """The distributions already in the cache, as a listing: offline without a saved one."""
    try:
        paths = [p for p in dist_dir().iterdir() if p.is_file()]
        newest = max((p.stat().st_mtime for p in paths), default=0.0)
    except OSError:
        return None
    found = (make_file(PROJECT[kind], p.name, p.as_uri(), None, False) for p in paths)
    files = tuple(f for f in found if f)
    if not files:
        return None
    return Listing(kind, files, (str(dist_dir()),), newest, from_dist=True)


@cache
def listing(kind: str) -> Listing:
    """Every file pip's configured indexes and find-links list for `kind`, read once per
    process and saved with its time. When a location cannot be read, the saved listing (else
    the cached distributions) is returned with `stale` saying why; with nothing saved either,
    a ReleaseError."""
    check_kind(kind)
    config = pipconfig.pip_index()
    if not config.sources:
        raise ReleaseError(
            "pip is configured with no index and no find-links",
            "set PIP_INDEX_URL or `pip config set global.index-url URL`",
        )
    files, problems = read_project(PROJECT[kind], config)
    sources = tuple(redact(s) for s in config.sources)
    if not problems:
        fresh = Listing(kind, tuple(files), sources, time.time())
        with contextlib.suppress(OSError):  # a read-only cache still lists
            _save_listing(fresh)
        return fresh
    why = "; ".join(problems)
    saved = _load_listing(kind) or _listing_from_dist(kind)
    if saved is not None:
        return dataclasses.replace(saved, stale=why)
    if files:  # some locations answered: what they list, said to be partial
        return Listing(kind, tuple(files), sources, time.time(), stale=why)
    raise ReleaseError(
        f"{why}; no listing of {PROJECT[kind]} is cached in {index_dir()}",
        "check the network and pip's index (`python -m pip config list`); "
        "a run with the index reachable caches the listing for offline runs",
    )


def index_sources() -> str:
    """Where releases are listed from, for messages."""
    return ", ".join(redact(s) for s in pipconfig.pip_index().sources) or "(no index)"


@lru_cache(maxsize=1)
def index_reachable() -> bool:
    """Whether the first location pip is configured with answers: one read, once per process."""
    config = pipconfig.pip_index()
    if not config.sources:
        return False
    try:
        read_location(
            PROJECT["flashinfer"],
            config.sources[0],
            index=bool(config.index_urls),
            cert=config.cert,
        )
    except READ_ERRORS:
        return False
    return True


# The name this had when PyPI was the only index; kept for code written against it.
def pypi_reachable() -> bool:
    return index_reachable()


def select(
    files: Iterable[IndexFile], spec: str | SpecifierSet, *, posts: bool | None = None
) -> list[str]:
    """The versions of `files` matching `spec`, oldest first: every release and, per release,
    its latest post release (the hotfix a user would install); `posts=True` every post release,
    `posts=False` none. Pre- and dev releases only when `spec` names one (PEP 440); a release
    whose every file is yanked only when pinned by `==`."""
    spec = SpecifierSet(str(spec))
    pinned = {
        Version(s.version) for s in spec if s.operator == "==" and not s.version.endswith(".*")
    }
    live: dict[Version, bool] = {}
    for file in files:
        live[file.version] = live.get(file.version, False) or not file.yanked
    # Explicit: packaging's default for `contains` has changed between its releases.
    pre = any(_names_prerelease(s.version) for s in spec)
    matched = [
        v for v, ok in live.items() if (ok or v in pinned) and spec.contains(v, prereleases=pre)
    ]
    chosen = {v for v in matched if posts or not v.is_postrelease}
    if posts is not None:
        return [str(v) for v in sorted(chosen)]
    latest: dict[object, Version] = {}  # keyed by the release without its post part
    for v in matched:
        if v.is_postrelease:
            key = (v.epoch, v.release, v.pre, v.dev)
            latest[key] = max(latest.get(key, v), v)
    chosen |= set(latest.values())
    return [str(v) for v in sorted(chosen)]


def _names_prerelease(version: str) -> bool:
    try:
        return Version(version.removesuffix(".*")).is_prerelease
    except InvalidVersion:
        return False


def available(
    kind: str, spec: str | SpecifierSet | None = None, *, posts: bool | None = None
) -> list[str]:
    """`select` over what the indexes list for `kind` (default: the tracked range)."""
    check_kind(kind)
    return select(listing(kind).files, spec if spec is not None else full_range(kind), posts=posts)


def write_atomic(path: Path, data: bytes) -> None:
    """A file of the cache (a listing, a digest, matrix's scans), by the files module's atomic
    replace; no fsync, since a cache is rebuilt."""
    atomic_write(path, data, durable=False)
