"""The entry points of one group, found the way `importlib.metadata.entry_points(group=...)`
finds them, without importing `importlib.metadata`.

Every command loads the patch catalog, and the catalog asks for the `sm120patch.patches` entry
points. `importlib.metadata` brings `email`, `zipfile` and `csv` with it: about 18 ms, half of
`import click`, on every warm command (`status`, `ensure` on an applied tree). On
the common layout, directories of `*.dist-info` and `*.egg-info` on `sys.path`, this module
reads the same `entry_points.txt` files in the same order and keeps the same first
distribution of each name. Anything else on `sys.path` (a zip archive, an egg) goes to the
standard library, which knows those layouts.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# importlib.metadata.EntryPoint.pattern
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


@dataclass(frozen=True)
class EntryPoint:
    name: str
    value: str
    group: str

    def load(self) -> Any:
        """The object the entry point names (as `importlib.metadata.EntryPoint.load`)."""
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"entry point value {self.value!r} is not `module[:attr]`")
        module = importlib.import_module(match.group("module"))
        attrs = filter(None, (match.group("attr") or "").split("."))
        return functools.reduce(getattr, attrs, module)


def _normalize(name: str) -> str:
    # importlib.metadata.Prepared.normalize
    return re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")


def _group_of(text: str, group: str) -> list[tuple[str, str]]:
    """(name, value) of `group` in an entry_points.txt (importlib.metadata.Sectioned; a line
    without `=`, on which the standard library raises, is skipped)."""
    out: list[tuple[str, str]] = []
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
            continue
        if section == group and "=" in line:
            name, _, value = line.partition("=")
            out.append((name.strip(), value.strip()))
    return out


def entry_points(group: str, path: Sequence[str] | None = None) -> list[EntryPoint]:
    """The entry points of `group` of every distribution on `path` (default `sys.path`)."""
    search = list(sys.path if path is None else path)
    infos: list[str] = []
    for entry in search:
        root = entry or "."
        if os.path.isfile(root) or root.lower().endswith(".egg"):
            return _by_importlib(group, search)
        try:
            children = os.listdir(root)
        except OSError:
            continue  # a missing entry holds no distribution (importlib's FastPath too)
        # importlib's Lookup: grouped by normalized name in listing order, groups in order.
        grouped: dict[str, list[str]] = {}
        for child in children:
            low = child.lower()
            if low.endswith((".dist-info", ".egg-info")):
                name = _normalize(low.rpartition(".")[0].partition("-")[0])
                grouped.setdefault(name, []).append(os.path.join(root, child))
        for paths in grouped.values():
            infos.extend(paths)
    seen: set[str] = set()
    found: list[EntryPoint] = []
    for info in infos:
        # importlib.metadata._unique: the first distribution of each normalized name.
        name = _normalize(os.path.basename(info).rpartition(".")[0].partition("-")[0])
        if name in seen:
            continue
        seen.add(name)
        try:
            with open(os.path.join(info, "entry_points.txt"), encoding="utf-8") as fh:
                text = fh.read()
        except OSError:
            continue
        found.extend(EntryPoint(n, v, group) for n, v in _group_of(text, group))
    return found


def _by_importlib(group: str, path: list[str]) -> list[EntryPoint]:
    from importlib.metadata import distributions

    found: list[EntryPoint] = []
    seen: set[str] = set()
    for dist in distributions(path=path):
        name = _normalize(dist.metadata["Name"] or "")
        if name in seen:
            continue
        seen.add(name)
        found.extend(
            EntryPoint(ep.name, ep.value, group) for ep in dist.entry_points if ep.group == group
        )
    return found
