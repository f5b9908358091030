"""Known outcomes (patches/known.toml and each pack's), matched to a box: data the plan wing
reads, so that `apply` and its dry run say what is known before they plan without entering the
trial wing.

An entry's condition names what it applies to (profile or patch, SGLang and FlashInfer ranges,
GPU family and count, TP size, quantization, model architecture). A condition the box cannot
tell (no GPU read, no server command to read the TP size from) does not exclude the entry:
better one line too many before a trial than a known regression unsaid.

Each entry also says what its figure rests on (`evidence`: measured, confounded, reported,
inferred, or unpublished for the field report this project started from) and what was run, in the
source's terms (`measured`: engine, kernel, TP, runs), and the sentence or figure of the
source it relies on (`quote`, required of the built-in library); all are printed in full
(`Entry.full`). A wrong-output
entry about a profile that matches the box condemns the profile there: `doctor` and `list`
stop recommending it.

This box's own trials are shown as recorded: whether a trial is evidence was decided when it
was recorded (`Trial.evidence`), not again here. Reading the GPUs and the trial records is the
caller's: the plan wing reads neither NVML nor the engine's state.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120patch.errors import Sm120Error, UsageError
from sm120patch.patchkit import versions
from sm120patch.targets import Target

if TYPE_CHECKING:
    from sm120patch.plan.catalog import Catalog, Profile

OUTCOMES = ("faster", "slower", "no-gain", "wrong-output", "crash")
CONDITIONS = (
    "profile",
    "patch",
    "sglang",
    "flashinfer",
    "vllm",  # what a measured vLLM trial exports (`trial.known.outcome_record`)
    "gpu_family",
    "gpus",
    "tp",
    "quantization",
    "architecture",
    "topology",
)
RECORD = ("id", "outcome", "figure", "date", "source", "evidence")
# What an entry's figure rests on: the source ran it, states it, it was read off code, or it
# is the unpublished field report this project started from.
# "confounded": the source ran it and gives figures, but more than the patch differed between
# the runs (two builds, two versions), so the figure is not the patch's alone. Its short line
# says so; "measured" there would claim more than the source shows.
EVIDENCE = ("measured", "confounded", "reported", "inferred", "unpublished")
# What was run, in the source's terms; the sentence or figure of the source the entry relies on
# (required of the built-in library, `QUOTED`: a pack's own entries may leave it out).
# engine, kernel, differs: what the source ran and what differed between its runs (the
# derived-evidence schema; read by its own test, accepted here).
OPTIONAL = ("measured", "quote", "engine", "kernel", "differs")
QUOTED = "quote"
# What the source ran and compared (`SOURCE_RAN`: required of the built-in library, which
# derives the evidence word's ceiling from them, `ceiling`): the engine ("sglang", "vllm", or
# "flashinfer" for FlashInfer called alone, no server), the kernel or backend in upstream's
# own name, what differed between the compared runs ("patch" for the change the profile makes,
# by the patch or by upstream's flag; anything else beside it, e.g. "fp4-gemm-backend" or
# "vllm-build"; empty where nothing was compared, as for a bug report), and `against`: what
# the outcome is compared with, in a few words (the short line prints it: "slower than b12x").
SOURCE_RAN = ("engine", "kernel", "differs")
AGAINST = "against"
ENGINES = ("sglang", "vllm", "flashinfer")
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM", "flashinfer": "FlashInfer alone"}
# The comparative outcomes: the built-in library says what each is compared with.
COMPARED = ("faster", "slower", "no-gain")
# How much each evidence word claims; an entry may claim at most its derived ceiling.
STRENGTH = {"measured": 4, "unpublished": 4, "confounded": 3, "reported": 2, "inferred": 1}
# The most characters of a known line before a command's output (a diff, a table): one line a
# reader takes in; the whole entry is `sm120patch show PROFILE` (or the command's --verbose).
SHORT = 120


@dataclass(frozen=True)
class Entry:
    id: str
    outcome: str
    figure: str
    date: str
    source: str
    evidence: str = "measured"
    condition: dict[str, Any] = field(default_factory=dict)
    measured: str = ""
    quote: str = ""
    engine: str = ""
    kernel: str = ""
    differs: tuple[str, ...] = ()
    against: str = ""

    @property
    def about(self) -> str:
        return self.condition.get("profile") or self.condition.get("patch") or "any server"

    def _where(self, keys: Sequence[str]) -> str:
        return ", ".join(
            f"{k} {_spaced(v)}" if k in ("sglang", "flashinfer", "vllm", "gpus", "tp") else str(v)
            for k, v in self.condition.items()
            if k in keys
        )

    def ran_doc(self) -> dict[str, Any]:
        """What the source ran, for `show --json`."""
        return {
            "engine": self.engine or None,
            "kernel": self.kernel or None,
            "differs": list(self.differs),
            "against": self.against or None,
        }

    def _head(self) -> str:
        """What it is about and its kernel, the verdict, what it is compared with, the
        evidence and the engine the source ran: `moe (flashinfer_cutlass) slower than b12x
        (confounded, SGLang)`."""
        kernel = f" ({self.kernel})" if self.kernel else ""
        word = "over" if self.outcome == "no-gain" else "than"
        than = f" {word} {self.against}" if self.against and self.outcome in COMPARED else ""
        ran = f", {ENGINE_NAMES.get(self.engine, self.engine)}" if self.engine else ""
        return f"known: {self.about}{kernel} {self.outcome}{than} ({self.evidence}{ran})"

    def line(self) -> str:
        """One short line (SHORT characters at most): what it is about and its kernel, the
        verdict and what it is compared with, the evidence and engine, where. The figure, what
        was run and the source are `full()`'s (`sm120patch show PROFILE`)."""
        where = self._where(("sglang", "flashinfer", "vllm", "gpu_family", "gpus", "tp"))
        head = self._head()
        return cut(f"{head}: {where}" if where else head)

    def full(self) -> str:
        """The whole entry: the figure, what was run, every condition, date and source."""
        where = self._where([k for k in self.condition if k not in ("profile", "patch")])
        ran = f" [{self.measured}]" if self.measured else ""
        said = f': "{self.quote}"' if self.quote else ""
        differed = f"; differed: {', '.join(self.differs)}" if self.differs else ""
        return (
            f"{self._head()}: {self.figure}{ran} "
            f"({where}; {self.date}; {self.source}; id {self.id}{differed}{said})"
        )

    def condemns(self, profile: str, box: Box, cat: Catalog | None = None) -> bool:
        """Whether this entry says `profile` gives wrong output on `box`: a wrong-output
        entry about the profile (or a patch of it) whose condition matches. An entry about
        every server (a FlashInfer bug) does not condemn one profile more than not applying
        it."""
        about = "profile" in self.condition or "patch" in self.condition
        return self.outcome == "wrong-output" and about and matches(self, profile, box, cat)


@dataclass(frozen=True)
class Box:
    """What is known of this box and, in a trial, of the server command."""

    versions: dict[str, str] = field(default_factory=dict)
    gpu_family: str | None = None
    gpus: int | None = None
    tp: int | None = None
    quantization: str | None = None
    architecture: list[str] | None = None


def entries(
    text: str | None = None,
    where: str = "known.toml",
    *,
    quoted: bool = False,
    cat: Catalog | None = None,
) -> list[Entry]:
    """The known outcomes of `text`, or of the built-in library and every pack of `cat` (each
    pack's own known.toml beside its profiles.toml). The built-in library's entries, and with
    `quoted` those of `text`, must each carry a `quote` of their source (`check_quotes`).

    `cat` here and below: the command's catalog (`app.Session.catalog`); None, the
    environment's (`catalog.load()`: a test, a library user)."""
    from sm120patch.plan import catalog

    if text is None:
        cat = _catalog(cat)
        out = []
        for pack in cat.loaded:
            path = Path(pack.location, "known.toml") if pack.location else None
            if path is not None and path.is_file():
                hint = catalog.DAMAGED_HINT if pack.built_in else f"fix {path}, or drop the pack"
                found = _parse(path.read_text(encoding="utf-8"), str(path), hint)
                if pack.built_in:
                    check_quotes(found, str(path), hint)
                    check_evidence(found, str(path), hint, cat)
                out += found
        return out
    found = _parse(text, where, "fix the file")
    if quoted:
        check_quotes(found, where, "fix the file")
        check_evidence(found, where, "fix the file", cat)
    return found


def _catalog(cat: Catalog | None) -> Catalog:
    from sm120patch.plan import catalog

    return cat if cat is not None else catalog.load()


def check_quotes(found: Sequence[Entry], where: str, hint: str) -> None:
    """UsageError naming every entry without a `quote` of its source, or whose quote of the
    unpublished field report does not say it is unpublished (there is no text to quote)."""
    bad = [e.id for e in found if not e.quote.strip()]
    bad += [
        e.id
        for e in found
        if e.quote.strip() and e.evidence == "unpublished" and "unpublished" not in e.quote
    ]
    if bad:
        raise UsageError(
            f"{where}: {len(bad)} entries quote no source ({', '.join(bad)}); each needs "
            '`quote`, the sentence or figure of its source it relies on ("unpublished: ..." '
            "where there is none)",
            hint + " (its header says what a quote is)",
        )


def ceiling(entry: Entry, cat: Catalog | None = None) -> str:
    """The most an entry's evidence word may claim, derived from what its source ran: an
    engine or kernel other than its profile's is at most `inferred` (the figure is another
    kernel's, not this profile's); more than the patch differing between the compared runs is
    at most `confounded`; else `measured`. An entry about every server is held by `differs`
    alone. Raises ValueError where the entry names a profile that says no kernel."""
    cat = _catalog(cat)
    theirs: list[Profile] = []
    if "profile" in entry.condition and entry.condition["profile"] in cat.profiles:
        theirs = [cat.profiles[entry.condition["profile"]]]
    elif "patch" in entry.condition:
        theirs = [p for p in cat.profiles.values() if entry.condition["patch"] in p.patches]
    for prof in theirs:
        if not prof.kernel:
            raise ValueError(f"profile {prof.name} names no `kernel` in profiles.toml")
    if theirs:
        if entry.engine not in {p.engine for p in theirs}:
            return "inferred"
        if entry.kernel not in {k for p in theirs for k in p.kernel}:
            return "inferred"
    if entry.differs and set(entry.differs) != {"patch"}:
        return "confounded"
    return "measured"


def check_evidence(
    found: Sequence[Entry], where: str, hint: str, cat: Catalog | None = None
) -> None:
    """UsageError naming every entry that does not say what its source ran (`SOURCE_RAN`),
    or whose evidence word claims more than
    `ceiling` derives from what it ran: a claim cannot travel from another engine, kernel or
    build to this profile by being written down."""
    bad = []
    for e in found:
        missing = [k for k in ("engine", "kernel") if not getattr(e, k)]
        ran = e.evidence in ("measured", "confounded", "unpublished")
        if e.outcome in COMPARED and ran and not e.differs:
            missing.append("differs")  # a comparison that ran says what its runs differed in
        if missing:
            bad.append(f"{e.id} (no {', '.join(missing)})")
            continue
        try:
            most = ceiling(e, cat)
        except ValueError as exc:
            bad.append(f"{e.id} ({exc})")
            continue
        if STRENGTH[e.evidence] > STRENGTH[most]:
            bad.append(f"{e.id} ({e.evidence}, but what it ran allows {most} at most)")
    if bad:
        raise UsageError(
            f"{where}: {len(bad)} entries claim more than their source ran: {'; '.join(bad)}",
            hint + " (its header says how engine, kernel and differs bound the evidence)",
        )


def _parse(text: str, where: str, hint: str) -> list[Entry]:
    from sm120patch.plan import catalog

    doc = catalog.parse_toml(text, where, hint)
    out = []
    for raw in doc.get("outcome", []):
        missing = [k for k in RECORD if not raw.get(k)]
        unknown = (
            set(raw) - set(RECORD) - set(OPTIONAL) - set(CONDITIONS) - set(SOURCE_RAN) - {AGAINST}
        )
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if unknown:
            problems.append(f"unknown keys {', '.join(sorted(unknown))}")
        if not missing and raw["outcome"] not in OUTCOMES:
            problems.append(f"outcome must be one of {', '.join(OUTCOMES)}")
        if not missing and raw["evidence"] not in EVIDENCE:
            problems.append(f"evidence must be one of {', '.join(EVIDENCE)}")
        if "engine" in raw and raw["engine"] not in ENGINES:
            problems.append(f"engine must be one of {', '.join(ENGINES)}")
        if "differs" in raw and not isinstance(raw["differs"], list):
            problems.append('differs must be a list, e.g. ["patch"]')
        if problems:
            raise UsageError(
                f"{where} entry {raw.get('id', '?')}: " + "; ".join(problems),
                hint + " (its header lists every key)",
            )
        out.append(
            Entry(
                **{k: str(raw[k]) for k in RECORD},
                condition={k: raw[k] for k in CONDITIONS if k in raw},
                measured=str(raw.get("measured", "")),
                quote=str(raw.get(QUOTED, "")),
                engine=str(raw.get("engine", "")),
                kernel=str(raw.get("kernel", "")),
                differs=tuple(str(d) for d in raw.get("differs", ())),
                against=str(raw.get(AGAINST, "")),
            )
        )
    return out


def about_profile(
    profile: str, found: Sequence[Entry] | None = None, cat: Catalog | None = None
) -> list[Entry]:
    """Every known entry about `profile` (or a patch of it, or any profile), whatever the box:
    what `show PROFILE` prints in full."""
    cat = _catalog(cat)
    return [
        e
        for e in (entries(cat=cat) if found is None else found)
        if _profile_matches(e.condition, profile, cat)
    ]


def condemning(
    profile: str, box: Box, found: Sequence[Entry] | None = None, cat: Catalog | None = None
) -> list[Entry]:
    """The known entries that say `profile` gives wrong output on `box` (`Entry.condemns`)."""
    cat = _catalog(cat)
    return [
        e for e in (entries(cat=cat) if found is None else found) if e.condemns(profile, box, cat)
    ]


def installed_targets(stated: Mapping[str, str] | None = None) -> list[Target]:
    """The SGLang and FlashInfer installed in this interpreter (those found), at the versions
    the command states (`config.Config.stated`)."""
    from sm120patch.targets import finding

    out = []
    for kind in ("sglang", "flashinfer"):
        try:
            found = finding.find_quiet(kind, None, required=False, stated=(stated or {}).get(kind))
        except Sm120Error:
            found = None
        if found is not None:
            out.append(found)
    return out


def _in(spec: str, value: str | int) -> bool:
    try:
        return SpecifierSet(spec).contains(Version(str(value)), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def _release_in(spec: str, version: str) -> bool:
    """Whether `version`, as its release (0.5.9.post1 and 0.5.9.dev3+gabc count as 0.5.9, as
    the pins do), is inside `spec`."""
    try:
        return versions.contains(spec, versions.base_release(version))
    except InvalidSpecifier:
        return False


def _names(value: Any) -> list[str]:
    return [str(v).lower() for v in (value if isinstance(value, list) else [value])]


def matches(entry: Entry, profile: str | None, box: Box, cat: Catalog | None = None) -> bool:
    c = entry.condition
    if profile is not None and not _profile_matches(c, profile, cat):
        return False
    for kind in ("sglang", "flashinfer", "vllm"):
        # A condition on a release this box does not have (FlashInfer not installed, say)
        # does not describe this box.
        if kind in c and (kind not in box.versions or not _release_in(c[kind], box.versions[kind])):
            return False
    if "gpu_family" in c and box.gpu_family and c["gpu_family"].lower() != box.gpu_family:
        return False
    if "gpus" in c and box.gpus is not None and not _in(c["gpus"], box.gpus):
        return False
    if "tp" in c and box.tp is not None and not _in(c["tp"], box.tp):
        return False
    if "quantization" in c and box.quantization:
        if box.quantization.lower() not in _names(c["quantization"]):
            return False
    if "architecture" in c and box.architecture:
        if not {a.lower() for a in box.architecture} & set(_names(c["architecture"])):
            return False
    return True


def _profile_matches(c: dict[str, Any], profile: str, cat: Catalog | None) -> bool:
    if "profile" not in c and "patch" not in c:
        return True
    cat = _catalog(cat)
    have = set(cat.profiles[profile].patches) if profile in cat.profiles else set()
    if "patch" in c:
        return c["patch"] in have
    if c["profile"] == profile:
        return True
    theirs = cat.profiles.get(c["profile"])
    return theirs is not None and set(theirs.patches) <= have


def flag(command: Sequence[str], *names: str) -> str | None:
    for i, part in enumerate(command):
        for name in names:
            if part == name and i + 1 < len(command):
                return command[i + 1]
            if part.startswith(name + "="):
                return part.split("=", 1)[1]
    return None


class Trial(Protocol):
    """What the known lines read of a recorded trial (`engine.trialrecord.TrialRecord`)."""

    @property
    def key(self) -> str: ...
    @property
    def profile(self) -> str: ...
    @property
    def verdict(self) -> str: ...
    @property
    def kind(self) -> str | None: ...
    @property
    def evidence(self) -> bool | None: ...
    @property
    def started(self) -> float | None: ...
    @property
    def gain(self) -> float | None: ...
    @property
    def message(self) -> str | None: ...
    @property
    def measured(self) -> Mapping[str, Any]: ...


T = TypeVar("T", bound=Trial)


def recorded_evidence(trial: Trial) -> bool:
    """Whether a trial is evidence, as recorded: what it said of itself when it was recorded.
    A record older than that field is evidence where its verdict alone says so (a plain
    trial's crash, a wrong output, a crash of the patched side); its keep or slower is not
    judged again here (`sm120patch trial show` and an export judge it)."""
    if trial.evidence is not None:
        return trial.evidence
    if trial.kind != "measured":
        return trial.verdict in ("crashed", "timeout")
    if trial.verdict == "reverted-wrong-output":
        return True
    runs = [r for r in trial.measured.get("runs") or [] if isinstance(r, dict)]
    if trial.verdict == "crashed":
        return any(r.get("side") == "patched" and r.get("outcome") != "ok" for r in runs)
    return False


def local_lines(trials: Sequence[Trial], profile: str | None) -> list[str]:
    """A user's own measured trials that were evidence when recorded (`recorded_evidence`),
    shown before the next apply or trial."""
    lines = []
    for t in trials:
        if t.kind != "measured" or (profile is not None and t.profile != profile):
            continue
        if not recorded_evidence(t):
            continue
        day = time.strftime("%Y-%m-%d", time.localtime(t.started or 0))
        change = f" {100 * t.gain:+.0f}%" if t.gain is not None else ""
        lines.append(
            f"you measured {t.profile}{change} on this box on {day}: {t.verdict} ({t.message})"
        )
    return lines


def once_each(trials: Iterable[T]) -> list[T]:
    """Each trial once (a trial of a profile spanning SGLang and FlashInfer is kept on both
    targets), oldest first."""
    seen: dict[str, T] = {}
    for t in trials:
        seen.setdefault(t.key, t)
    return sorted(seen.values(), key=lambda t: t.started or 0)


def lines(
    profile: str | None,
    box: Box,
    trials: Sequence[Trial] = (),
    *,
    verbose: bool = False,
    cat: Catalog | None = None,
) -> list[str]:
    """The known entries matching `box` (a short line each, or in full with `verbose`), then
    this box's own measured trials."""
    mine = local_lines(trials, profile)
    cat = _catalog(cat)
    return once(
        [
            e.full() if verbose else e.line()
            for e in entries(cat=cat)
            if matches(e, profile, box, cat)
        ]
        + (mine if verbose else [cut(line) for line in mine])
    )


def _spaced(spec: Any) -> str:
    """`==4` as `== 4`, `>=0.6.3,<0.6.13` as `>= 0.6.3, < 0.6.13`: a range a person reads."""
    return ", ".join(
        re.sub(r"^([<>=!~]+)\s*", r"\1 ", part.strip()) for part in str(spec).split(",")
    )


def once(lines: Iterable[str]) -> list[str]:
    """Each line once, in order: two entries of one verdict print one line per command."""
    return list(dict.fromkeys(lines))


def cut(line: str) -> str:
    """`line` in SHORT characters at most."""
    return line if len(line) <= SHORT else line[: SHORT - 3] + "..."
