"""The trial wing's side of known outcomes: this box as a trial's server command and the GPUs
describe it (`box_of`), the trial history (`history`, `forget`, `find_trial`), and a recorded
trial exported as a known.toml record (`outcome_record`, judged again by this release's rule:
`evidence`). The entries themselves and their matching are data the plan wing reads
(`plan.known`), so that `apply` shows them without entering this wing.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch.errors import Sm120Error, UsageError
from sm120patch.plan.known import QUOTED, Box, cut, local_lines, matches, once, once_each
from sm120patch.plan.known import entries as known_entries
from sm120patch.trial import engines

if TYPE_CHECKING:
    from sm120patch.engine.assess import TargetStatus
    from sm120patch.engine.trialrecord import TrialRecord
    from sm120patch.plan.catalog import Catalog
    from sm120patch.targets.resolved import Given
    from sm120patch.trial import gpu

# verdict of a trial that is evidence (`evidence`) -> outcome of a record
_OUTCOME_OF = {
    "kept": "faster",
    "reverted-slower": "slower",
    "reverted-wrong-output": "wrong-output",
    "crashed": "crash",
    "timeout": "crash",
}


def box_of(
    paths: Given,
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
    tp, model = engines.tp(command), engines.model_path(command)
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
        quantization=engines.quantization(command),
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


def history(paths: Given) -> list[TrialRecord]:
    """Every recorded trial on these targets, once each (a trial of a profile spanning SGLang
    and FlashInfer is kept on both), oldest first."""
    from sm120patch.engine import assess

    return _history_of(assess.status(paths))


def _history_of(statuses: Sequence[TargetStatus]) -> list[TrialRecord]:
    return once_each(t for status in statuses for t in status.trials)


def _status_or_none(paths: Given) -> list[TargetStatus] | None:
    """`assess.status(paths)`, or None where it refuses (the box is then read without the
    targets' versions, and without their trials)."""
    from sm120patch.engine import assess

    try:
        return assess.status(paths)
    except Sm120Error:
        return None


def forget(paths: Given, trial_ids: Sequence[str], everything: bool = False) -> list[str]:
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


def lines(
    profile: str | None,
    paths: Given,
    command: Sequence[str] = (),
    read_gpus: Callable[[], gpu.GpuInventory] | None = None,
    verbose: bool = False,
    statuses: Sequence[TargetStatus] | None = None,
    cat: Catalog | None = None,
) -> list[str]:
    """The known entries matching this box, then this box's own measured trials, for a trial's
    command (and `doctor`). The targets are assessed once for both, or not at all where the
    caller has their `statuses`. `cat`: the command's catalog (None: the environment's)."""
    if statuses is None:
        statuses = _status_or_none(paths)
    box = box_of(paths, command, read_gpus, statuses=[] if statuses is None else statuses)
    if cat is None:
        from sm120patch.plan import catalog
        from sm120patch.targets.resolved import resolved

        cat = catalog.load(resolved(paths).config)
    out = [
        e.full() if verbose else e.line()
        for e in known_entries(cat=cat)
        if matches(e, profile, box, cat)
    ]
    if statuses is not None:
        try:
            mine = local_lines(_history_of(statuses), profile)
            out += mine if verbose else [cut(line) for line in mine]
        except Sm120Error:
            pass
    return once(out)


def _toml_value(value: Any) -> str:
    # JSON strings are valid TOML basic strings; TOML arrays of strings likewise.
    return json.dumps(value, ensure_ascii=False)


def outcome_record(trial: TrialRecord, cat: Catalog) -> str:
    """One `[[outcome]]` record in known.toml's schema from a recorded trial (its profile as
    the command's catalog, `cat`, has it)."""
    verdict = trial.verdict
    outcome = _OUTCOME_OF.get(verdict) if evidence(trial) else None
    if outcome is None:
        raise UsageError(
            f"trial {trial.id} ({verdict}) is not evidence: it says nothing another box can use",
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
    tp = engines.tp(command)
    if tp:
        record["tp"] = f"=={tp}"
    quant = engines.quantization(command)
    if quant:
        record["quantization"] = quant
    if trial.gpu_names:
        counts = Counter(trial.gpu_names)
        record["topology"] = ", ".join(f"{n} x {name}" for name, n in counts.items())
    record["outcome"] = outcome
    record["evidence"] = "measured"
    # What ran: the profile's own engine and kernel, the patch alone differing between the
    # two sides of a measured trial (known.toml's check derives "measured" from exactly that).
    prof = cat.profiles.get(trial.profile)
    if prof is not None:
        record["engine"] = prof.engine
        if prof.kernel:
            record["kernel"] = prof.kernel[0]
    record["differs"] = ["patch"]
    record["against"] = "the same server without the profile"
    record["measured"] = f"sm120patch trial of profile {trial.profile} on this box"
    record["figure"] = trial.message or f"{verdict}, exit {trial.exit_code}"
    record["date"] = time.strftime("%Y-%m-%d", time.localtime(trial.started or 0))
    record["source"] = f"sm120patch trial {trial.id}: {' '.join(command)}"
    # The trial is its own source: its verdict line is the figure the entry relies on.
    record[QUOTED] = record["figure"]
    body = "\n".join(f"{k} = {_toml_value(v)}" for k, v in record.items())
    return f"# exported by sm120patch; add it to patches/known.toml\n[[outcome]]\n{body}\n"
