"""Each profile's `flag` (upstream's own flag or environment variable beside the patch, what
`show` and `doctor` name) exists in the release its `flag_release` names: the option in the
release's argument definitions with the value among its spelled choices, or the variable in its
environment table. Read from the release cache's wheel (SGLang) or sources (vLLM), once per
release, without importing anything."""

from __future__ import annotations

import re
from functools import cache

import pytest

from sm120patch.maintain import dists, releases, sources, trees
from sm120patch.plan import catalog

pytestmark = pytest.mark.real

FLAGGED = sorted(name for name, p in catalog.load().profiles.items() if p.flag)


@cache
def release_files(kind: str, version: str) -> dict[str, str]:
    """Path -> text of every `.py` of the release's package."""
    if not releases.index_reachable() and dists.cached(kind, version) is None:
        pytest.skip(f"{kind} {version} is not in the release cache and the index is unreachable")
    if kind == "vllm":  # vLLM's sources alone, never its ~240 MB wheel
        root = sources.tree(kind, version)
        return {str(p.relative_to(root)): p.read_text("utf-8", errors="replace")
                for p in (root / "vllm").rglob("*.py")}  # fmt: skip
    return {rel: data.decode("utf-8", errors="replace")
            for rel, data in trees.package_files(kind, version)}  # fmt: skip


def defined(files: dict[str, str], flag: str) -> list[str]:
    """What of `flag` the release lacks (empty: all of it is there). `--name value`: the
    option spelled as a string, or a field `name:` in the argument definitions, and `value`
    spelled as a string there or in the config modules; `NAME=value`: `NAME` in the
    environment table (`environ.py`, `envs.py`)."""
    args = {p: t for p, t in files.items() if "arg" in p.rsplit("/", 1)[-1] or "/arg_groups/" in p
            or "/config/" in p}  # fmt: skip
    if flag.startswith("--"):
        option, _, value = flag.partition(" ")
        field = option[2:].replace("-", "_")
        lacks = []
        if not any(f'"{option}"' in t or re.search(rf"^\s+{field}\s*:", t, re.M)
                   for t in args.values()):  # fmt: skip
            lacks.append(option)
        if value and not any(f'"{value}"' in t for t in args.values()):
            lacks.append(value)
        return lacks
    name = flag.partition("=")[0]
    envs = [t for p, t in files.items() if p.endswith(("/environ.py", "/envs.py"))]
    return [] if any(re.search(rf"\b{name}\b", t) for t in envs) else [name]


@pytest.mark.parametrize("name", FLAGGED)
def test_a_profiles_flag_exists_in_the_release_it_names(name: str) -> None:
    prof = catalog.load().profiles[name]
    kind, _, version = prof.flag_release.partition(" ")
    assert kind in prof.targets and version, (name, prof.flag_release)
    files = release_files(kind, version)
    assert defined(files, prof.flag) == [], (name, prof.flag, prof.flag_release)
    # The check can fail: a flag one letter off, and a variable the release does not have.
    assert defined(files, prof.flag.replace("-", "-x", 1) if prof.flag.startswith("--")
                   else "X" + prof.flag) != [], name  # fmt: skip
