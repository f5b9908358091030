"""What the field-facing declarations say, checked on the real releases: the server log lines a
patch's wiring names are strings the release logs, and pcie-allreduce refuses exactly the
releases that ship upstream's PCIe-IPC allreduce (tried after the custom allreduce)."""

from __future__ import annotations

import ast
import hashlib
import itertools
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from expected import fact
from realcache import RealReleases, SiteCase, release_set

from sm120patch.patchkit.model import Status
from sm120patch.plan import catalog

pytestmark = pytest.mark.real

PCIE_ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"


def _strings(text: str) -> list[str]:
    """The string literals of one source text, f-strings with `{}` for their fields."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return out


_BY_BYTES: dict[bytes, tuple[str, ...]] = {}


def _strings_once(data: bytes) -> tuple[str, ...]:
    """`_strings` of a file's bytes, once per distinct content in the session: most of a
    release's ~2,000 files are byte-identical in the releases beside it."""
    digest = hashlib.sha256(data).digest()
    if digest not in _BY_BYTES:
        _BY_BYTES[digest] = tuple(_strings(data.decode("utf-8")))
    return _BY_BYTES[digest]


def logged_hits(root: Path, patterns: set[str], own: list[str],
                enough: Callable[[set[str]], bool]) -> set[str]:
    """The patterns that a string literal of the release under `root` (or of `own`, the patched
    site's text) matches, as `logs` judges each. Every check is "some string of some file", so
    the files are read most likely first (those whose bytes hold more of the patterns' words)
    and the search stops once `enough(found)`; a pattern is found absent only after every file
    of the release was parsed."""
    found = {p for p in patterns if logs(p, own)}
    words = {w.encode() for p in patterns for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", p)}

    def likely(path: Path) -> tuple[int, str]:
        data = path.read_bytes()
        return -sum(w in data for w in words), str(path)

    ranked = sorted(root.rglob("*.py"), key=likely)
    for path in ranked:
        if enough(found) or found == patterns:
            break
        strings = list(_strings_once(path.read_bytes()))
        found |= {p for p in patterns - found if logs(p, strings)}
    return found


def _logs_percent(pattern: str, strings: list[str]) -> bool:
    """A `logger.info("... %s ...", args)` template: its `%s` fields filled with what the
    pattern names, as a word, a one-element list of it (vLLM logs its all-reduce backends as
    `['CUSTOM', 'PYNCCL']`) or a group name (`tp:0`); templates holding three or more of the
    pattern's words, three fields at most."""
    names = [*dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", pattern))]
    fills = [*names, *(f"['{w}']" for w in names), *(f"{w}:0" for w in names)]
    for template in strings:
        fields = template.count("%s")
        if not 0 < fields <= 3 or "%" in template.replace("%s", ""):
            continue
        if sum(w in template for w in names) < 3:
            continue
        parts = template.split("%s")
        for filling in itertools.product(fills, repeat=fields):
            text = "".join(p + f for p, f in zip(parts, (*filling, ""), strict=True))
            if re.search(pattern, text):
                return True
    return False


def logs(pattern: str, strings: list[str]) -> bool:
    """Whether a line the release logs matches `pattern`: a literal as it is, or an f-string
    (fields as `{}`) once its fields hold words the pattern names. vLLM formats the name of the
    backend it picked at run time (`f"Using '{backend.value}' NvFp4 MoE backend ..."`; from
    0.34 `f"Using {backend.value} {self.name} MoE {lora}backend{available}."`), so no literal
    of it names FLASHINFER_B12X or MARLIN."""
    if any(re.search(pattern, s) for s in strings):
        return True
    if _logs_percent(pattern, strings):
        return True
    words = [*dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", pattern)), ""]
    if _filled(pattern, strings, words, 4):
        return True
    # SGLang formats the arch too (`f"Defaulting SM{sm_major}0 GDN prefill ..."`): a field may
    # hold a leading part of a number the pattern names ("12" of "SM120") beside the letters
    # before it ("SM"). Tried only where the words alone found nothing, on 2 fields at most.
    numbers = [n[:i] for n in re.findall(r"\d+", pattern) for i in range(1, len(n) + 1)]
    more = [*dict.fromkeys([*words, *re.findall(r"[A-Za-z_]+", pattern), *numbers])]
    return _filled(pattern, strings, more, 2)


def _filled(pattern: str, strings: list[str], words: list[str], most: int) -> bool:
    """Whether an f-string of `strings` with at most `most` fields, each filled with one of
    `words`, matches `pattern`."""
    for template in strings:
        fields = template.count("{}")
        literal = template.replace("{}", " ").split()
        # only templates whose own words the pattern also names (a cheap filter)
        if not fields or fields > most or not literal or not all(
            re.sub(r"\W", "", w) in words or not re.sub(r"\W", "", w) for w in literal[:2]
        ):
            continue
        for filling in itertools.product(words, repeat=fields):
            parts = template.split("{}")
            text = "".join(p + f for p, f in zip(parts, (*filling, ""), strict=True))
            if re.search(pattern, text):
                return True
    return False


def wired() -> list[str]:
    return sorted(p.id for p in catalog.load().patches.values() if p.wiring is not None)


@pytest.mark.parametrize("patch_id", wired())
def test_wiring_lines_are_logged_by_each_pinned_release(real: RealReleases, patch_id: str):
    """On every release of the set that a profile holding the patch pins and where its site
    exists, some `ran` and some `skipped` pattern matches a string the release logs; and
    every pattern matches on at least one release of the set (no pattern of nothing)."""
    cat = catalog.load()
    patch = cat.patches[patch_id]
    wiring = patch.wiring
    assert wiring is not None
    profiles = [p for p in cat.profiles.values() if patch_id in p.patches]
    used: set[str] = set()
    every = {*wiring.ran, *wiring.skipped}
    checked = 0
    for version in release_set(patch.target):
        known = fact(patch_id, version)
        if known is None or known.status is Status.NOT_APPLICABLE:
            continue
        if not any(p.pinned(patch.target, version) for p in profiles):
            continue
        # A line the patch itself adds to the code it writes is logged by the patched release.
        own = _strings(real.site(SiteCase(patch_id, patch.target, version)).after)

        def enough(found: set[str], used: set[str] = used) -> bool:
            return bool(found & set(wiring.ran)) and (
                not wiring.skipped or bool(found & set(wiring.skipped))) and (
                len(release_set(patch.target)) <= 3 or every <= used | found)

        hits = logged_hits(real.tree(patch.target, version), every, own, enough)
        used |= hits
        assert hits & set(wiring.ran), f"{patch_id} on {version}: no `ran` line is logged"
        if wiring.skipped:  # optional: upstream's other path may log nothing (GDN's Triton)
            assert hits & set(wiring.skipped), f"{patch_id} on {version}: no `skipped` line"
        checked += 1
    assert checked, "no release of the set to check"
    if len(release_set(patch.target)) > 3:
        assert used == {*wiring.ran, *wiring.skipped}, (
            f"patterns no release logs: {sorted({*wiring.ran, *wiring.skipped} - used)}"
        )


def test_pcie_allreduce_refuses_exactly_where_upstream_ships_pcie_ipc(real: RealReleases):
    prof = catalog.load().profile("pcie-allreduce")
    for version in release_set("sglang"):
        root = real.tree("sglang", version)
        environ = root / "sglang/srt/environ.py"
        ships = environ.is_file() and PCIE_ENV in environ.read_text(encoding="utf-8")
        assert bool(prof.refusals("sglang", version)) is ships, version
        if not ships:
            continue
        # The custom allreduce is chosen before the PCIe-IPC one: kept on, it shadows it.
        tree = ast.parse((root / "sglang/srt/distributed/parallel_state.py").read_text())
        [method] = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name == "_resolve_outplace_all_reduce_method"
        ]
        returned = [
            n.value.value
            for n in ast.walk(method)
            if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
        ]
        assert returned.index("ca") < returned.index("pcie_ipc"), (version, returned)


def test_a_pattern_is_absent_only_after_every_file_and_found_wherever_it_is(tmp_path: Path):
    """`logged_hits` stops early only when told it has enough: a line in the least likely file
    is still found, and a pattern no file logs is reported absent."""
    (tmp_path / "a.py").write_text('NOTE = "Using nothing for NVFP4 GEMM here"\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "z.py").write_text('logger.info("Using %s for NVFP4 GEMM", k.__name__)\n')
    patterns = {"Using B12xNvFp4LinearKernel for NVFP4 GEMM", "Never logged anywhere"}
    assert logged_hits(tmp_path, patterns, [], lambda found: False) == {
        "Using B12xNvFp4LinearKernel for NVFP4 GEMM"}
    assert logged_hits(tmp_path, patterns, [], lambda found: True) == set()
    # the patched site's own strings count before any file is read
    assert logged_hits(tmp_path, patterns, ["Never logged anywhere"],
                       lambda found: True) == {"Never logged anywhere"}
