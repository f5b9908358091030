"""What an engine command returns: a typed report per target and for the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sm120patch.patchkit.model import Outcome
from sm120patch.plan.plans import Plan
from sm120patch.targets import Target


@dataclass
class TargetReport:
    target: Target
    branch: str | None = None
    commits: list[str] = field(default_factory=list)
    files: list[dict[str, str]] = field(default_factory=list)
    state: str | None = None  # the target's state when the command finished

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.target.to_dict(),
            "branch": self.branch,
            "commits": self.commits,
            "files": self.files,
            "state": self.state,
        }


@dataclass
class Report:
    # "applied", "nothing-to-do", "reverted", "dropped" (only stale records), "recovered"
    action: str
    profile: str | None
    targets: list[TargetReport]
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: Plan | None = None
    # A `revert --dry-run`: what the revert would do (`action`) and write (`restores`, a diff
    # from the bytes on disk to the restored ones); nothing was changed.
    dry_run: bool = False
    restores: str = ""

    @property
    def changed(self) -> bool:
        return self.action in ("applied", "reverted", "recovered")

    def to_dict(self) -> dict[str, Any]:
        diff = self.plan.diff() if self.plan is not None and self.action == "applied" else ""
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
