"""Where a trial's record is kept: on every target of its profile, beside the state, across
reverts."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from sm120patch import targets
from sm120patch.engine.store import TargetState
from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import Refused
from sm120patch.plan import catalog


def record_trial(
    paths: Mapping[str, str | Path | None], profile: str, trial: TrialRecord
) -> None:
    """Keep a trial's record on every target of its profile (it survives the revert)."""
    for kind in catalog.load().profile(profile).targets:
        target = targets.find_quiet(kind, paths.get(kind), required=False)
        if target is None:
            continue
        st = TargetState.of(target.root, target.layout, target.kind)
        with st.locked():
            try:
                st.add_trial(trial)
            except OSError as exc:  # a full disk: one line, the trees are as the trial left them
                raise Refused(
                    f"cannot record the trial in {st.dir} ({exc.strerror})",
                    "free some space; `sm120patch status` shows the trees",
                ) from None


def forget_trials(paths: Mapping[str, str | Path | None], keys: Collection[str]) -> int:
    """Remove the trials named by `keys` (`TrialRecord.key`) from every target found in
    `paths` (a trial is kept on each target of its profile); how many records went."""
    dropped = 0
    for kind in targets.KINDS:
        target = targets.find_quiet(kind, paths.get(kind), required=paths.get(kind) is not None)
        if target is None:
            continue
        st = TargetState.of(target.root, target.layout, target.kind)
        if not any(t.key in keys for t in st.trials()):
            continue  # nothing to remove: no lock taken, no state directory made
        with st.locked():
            dropped += st.drop_trials(keys)
    return dropped
