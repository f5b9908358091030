"""What each gate is: covered, upstream, kernel or candidate.

- covered: a patch of a profile changes the gate so that it no longer leaves SM120 out. Found
  by running each profile's patches on the file, as `apply` would (one parse, in profile
  order), and scanning what each step leaves: a gate that leaves SM120 out before a step and
  not after it is that patch's. Nothing here names a site: the catalog's patches say it by
  what they change, on this release's text, so a new patch or a moved site needs no table.
- upstream: the expression already admits SM120 (it takes the path of the archs it favours),
  or a sibling test (same if/elif chain, same block, an `if` around it whose other branch
  SM120 takes, an SM120 twin of its function) gives SM120 a path of its own.
- kernel: it selects or guards a kernel family SM120 cannot run (patches/kernels.toml: the
  maintainers' table, with reasons), compile targets of another arch's `a` feature set, or it
  names SM120 to leave it out.
- candidate: none of these: a place a patch may belong.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm120patch.patchkit import arch
from sm120patch.scan import evaluate, filescan
from sm120patch.scan import gates as g

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

COVERED, UPSTREAM, KERNEL, CANDIDATE = "covered", "upstream", "kernel", "candidate"
CLASSES = (CANDIDATE, COVERED, UPSTREAM, KERNEL)  # the order a report lists them in
KERNELS_SCHEMA = 1


@dataclass(frozen=True)
class Family:
    id: str
    reason: str
    match: tuple[re.Pattern[str], ...] = ()
    sm120: str = ""  # what SM120 runs instead, where the family has an SM120 counterpart
    archs: tuple[str, ...] = ()  # or: gates that favour exactly these archs
    where: str = ""  # "names": look in the file and function names only
    paths: tuple[re.Pattern[str], ...] = ()  # only gates in files matching one of these
    # True: only gates that refuse (raise, assert, return False or None); False: only the
    # others; None: either.
    refuses: bool | None = None

    def matches(self, text: str) -> bool:
        return any(p.search(text) for p in self.match)

    def admits(self, gate: g.Gate) -> bool:
        """Whether the family's conditions other than `match` hold for a gate."""
        if self.paths and not any(p.search(gate.file) for p in self.paths):
            return False
        return self.refuses is None or gate.refuses == self.refuses


def load_kernels(text: str | None = None) -> tuple[Family, ...]:
    """The kernel families of patches/kernels.toml (or of `text`)."""
    if text is None:
        text = _kernels_path().read_text(encoding="utf-8")
    data = tomllib.loads(text)
    if data.get("schema") != KERNELS_SCHEMA:
        raise ValueError(f"kernels.toml: schema {data.get('schema')!r}, not {KERNELS_SCHEMA}")
    out = []
    for raw in data.get("family", []):
        out.append(
            Family(
                id=raw["id"],
                reason=raw["reason"],
                match=tuple(re.compile(p, re.IGNORECASE) for p in raw.get("match", [])),
                sm120=raw.get("sm120", ""),
                archs=tuple(raw.get("archs", [])),
                where=raw.get("where", ""),
                paths=tuple(re.compile(p) for p in raw.get("paths", [])),
                refuses=raw.get("refuses"),
            )
        )
    return tuple(out)


def _kernels_path() -> Path:
    from sm120patch import patches  # type: ignore[attr-defined]  # a package-dir mapping

    return Path(next(iter(patches.__path__))) / "kernels.toml"


# ----------------------------------------------------------------------------- coverage


@dataclass(frozen=True)
class Coverage:
    """A patch of a profile that makes a gate admit SM120, and its outcome on this release."""

    profile: str
    patch: str
    outcome: str  # applied, already-applied, upstream, refused...
    pinned: bool  # the release is inside the profile's pins

    def describe(self) -> str:
        pins = "" if self.pinned else ", outside its pins"
        return f"{self.profile}: {self.patch} ({self.outcome}{pins})"


@dataclass(frozen=True)
class SiteOutcome:
    """One patch of one profile on this release (every patch the catalog has for the kind)."""

    profile: str
    patch: str
    file: str | None
    site: str
    outcome: str
    pinned: bool


@dataclass
class Coverages:
    by_gate: dict[tuple[str, tuple[str, str, str, int]], list[Coverage]] = field(
        default_factory=dict
    )
    outcomes: list[SiteOutcome] = field(default_factory=list)


def leaves_out(gate: g.Gate, families: Sequence[Family] = ()) -> bool:
    """Whether a gate still keeps SM120 away (no sibling gives it a path), or, with the
    kernel table, sends it down a path that ends in a kernel SM120 cannot run."""
    if gate.verdict in (evaluate.LEAVES_OUT, evaluate.EXCLUDES) and not gate.sibling:
        return True
    return bool(families) and dead_end(gate, families) is not None


def dead_end(
    gate: g.Gate, families: Sequence[Family], refused: Mapping[str, g.Gate] | None = None
) -> tuple[Family | None, str] | None:
    """(the family, or None for what the release refuses; the value) where a gate admits
    SM120 and every value of the path SM120 takes is a kernel SM120 cannot run: SGLang
    0.5.23's NVFP4 MoE `auto` sends SM120 the way SM100 goes, to flashinfer_trtllm. None
    when the path chooses nothing known, or anything else."""
    if gate.verdict != evaluate.ADMITS or gate.sibling or not gate.sm120_choices:
        return None
    refused = refused or {}
    # Families read off file and function names (`sm100` a plan table's name) name no value.
    by_value = tuple(f for f in families if f.where != "names")
    found = [(_family_of(_value(v), by_value), v) for v in gate.sm120_choices]
    if not all(f is not None or v in refused for f, v in found):
        return None
    return next(((f, v) for f, v in found if f is not None), (None, found[0][1]))


def coverage(
    kind: str,
    version: str,
    read: Callable[[str], str | None],
    scans: Mapping[str, filescan.FileScan],
    catalog: Any,
    families: Sequence[Family] = (),
) -> Coverages:
    """Which gates each profile's patches change, run on this release's texts (`read` gives
    a file's text by its path relative to the package's parent, None if it is absent); with
    the kernel table, a gate sending SM120 to a kernel it cannot run counts as one to change.

    Each patch runs once, in the chain of the smallest profile holding it (the patches of that
    profile before it in the same file run first, as `apply` runs them): a patch sees only
    the text the earlier ones left, so the larger profiles holding it change the same gates.
    """
    out = Coverages()
    texts: dict[str, str | None] = {}

    def cached(rel: str) -> str | None:
        if rel not in texts:
            texts[rel] = read(rel)
        return texts[rel]

    profiles = [p for p in catalog.profiles.values() if kind in p.targets]
    runs: dict[str, tuple[str | None, str, str, list[g.Gate]]] = {}  # id -> file, site, ...
    for chain in _chains(kind, profiles, catalog):
        runs.update(_run_chain(chain, version, cached, scans, families))
    for profile in profiles:
        pinned = profile.pinned(kind, version)
        for pid in profile.patches:
            if pid not in runs:
                continue
            rel, site, outcome, removed = runs[pid]
            out.outcomes.append(SiteOutcome(profile.name, pid, rel, site, outcome, pinned))
            for gate in removed:
                out.by_gate.setdefault((gate.file, gate.key), []).append(
                    Coverage(profile.name, pid, outcome, pinned)
                )
    return out


def _chains(kind: str, profiles: list[Any], catalog: Any) -> list[list[Any]]:
    """For each patch of `kind`, the patches of the smallest profile holding it (of that
    kind, in order); each chain once."""
    chains: dict[tuple[str, ...], list[Any]] = {}
    for patch in (p for p in catalog.patches.values() if p.target == kind):
        holding = sorted(
            (p for p in profiles if patch.id in p.patches), key=lambda p: (len(p.patches), p.name)
        )
        if not holding:
            continue
        chain = [catalog.patches[pid] for pid in holding[0].patches]
        chain = [p for p in chain if p.target == kind]
        chains.setdefault(tuple(p.id for p in chain), chain)
    return list(chains.values())


def _run_chain(
    chain: list[Any],
    version: str,
    read: Callable[[str], str | None],
    scans: Mapping[str, filescan.FileScan],
    families: Sequence[Family] = (),
) -> dict[str, tuple[str | None, str, str, list[g.Gate]]]:
    """patch id -> (file, site, outcome, the gates its step stops leaving SM120 out)."""
    from sm120patch.patchkit.facts import Status
    from sm120patch.patchkit.runner import transform_text

    out: dict[str, tuple[str | None, str, str, list[g.Gate]]] = {}
    groups: dict[str | None, list[Any]] = {}
    for patch in chain:
        groups.setdefault(patch.pick_file(read), []).append(patch)
    for rel, group in groups.items():
        text = read(rel) if rel else None
        if rel is None or text is None:
            out.update((p.id, (None, "", Status.NOT_APPLICABLE.value, [])) for p in group)
            continue
        result = transform_text(group, rel, text)
        by_id = {p.id: p for p in group}
        before = scans.get(rel) or filescan.scan_text(rel, text)
        left = [x for x in before.gates if leaves_out(x, families)]
        removed: dict[str, list[g.Gate]] = {}
        for patch_id, step_text in result.step_texts():
            still = {
                x.key for x in filescan.scan_text(rel, step_text).gates if leaves_out(x, families)
            }
            removed[patch_id] = [x for x in left if x.key not in still]
            left = [x for x in left if x.key in still]
        for o in result.outcomes:
            status = o.status
            if status is Status.ALREADY_APPLIED and by_id[o.patch].upstream_at(version):
                status = Status.UPSTREAM
            out[o.patch] = (rel, o.site, status.value, removed.get(o.patch, []))
    return out


# ----------------------------------------------------------------------------- classes


def identities(file: str, key: Sequence[object]) -> set[tuple[str, ...]]:
    """What identifies a gate across two releases or two scans: its expression and kind with
    its file and function, or with either of them (files move and functions are renamed
    between releases; two gates of one function differ by their expressions). `key` is a
    gate's `key` (function, kind, expression), or its first three items from JSON."""
    function, kind, expression = str(key[0]), str(key[1]), str(key[2])
    return {
        (file, function, kind, expression),
        ("", function, kind, expression),
        (file, "", kind, expression),
    }


@dataclass(frozen=True)
class Classified:
    gate: g.Gate
    cls: str
    reason: str
    covered_by: tuple[Coverage, ...] = ()
    family: str = ""  # the kernel family, where one decided

    def to_dict(self) -> dict[str, Any]:
        gate = self.gate
        return {
            "class": self.cls,
            "file": gate.file,
            "line": gate.line,
            "function": gate.function,
            "kind": gate.kind,
            "expression": gate.expression,
            "gates": gate.gates,
            "favours": list(gate.favoured),
            "verdict": gate.verdict,
            "reason": self.reason,
            "family": self.family or None,
            "choices": list(gate.choices),
            "sm120_choices": list(gate.sm120_choices),
            "key": list(gate.key[:3]),
            "covered_by": [
                {"profile": c.profile, "patch": c.patch, "outcome": c.outcome, "pinned": c.pinned}
                for c in self.covered_by
            ],
        }


def required(gates: Iterable[g.Gate]) -> dict[str, g.Gate]:
    """name -> the check of this release that refuses it outside the archs it favours (see
    `Gate.requires`): what the release itself says SM120 cannot run."""
    out: dict[str, g.Gate] = {}
    for gate in gates:
        for name in gate.requires:
            out.setdefault(name, gate)
    return out


def classify(
    gate: g.Gate,
    families: Iterable[Family],
    covered: Iterable[Coverage] = (),
    refused: Mapping[str, g.Gate] | None = None,
) -> Classified:
    """The class of one gate, with its reason in words; `refused` (see `required`) holds what
    the release itself refuses on SM120."""
    covered = tuple(covered)
    families = tuple(families)
    if covered and leaves_out(gate, families):
        return Classified(gate, COVERED, "; ".join(c.describe() for c in covered), covered)
    end = dead_end(gate, families, refused)
    if end is not None:
        return _into_a_kernel(gate, *end, refused or {})
    if gate.verdict == evaluate.ADMITS:
        return Classified(gate, UPSTREAM, "SM120 takes the path of the archs it favours")
    if gate.sibling:
        return Classified(gate, UPSTREAM, f"SM120 has a path of its own: {gate.sibling}")
    if gate.verdict == evaluate.EXCLUDES:
        return Classified(gate, KERNEL, "the code names SM120 to leave it out here")
    if gate.arch_specific:
        targets = ", ".join(gate.arch_specific)
        return Classified(
            gate, KERNEL, f"arch-specific compile targets ({targets}): code for that GPU alone"
        )
    return _by_family(gate, families, refused or {})


def _by_family(
    gate: g.Gate, families: tuple[Family, ...], refused: Mapping[str, g.Gate]
) -> Classified:
    names = f"{gate.file} {gate.function}"
    for family in families:
        if family.archs and tuple(family.archs) == gate.favoured and family.admits(gate):
            return Classified(gate, KERNEL, family.reason, family=family.id)
    if gate.choices:
        # A choice: a kernel gate only when everything it chooses is a kernel SM120 lacks, by
        # the table or by what this release itself refuses on SM120.
        found = [_family_of(_value(c), families) for c in gate.choices]
        if not all(f is not None or c in refused for c, f in zip(gate.choices, found, strict=True)):
            return Classified(gate, CANDIDATE, _candidate(gate))
        counterpart = next((f for f in found if f and f.sm120), None)
        if counterpart is not None:
            return Classified(
                gate,
                CANDIDATE,
                f"chooses {counterpart.id} for the archs it favours and nothing for SM120; "
                f"SM120's counterpart: {counterpart.sm120}",
                family=counterpart.id,
            )
        by_release = [c for c in gate.choices if c in refused]
        if by_release:
            check = refused[by_release[0]]
            return Classified(
                gate,
                KERNEL,
                f"this release refuses {', '.join(by_release)} on SM120 "
                f"({check.file}:{check.line}: {check.gates})",
            )
        family = next(f for f in found if f is not None)
        return Classified(gate, KERNEL, family.reason, family=family.id)
    for family in families:
        if family.archs or not family.admits(gate):
            continue
        text = names if family.where == "names" else f"{names} {gate.context}"
        if not family.match or family.matches(text):
            return Classified(gate, KERNEL, family.reason, family=family.id)
    return Classified(gate, CANDIDATE, _candidate(gate))


def _into_a_kernel(
    gate: g.Gate, family: Family | None, value: str, refused: Mapping[str, g.Gate]
) -> Classified:
    """A gate that admits SM120 into a kernel it cannot run: a gap (a candidate), named."""
    like = "/".join(n for n in map(arch.arch_name, arch.FAVOURED) if n not in gate.favoured)
    head = f"SM120 goes the way {like} goes, to {value}: "
    if family is None:
        check = refused[value]
        why = f"this release refuses it on SM120 ({check.file}:{check.line}: {check.gates})"
        return Classified(gate, CANDIDATE, head + why)
    why = f"{family.id}, a kernel SM120 cannot run ({family.reason})"
    if family.sm120:
        why += f"; SM120's counterpart: {family.sm120}"
    return Classified(gate, CANDIDATE, head + why, family=family.id)


def _family_of(text: str, families: tuple[Family, ...]) -> Family | None:
    for family in families:
        if family.match and family.matches(text):
            return family
    return None


def _value(choice: str) -> str:
    """The value of a choice, "attention_backend=fa3" -> "fa3"."""
    return choice.rpartition("=")[2]


def _candidate(gate: g.Gate) -> str:
    favours = "/".join(gate.favoured)
    return f"favours {favours}; no patch, no SM120 path, no kernel family known to need it"
