"""What a plan is: per target the files the patches change, their outcomes, the diff."""

from __future__ import annotations

from dataclasses import dataclass, field

from sm120patch.errors import Refused
from sm120patch.patchkit.model import Outcome, Status
from sm120patch.patchkit.runner import FileResult
from sm120patch.plan.catalog import Catalog, Profile
from sm120patch.plan.diffs import unified_diff
from sm120patch.targets import Target


class PlanRefused(Refused):
    """The plan has refused sites; nothing was touched."""

    def __init__(self, plan: Plan, *, dry_run: bool = False) -> None:
        lines = [o.describe() for o in plan.refused]
        name = plan.profile.name
        super().__init__(
            f"profile {name} refused at {len(lines)} site(s): " + "; ".join(lines),
            # The dry run is the command that shows every site: it points on, not at itself.
            f"nothing was changed; the refusal says why; `sm120patch show {name}` describes "
            "the profile and what to use instead"
            if dry_run
            else f"nothing was changed; `sm120patch apply {name} --dry-run` shows every site",
            {"outcomes": [o.to_dict() for o in plan.outcomes]},
        )
        self.plan = plan


@dataclass
class TargetPlan:
    target: Target
    files: list[FileResult] = field(default_factory=list)

    @property
    def changed(self) -> list[FileResult]:
        return [f for f in self.files if f.changed]


@dataclass
class Plan:
    profile: Profile
    targets: list[TargetPlan]
    outcomes: list[Outcome]
    outside_pins: list[str] = field(default_factory=list)
    # The catalog the profile is of (the command's packs): what the patches named here are.
    catalog: Catalog = field(kw_only=True, compare=False, repr=False)

    @property
    def refused(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status is Status.REFUSED]

    @property
    def applies(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status is Status.APPLIED]

    def diff(self) -> str:
        return "".join(unified_diff(tp.target, f) for tp in self.targets for f in tp.changed)

    def to_dict(self) -> dict[str, object]:
        return {
            "profile": self.profile.name,
            "targets": [tp.target.to_dict() for tp in self.targets],
            "outside_pins": self.outside_pins,
            "outcomes": [o.to_dict() for o in self.outcomes],
            "diff": self.diff(),
        }
