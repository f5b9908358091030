"""Scan one target (a tree on disk, or a release's files as bytes) and say what each gate is.

Nothing here imports the target: its files are read as bytes, the arch words found in the
text (filescan.py), the patches of every profile run on the texts they pick (classify.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch.scan import classify as c
from sm120patch.scan import filescan

if TYPE_CHECKING:
    from sm120patch.targets.resolved import Given

# Directories (and files: test_*, bench_*, benchmark_*) of a package that hold no code a server
# runs: tests, benchmarks, and the kernel sources and generated artifacts FlashInfer ships as
# data (`flashinfer/data/csrc/...`, `fused_moe/backends/cudnn_frost/artifacts/...`: 26 MB of
# per-arch kernel source in 0.7.4).
SKIPPED_DIRS = frozenset({"test", "tests", "testing", "benchmarks", "data", "artifacts"})


def skipped(rel: str) -> bool:
    """Whether a file (relative to the package's parent) is left out of a scan."""
    parts = rel.split("/")
    name = parts[-1]
    return (
        not name.endswith(".py")
        or name.startswith(("test_", "bench_", "benchmark_"))
        or name == "conftest.py"
        or any(p in SKIPPED_DIRS for p in parts[1:-1])
    )


@dataclass
class TargetScan:
    kind: str
    version: str
    root: str
    layout: str
    gates: list[c.Classified] = field(default_factory=list)
    outcomes: list[c.SiteOutcome] = field(default_factory=list)
    files_read: int = 0
    files_parsed: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (file, why not read)
    skipped: list[tuple[str, int, int]] = field(default_factory=list)  # (file, line, bytes)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(c.CLASSES, 0)
        for x in self.gates:
            out[x.cls] += 1
        return out

    def of(self, cls: str) -> list[c.Classified]:
        return [x for x in self.gates if x.cls == cls]

    def already_applied(self) -> list[c.SiteOutcome]:
        """Patches whose change this tree already carries (one line per patch)."""
        seen: dict[str, c.SiteOutcome] = {}
        for o in self.outcomes:
            if o.outcome == "already-applied":
                seen.setdefault(o.patch, o)
        return list(seen.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": self.version,
            "root": self.root,
            "layout": self.layout,
            "counts": self.counts(),
            "gates": [x.to_dict() for x in self.gates],
            "already_applied": [
                {"profile": o.profile, "patch": o.patch, "file": o.file, "site": o.site}
                for o in self.already_applied()
            ],
            "files_read": self.files_read,
            "files_parsed": self.files_parsed,
            "not_read": [{"file": f, "problem": p} for f, p in self.problems]
            + [
                {"file": f, "line": n, "problem": f"a {size} byte statement (generated code)"}
                for f, n, size in self.skipped
            ],
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Report:
    targets: list[TargetScan]
    # The candidates of an earlier scan (`--known FILE`, a `scan --json`): identities
    # (`classify.identities`); None when none was given.
    known: set[tuple[str, ...]] | None = None

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(c.CLASSES, 0)
        for t in self.targets:
            for cls, n in t.counts().items():
                out[cls] += n
        return out

    def is_known(self, x: c.Classified) -> bool:
        return self.known is not None and bool(c.identities(x.gate.file, x.gate.key) & self.known)

    def new_candidates(self) -> list[c.Classified]:
        """The candidates the known ones do not hold (all of them, with none known)."""
        return [x for t in self.targets for x in t.of(c.CANDIDATE) if not self.is_known(x)]

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "targets": [t.to_dict() for t in self.targets],
            "counts": self.counts(),
        }
        if self.known is not None:
            doc["new_candidates"] = len(self.new_candidates())
            for t, t_doc in zip(self.targets, doc["targets"], strict=True):
                for x, g_doc in zip(t.gates, t_doc["gates"], strict=True):
                    if x.cls == c.CANDIDATE:
                        g_doc["known"] = self.is_known(x)
        return doc


def known_candidates(doc: Any) -> set[tuple[str, ...]]:
    """The identities of the candidates in a `scan --json` document; ValueError when it is
    not one."""
    try:
        gates = [g for t in doc["targets"] for g in t["gates"]]
        return {
            ident
            for g in gates
            if g["class"] == c.CANDIDATE
            for ident in c.identities(g["file"], g["key"])
        }
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"not the JSON of `sm120patch scan --json` ({exc!r})") from None


def scan_files(
    kind: str,
    version: str,
    files: Iterable[tuple[str, bytes]],
    read: Callable[[str], str | None] | None = None,
    *,
    root: str = "",
    layout: str = "",
    catalog: Any = None,
    families: tuple[c.Family, ...] | None = None,
) -> TargetScan:
    """Every gate of one target's files ((path relative to the package's parent, bytes)),
    classified. `read` gives any file's text for the patches (default: from `files`)."""
    start = time.perf_counter()
    if catalog is None:
        from sm120patch.plan import catalog as catalogs

        catalog = catalogs.load()
    if families is None:
        families = c.load_kernels()
    out = TargetScan(kind, version, root, layout)
    scans: dict[str, filescan.FileScan] = {}
    contents: dict[str, bytes] = {}
    for rel, data in files:
        if skipped(rel):
            continue
        out.files_read += 1
        contents[rel] = data
        try:
            found = filescan.scan_text(rel, data)
        except RecursionError:
            # An expression nested thousands deep: Python's parser (or a walk of its tree)
            # gives up. A note, as for a file that does not parse; the scan goes on.
            found = filescan.FileScan(
                rel, problem="nests too deep for Python to parse (RecursionError)"
            )
        if found.problem:
            out.problems.append((rel, found.problem))
        out.skipped += [(rel, line, size) for line, size in found.skipped]
        out.files_parsed += found.parsed
        if found.gates:
            scans[rel] = found

    def read_text(rel: str) -> str | None:
        if rel in contents:
            return _decode(contents[rel])
        return read(rel) if read is not None else None

    cover = c.coverage(kind, version, read_text, scans, catalog, families)
    out.outcomes = cover.outcomes
    refused = c.required(gate for found in scans.values() for gate in found.gates)
    for rel in sorted(scans):
        for gate in scans[rel].gates:
            covered = cover.by_gate.get((rel, gate.key), ())
            out.gates.append(c.classify(gate, families, covered, refused))
    out.seconds = time.perf_counter() - start
    return out


def _decode(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def tree_files(
    package_dir: Path, parent: Path, notes: list[tuple[str, str]] | None = None
) -> Iterator[tuple[str, bytes]]:
    """(path relative to `parent`, bytes) of every .py file under a package directory, the
    skipped directories not walked. A FIFO, a device, a socket, a link or a file too large to
    be source is never read (a FIFO would hang the scan): it is skipped, with why in `notes`."""
    from sm120patch.errors import Refused
    from sm120patch.safeio import walk
    from sm120patch.targets.files import read_regular

    base = str(parent)
    for folder, dirs, names in walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and d != "__pycache__")
        prefix = os.path.relpath(folder, base).replace(os.sep, "/")
        for name in sorted(names):
            rel = f"{prefix}/{name}"
            if skipped(rel):
                continue
            try:
                data = read_regular(Path(folder, name))
            except Refused as exc:
                if notes is not None:
                    notes.append((rel, f"skipped: {exc.message.partition('; ')[0]}"))
                continue
            except OSError:
                continue
            yield rel, data


def scan_directory(kind: str, package_dir: Path, version: str = "", **kwargs: Any) -> TargetScan:
    """`scan_files` over a plain directory of a package's `.py` files (`.../vllm`, a wheel's
    files unpacked, a checkout's package), its paths relative to the directory's parent: for a
    kind the targets do not find yet. `kind` is a plain string (`"vllm"`); a kind no profile
    patches has no covered gate."""
    package_dir = Path(package_dir)
    notes: list[tuple[str, str]] = []
    files = tree_files(package_dir, package_dir.parent, notes)
    out = scan_files(kind, version, files, root=str(package_dir), layout="directory", **kwargs)
    out.problems += notes
    return out


def scan_target(target: Any, **kwargs: Any) -> TargetScan:
    """`scan_files` over a target found on disk (`targets.finding.find`)."""
    from sm120patch.errors import Refused
    from sm120patch.targets.files import read_regular

    def read(rel: str) -> str | None:
        try:
            return read_regular(target.path_of(rel)).decode("utf-8")
        except (OSError, UnicodeDecodeError, Refused):
            return None

    notes: list[tuple[str, str]] = []
    out = scan_files(
        target.kind,
        target.version,
        tree_files(target.package_dir, target.parent, notes),
        read,
        root=str(target.root),
        layout=target.layout,
        **kwargs,
    )
    out.problems += notes
    return out


def scan(paths: Given, *, catalog: Any = None) -> Report:
    """Scan the targets at `paths` (kind -> path), classifying with `catalog` (default: the
    built-in library and the packs in effect). Where a path is given, only the kinds given
    are scanned (a maintainer points at one checkout); with none, the SGLang and FlashInfer
    installed in this Python, whichever are there. `paths`: the command's targets
    (`Resolved`), each found once."""
    from sm120patch import targets
    from sm120patch.errors import Refused
    from sm120patch.targets.resolved import owned

    with owned(paths) as named:
        given = tuple(kind for kind in targets.KINDS if named.given(kind))
        found = [
            t
            for t in (named.quiet(kind, required=bool(given)) for kind in given or targets.KINDS)
            if t is not None
        ]
        if not found:
            raise Refused(
                "neither SGLang nor FlashInfer is installed in this Python",
                "pass --sglang PATH or --flashinfer PATH",
            )
        return Report([scan_target(t, catalog=catalog) for t in found])
