"""Known outcomes (patches/known.toml) and this box's own measured trials, matched to the box.

An entry's condition names what it applies to (profile or patch, SGLang and FlashInfer ranges,
GPU family and count, TP size, quantization, model architecture). A condition the box cannot
tell (no GPU visible, no server command to read the TP size from) does not exclude the entry:
better one line too many before a trial than a known regression unsaid.

Each entry also says what its figure rests on (`evidence`: measured, reported, inferred, or
unpublished for the field report this project started from) and what was run, in the
source's terms (`measured`: engine, kernel, TP, runs), and the sentence or figure of the source
it relies on (`quote`, required of the built-in library); all are printed with it. A wrong-output
entry about a profile that matches the box condemns the profile there: `doctor` and `list`
stop recommending it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sm120patch.errors import Sm120Error, UsageError
from sm120patch.patchkit import versions

if TYPE_CHECKING:
    from sm120patch.engine.assess import TargetStatus
    from sm120patch.engine.trialrecord import TrialRecord
    from sm120patch.trial import gpu

OUTCOMES = ("faster", "slower", "no-gain", "wrong-output", "crash")
CONDITIONS = (
    "profile",
    "patch",
    "sglang",
    "flashinfer",
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
EVIDENCE = ("measured", "reported", "inferred", "unpublished")
# What was run, in the source's terms; the sentence or figure of the source the entry relies on
# (required of the built-in library, `QUOTED`: a pack's own entries may leave it out).
OPTIONAL = ("measured", "quote")
QUOTED = "quote"
# The most characters of a known line before a command's output (a diff, a table): one line a
# reader takes in; the whole entry is `sm120patch show PROFILE` (or the command's --verbose).
SHORT = 120

# verdict of a trial that is evidence (`evidence`) -> outcome of a record
_OUTCOME_OF = {
    "kept": "faster",
    "reverted-slower": "slower",
    "reverted-wrong-output": "wrong-output",
    "crashed": "crash",
    "timeout": "crash",
}


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

    @property
    def about(self) -> str:
        return self.condition.get("profile") or self.condition.get("patch") or "any profile"

    def _where(self, keys: Sequence[str]) -> str:
        return ", ".join(
            f"{k} {v}" if k in ("sglang", "flashinfer", "gpus", "tp") else str(v)
            for k, v in self.condition.items()
            if k in keys
        )

    def line(self) -> str:
        """One short line (SHORT characters at most): verdict, what it is about, where. The
        figure, what was run and the source are `full()`'s (`sm120patch show PROFILE`)."""
        head = f"known: {self.about} {self.outcome} ({self.evidence})"
        where = self._where(("sglang", "flashinfer", "gpu_family", "gpus", "tp"))
        return _cut(f"{head}: {where}" if where else head)

    def full(self) -> str:
        """The whole entry: the figure, what was run, every condition, date and source."""
        where = self._where([k for k in self.condition if k not in ("profile", "patch")])
        ran = f" [{self.measured}]" if self.measured else ""
        said = f': "{self.quote}"' if self.quote else ""
        return (
            f"known: {self.about} {self.outcome} ({self.evidence}): {self.figure}{ran} "
            f"({where}; {self.date}; {self.source}; id {self.id}{said})"
        )

    def condemns(self, profile: str, box: Box) -> bool:
        """Whether this entry says `profile` gives wrong output on `box`: a wrong-output
        entry about the profile (or a patch of it) whose condition matches. An entry about
        every server (a FlashInfer bug) does not condemn one profile more than not applying
        it."""
        about = "profile" in self.condition or "patch" in self.condition
        return self.outcome == "wrong-output" and about and matches(self, profile, box)


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
    text: str | None = None, where: str = "known.toml", *, quoted: bool = False
) -> list[Entry]:
    """The known outcomes of `text`, or of the built-in library and every pack loaded (each
    pack's own known.toml beside its profiles.toml). The built-in library's entries, and with
    `quoted` those of `text`, must each carry a `quote` of their source (`check_quotes`)."""
    from sm120patch.plan import catalog

    if text is None:
        out = []
        for pack in catalog.load().loaded:
            path = Path(pack.location, "known.toml") if pack.location else None
            if path is not None and path.is_file():
                hint = catalog.DAMAGED_HINT if pack.built_in else f"fix {path}, or drop the pack"
                found = _parse(path.read_text(encoding="utf-8"), str(path), hint)
                if pack.built_in:
                    check_quotes(found, str(path), hint)
                out += found
        return out
    found = _parse(text, where, "fix the file")
    if quoted:
        check_quotes(found, where, "fix the file")
    return found


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


def _parse(text: str, where: str, hint: str) -> list[Entry]:
    from sm120patch.plan import catalog

    doc = catalog.parse_toml(text, where, hint)
    out = []
    for raw in doc.get("outcome", []):
        missing = [k for k in RECORD if not raw.get(k)]
        unknown = set(raw) - set(RECORD) - set(OPTIONAL) - set(CONDITIONS)
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if unknown:
            problems.append(f"unknown keys {', '.join(sorted(unknown))}")
        if not missing and raw["outcome"] not in OUTCOMES:
            problems.append(f"outcome must be one of {', '.join(OUTCOMES)}")
        if not missing and raw["evidence"] not in EVIDENCE:
            problems.append(f"evidence must be one of {', '.join(EVIDENCE)}")
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
            )
        )
    return out


def about_profile(profile: str, found: Sequence[Entry] | None = None) -> list[Entry]:
    """Every known entry about `profile` (or a patch of it, or any profile), whatever the box:
    what `show PROFILE` prints in full."""
    return [e for e in (entries() if found is None else found)
            if _profile_matches(e.condition, profile)]  # fmt: skip


def condemning(profile: str, box: Box, found: Sequence[Entry] | None = None) -> list[Entry]:
    """The known entries that say `profile` gives wrong output on `box` (`Entry.condemns`)."""
    return [e for e in (entries() if found is None else found) if e.condemns(profile, box)]


def installed_targets() -> list[Any]:
    """The SGLang and FlashInfer installed in this interpreter (those found)."""
    from sm120patch import targets

    out = []
    for kind in ("sglang", "flashinfer"):
        try:
            found = targets.find_quiet(kind, None, required=False)
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
    """Whether `version`, as its release (0.5.9.post1 and 0.5.9+gabc count as 0.5.9, a dev
    build does not, as the pins do: `versions.base_release`), is inside `spec`."""
    try:
        return versions.contains(spec, versions.base_release(version))
    except InvalidSpecifier:
        return False


def _names(value: Any) -> list[str]:
    return [str(v).lower() for v in (value if isinstance(value, list) else [value])]


def matches(entry: Entry, profile: str | None, box: Box) -> bool:
    c = entry.condition
    if profile is not None and not _profile_matches(c, profile):
        return False
    for kind in ("sglang", "flashinfer"):
        # A condition on a release this box does not have (FlashInfer not installed, say)
        # does not describe this box.
        if kind in c and (
            kind not in box.versions or not _release_in(c[kind], box.versions[kind])
        ):
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


def _profile_matches(c: dict[str, Any], profile: str) -> bool:
    from sm120patch.plan import catalog

    if "profile" not in c and "patch" not in c:
        return True
    cat = catalog.load()
    have = set(cat.profiles[profile].patches) if profile in cat.profiles else set()
    if "patch" in c:
        return c["patch"] in have
    if c["profile"] == profile:
        return True
    theirs = cat.profiles.get(c["profile"])
    return theirs is not None and set(theirs.patches) <= have


def _flag(command: Sequence[str], *names: str) -> str | None:
    for i, part in enumerate(command):
        for name in names:
            if part == name and i + 1 < len(command):
                return command[i + 1]
            if part.startswith(name + "="):
                return part.split("=", 1)[1]
    return None


def box_of(
    paths: Mapping[str, str | Path | None],
    command: Sequence[str] = (),
    read_gpus: Callable[[], gpu.GpuInventory] | None = None,
    statuses: Sequence[TargetStatus] | None = None,
) -> Box:
    """This box, as known.toml's conditions read it. `read_gpus`: how to read the GPUs (a command
    that also checks them passes its own, so that NVML starts once: a tenth of a second).
    `statuses`: the targets' `assess.status(paths)`, where the caller has it (`lines`)."""
    from sm120patch.trial import gpu as nvml  # imported here: most commands never read known.toml

    if statuses is None:
        statuses = _status_or_none(paths)
    versions: dict[str, str] = {s.target.kind: s.target.version for s in statuses or ()}
    found = (read_gpus or nvml.read_gpus)()
    tp = _flag(command, "--tp", "--tp-size", "--tensor-parallel-size")
    model = _flag(command, "--model-path", "--model")
    architecture = None
    if model and (Path(model) / "config.json").is_file():
        try:
            doc = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
            architecture = [str(a) for a in doc.get("architectures") or []] or None
        except (OSError, ValueError):
            architecture = None
    return Box(
        versions=versions,
        gpu_family=found.family,
        gpus=len(found.gpus) or None,
        tp=int(tp) if tp and tp.isdigit() else None,
        quantization=_flag(command, "--quantization"),
        architecture=architecture,
    )


def evidence(trial: TrialRecord) -> bool:
    """Whether a recorded trial says something about its patch: a measured trial that kept,
    was slower beyond the noise, gave wrong output, or crashed on its patched side; a plain
    trial that crashed. Never an inconclusive, inert or unreachable one. A keep or a slower
    is evidence only where this release's rule reaches it on the trial's own figures
    (`_decided_again`): records written under a looser rule are judged by today's. Records
    written before trials said whether they were evidence are judged by the same rule."""
    verdict = trial.verdict
    if trial.is_measured and verdict in ("kept", "reverted-slower"):
        return trial.evidence is not False and _decided_again(trial)
    if trial.evidence is not None:
        return trial.evidence
    if not trial.is_measured:
        return verdict in ("crashed", "timeout")
    # The runs are rendered data (`TrialRecord.measured`), checked on read: each has a side
    # and an outcome.
    runs = [r for r in trial.measured.get("runs") or [] if isinstance(r, dict)]
    if verdict == "reverted-wrong-output":
        return True
    if verdict == "crashed":
        return any(r.get("side") == "patched" and r.get("outcome") != "ok" for r in runs)
    return False


def _decided_again(trial: TrialRecord) -> bool:
    """Whether this release's rule (`decide.decide_gain`), on the figures the trial recorded,
    reaches the keep or the slower it recorded: a record written under an earlier, looser rule
    (one run a side, a noise it underestimated) is evidence only where today's rule agrees."""
    from sm120patch.trial import decide

    options = trial.measured.get("options")
    options = options if isinstance(options, dict) else {}
    figure = options.get("figure")
    figure = figure if figure in decide.FIGURES else "output_tok_s"
    min_gain = options.get("min_gain")
    if not isinstance(min_gain, (int, float)) or isinstance(min_gain, bool):
        min_gain = 0.02
    runs = [r for r in trial.measured.get("runs") or [] if isinstance(r, dict)]

    def values(side: str) -> list[float]:
        return [
            float((r.get("figures") or {}).get(figure) or 0.0)
            for r in runs
            if r.get("side") == side
        ]

    decided = decide.decide_gain(
        values("baseline"), values("patched"), decide.FIGURES[figure][1], float(min_gain)
    )
    return decided.verdict == trial.verdict


def history(paths: Mapping[str, str | Path | None]) -> list[TrialRecord]:
    """Every recorded trial on these targets, once each (a trial of a profile spanning SGLang
    and FlashInfer is kept on both), oldest first."""
    from sm120patch.engine import assess

    return _history_of(assess.status(paths))


def _history_of(statuses: Sequence[TargetStatus]) -> list[TrialRecord]:
    seen: dict[str, TrialRecord] = {}
    for status in statuses:
        for t in status.trials:
            seen.setdefault(t.key, t)
    return sorted(seen.values(), key=lambda t: t.started or 0)


def _status_or_none(paths: Mapping[str, str | Path | None]) -> list[TargetStatus] | None:
    """`assess.status(paths)`, or None where it refuses (the box is then read without the
    targets' versions, and without their trials)."""
    from sm120patch.engine import assess

    try:
        return assess.status(paths)
    except Sm120Error:
        return None


def forget(
    paths: Mapping[str, str | Path | None], trial_ids: Sequence[str], everything: bool = False
) -> list[str]:
    """Remove recorded trials (each ID or a unique prefix of one; every trial with
    `everything`) from every target that holds them; the ids removed, oldest first."""
    from sm120patch.engine import trials as kept

    trials = history(paths)
    if everything:
        chosen = trials
    else:
        if not trial_ids:
            raise UsageError("give the trial ID to forget, or --all")
        chosen = [find_trial(trials, tid) for tid in trial_ids]
    keys = {t.key for t in chosen}
    kept.forget_trials(paths, keys)
    return [t.key for t in trials if t.key in keys]


def find_trial(trials: list[TrialRecord], trial_id: str | None) -> TrialRecord:
    from sm120patch.errors import Refused

    if not trials:
        raise Refused("no trial recorded on these targets", "run `sm120patch trial ...` first")
    if trial_id is None:
        return trials[-1]
    hits = [t for t in trials if (t.id or "").startswith(trial_id)]
    if len(hits) != 1:
        ids = ", ".join(str(t.id) for t in trials[-5:])
        raise UsageError(
            f"{'no' if not hits else 'more than one'} trial matches {trial_id!r}",
            f"the latest are: {ids}",
        )
    return hits[0]


def local_lines(trials: list[TrialRecord], profile: str | None) -> list[str]:
    """A user's own measured trials that are evidence (`evidence`), shown before the next one."""
    lines = []
    for t in trials:
        if not t.is_measured or (profile is not None and t.profile != profile):
            continue
        if not evidence(t):
            continue
        day = time.strftime("%Y-%m-%d", time.localtime(t.started or 0))
        change = f" {100 * t.gain:+.0f}%" if t.gain is not None else ""
        lines.append(
            f"you measured {t.profile}{change} on this box on {day}: {t.verdict} ({t.message})"
        )
    return lines


def lines(
    profile: str | None,
    paths: Mapping[str, str | Path | None],
    command: Sequence[str] = (),
    read_gpus: Callable[[], gpu.GpuInventory] | None = None,
    verbose: bool = False,
) -> list[str]:
    """The known entries matching this box (a short line each, or in full with `verbose`),
    then this box's own measured trials. The targets are looked up once for both (finding a
    checkout runs git)."""
    statuses = _status_or_none(paths)
    box = box_of(paths, command, read_gpus, statuses=[] if statuses is None else statuses)
    out = [e.full() if verbose else e.line() for e in entries() if matches(e, profile, box)]
    if statuses is not None:
        try:
            mine = local_lines(_history_of(statuses), profile)
            out += mine if verbose else [_cut(line) for line in mine]
        except Sm120Error:
            pass
    return out


def _cut(line: str) -> str:
    return line if len(line) <= SHORT else line[: SHORT - 3] + "..."


def _toml_value(value: Any) -> str:
    # JSON strings are valid TOML basic strings; TOML arrays of strings likewise.
    return json.dumps(value, ensure_ascii=False)


def outcome_record(trial: TrialRecord) -> str:
    """One `[[outcome]]` record in known.toml's schema from a recorded trial."""
    verdict = trial.verdict
    outcome = _OUTCOME_OF.get(verdict) if evidence(trial) else None
    if outcome is None:
        raise UsageError(
            f"trial {trial.id} ({verdict}) is not evidence: it says nothing another "
            "box can use",
            "export a measured trial that was kept or slower beyond the noise (as this "
            "release's rule reads its figures), that gave wrong output, or a crash of the "
            "patched side",
        )
    command = trial.command
    record: dict[str, Any] = {"id": f"local-{trial.profile}-{trial.id}"}
    record["profile"] = trial.profile
    for kind, version in trial.versions.items():
        record[kind] = f"=={version}"
    if trial.gpu_family:
        record["gpu_family"] = trial.gpu_family
    if trial.gpu_names:
        record["gpus"] = f"=={len(trial.gpu_names)}"
    tp = _flag(command, "--tp", "--tp-size", "--tensor-parallel-size")
    if tp:
        record["tp"] = f"=={tp}"
    quant = _flag(command, "--quantization")
    if quant:
        record["quantization"] = quant
    if trial.gpu_names:
        counts = Counter(trial.gpu_names)
        record["topology"] = ", ".join(f"{n} x {name}" for name, n in counts.items())
    record["outcome"] = outcome
    record["evidence"] = "measured"
    record["measured"] = f"sm120patch trial of profile {trial.profile} on this box"
    record["figure"] = trial.message or f"{verdict}, exit {trial.exit_code}"
    record["date"] = time.strftime("%Y-%m-%d", time.localtime(trial.started or 0))
    record["source"] = f"sm120patch trial {trial.id}: {' '.join(command)}"
    # The trial is its own source: its verdict line is the figure the entry relies on.
    record[QUOTED] = record["figure"]
    body = "\n".join(f"{k} = {_toml_value(v)}" for k, v in record.items())
    return f"# exported by sm120patch; add it to patches/known.toml\n[[outcome]]\n{body}\n"
