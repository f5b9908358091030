"""What an engine command returns: a typed report per target and for the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from sm120patch.engine.assess import State
from sm120patch.targets import Target

if TYPE_CHECKING:  # `ensure` on an applied tree reports without a plan module
    from sm120patch.patchkit.model import Outcome
    from sm120patch.plan.plans import Plan


@dataclass(frozen=True)
class ReportedFile:
    """A file the command wrote: an apply leaves it patched, a revert pristine."""

    path: str  # relative to the target root
    state: Literal["patched", "pristine"]

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "state": self.state}


@dataclass
class TargetReport:
    target: Target
    branch: str | None = None
    commits: list[str] = field(default_factory=list)
    files: list[ReportedFile] = field(default_factory=list)
    state: State | None = None  # the target's state when the command finished

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.target.to_dict(),
            "branch": self.branch,
            "commits": self.commits,
            "files": [f.to_dict() for f in self.files],
            "state": self.state,
        }


class Action(str, Enum):
    """What an engine command did."""

    APPLIED = "applied"
    NOTHING_TO_DO = "nothing-to-do"
    REVERTED = "reverted"
    DROPPED = "dropped"  # only stale records went
    RECOVERED = "recovered"

    def __str__(self) -> str:
        return self.value


@dataclass
class Report:
    action: Action
    profile: str | None
    targets: list[TargetReport]
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: Plan | None = None
    # A `revert --dry-run`: what the revert would do (`action`) and write (`restores`, a diff
    # from the bytes on disk to the restored ones); nothing was changed.
    dry_run: bool = False
    restores: str = ""
    # An apply: the targets it left without a record of the profile (kind -> why), which
    # `ensure` refuses; its other targets are as wanted, as it wrote and verified them.
    unrecorded: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.action in (Action.APPLIED, Action.REVERTED, Action.RECOVERED)

    def to_dict(self) -> dict[str, Any]:
        diff = self.plan.diff() if self.plan is not None and self.action is Action.APPLIED else ""
        return {
            "action": self.action,
            "changed": self.changed,
            "dry_run": self.dry_run,
            "profile": self.profile,
            "targets": [t.to_dict() for t in self.targets],
            "outcomes": [o.to_dict() for o in self.outcomes],
            "notes": self.notes,
            # What an apply wrote, as the dry run showed it (a fleet's diff mode needs no
            # second call); what a revert would write back, for its dry run.
            "diff": self.restores if self.dry_run else diff,
        }
