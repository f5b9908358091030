"""Where a trial's record is kept: on every target of its profile, beside the state, across
reverts."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sm120patch import targets
from sm120patch.engine.store import TargetState
from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import Refused
from sm120patch.plan import catalog
from sm120patch.targets import Target
from sm120patch.targets.resolved import Given, owned


def recorded(found: Iterable[Target]) -> list[TrialRecord]:
    """The trials recorded on each of `found`, target by target (a trial of a profile spanning
    both targets is on both): what a command shows of this box without assessing a target."""
    return [
        t
        for target in found
        for t in TargetState.of(target.root, target.layout, target.kind, target.handle).trials()
    ]


def record_trial(given: Given, profile: str, trial: TrialRecord) -> None:
    """Keep a trial's record on every target of its profile (it survives the revert)."""
    with owned(given) as named:
        for kind in catalog.load(named.config).profile(profile).targets:
            target = named.quiet(kind, required=False)
            if target is None:
                continue
            st = TargetState.of(target.root, target.layout, target.kind, target.handle)
            with st.locked():
                try:
                    st.add_trial(trial)
                except OSError as exc:
                    # A full disk: one line, the trees are as the trial left them.
                    raise Refused(
                        f"cannot record the trial in {st.dir} ({exc.strerror})",
                        "free some space; `sm120patch status` shows the trees",
                    ) from None


def forget_trials(given: Given, keys: Collection[str]) -> int:
    """Remove the trials named by `keys` (`TrialRecord.key`) from every target of the command
    (`given`; a trial is kept on each target of its profile); how many records went."""
    dropped = 0
    with owned(given) as named:
        for target in named.each(targets.KINDS):
            st = TargetState.of(target.root, target.layout, target.kind, target.handle)
            if not any(t.key in keys for t in st.trials()):
                continue  # nothing to remove: no lock taken, no state directory made
            with st.locked():
                dropped += st.drop_trials(keys)
        return dropped
