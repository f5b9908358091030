"""`doctor`: the GPUs, the targets found, and what each profile would do here. Reads only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sm120patch import targets
from sm120patch.engine import assess
from sm120patch.errors import Sm120Error
from sm120patch.patchkit.kinds import LOOKED_FOR
from sm120patch.patchkit.model import TARGETS
from sm120patch.plan import catalog, pins, planner
from sm120patch.targets.resolved import Given, owned
from sm120patch.trial import gpu


@dataclass
class ProfileCheck:
    name: str
    status: str
    pinned: bool | None
    problems: list[str] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # releases the profile refuses here
    # wrong-output known entries about this profile that match this box
    condemned: list[str] = field(default_factory=list)
    # the one verdict on this box (`verdict()`), and the profile's applied here, if it is
    verdict: str = ""
    applied_on: list[str] = field(default_factory=list)
    # upstream's own flag with the same effect on one launch, and why the patch still helps
    flag: str = ""

    def decide(self) -> None:
        """One verdict per profile, from the most to the least binding: a profile refused here
        shows no planned rows (it would write nothing), one outside its pins is planned as
        --force would plan it, and the rows of one inside its pins say what it would do."""
        if self.refused:
            self.verdict = f"refused here: {self.refused[0]}"
            self.outcomes = []
        elif self.pinned is None:
            self.verdict = "not checked: " + "; ".join(self.problems)
        elif self.problems and not self.outcomes:
            self.verdict = f"cannot plan: {self.problems[-1]}"
        elif not self.pinned:
            self.verdict = f"outside its pins (--force to apply): {self.problems[0]}"
        elif self.condemned:
            self.verdict = f"wrong output known here: {self.condemned[0]}"
        elif self.applied_on:
            self.verdict = "applied here"
        else:
            statuses = {o["status"] for o in self.outcomes}
            if "refused" in statuses:
                self.verdict = "a site refuses: the apply would refuse"
            elif "applied" in statuses:
                self.verdict = "would apply"
            else:
                self.verdict = "nothing to apply: every site is upstream's or not here"


@dataclass
class Examination:
    gpus: gpu.GpuInventory
    targets: list[dict[str, Any]]
    missing: list[str]
    profiles: list[ProfileCheck]
    applied: list[dict[str, Any]]
    recommendation: str = ""
    known: list[str] = field(default_factory=list)  # known outcomes and trials matching here

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpus.to_dict(),
            "targets": self.targets,
            "missing": self.missing,
            "profiles": [p.__dict__ for p in self.profiles],
            "applied": self.applied,
            "recommendation": self.recommendation,
            "known": self.known,
        }


def examine(paths: Given, verbose: bool = False) -> Examination:
    """The box: its GPUs, its targets (the command's, each found once and assessed once), and
    what each profile would do here."""
    gpus = gpu.read_gpus()
    with owned(paths) as named:
        found: dict[str, targets.Target] = {}
        missing = []
        for kind in (k for k in TARGETS if k in LOOKED_FOR or named.given(k)):
            try:
                found[kind] = named.find(kind)
            except Sm120Error as exc:
                missing.append(f"{targets.DISPLAY[kind]}: {exc.message}")
        checks = []
        cat = catalog.load(named.config)
        profiles = cat.profiles.values()
        # A kind looked for only when named (vLLM), not named: one line saying so, where a profile
        # patches it; its profiles are not checked, for that reason.
        unnamed = {
            k
            for k in TARGETS
            if k not in LOOKED_FOR and not named.given(k) and any(k in p.targets for p in profiles)
        }
        for kind in sorted(unnamed, key=TARGETS.index):
            which = ", ".join(p.name for p in profiles if kind in p.targets)
            missing.append(
                f"{targets.DISPLAY[kind]}: looked for only with --{kind} PATH "
                f"(profiles that patch it: {which})"
            )
        for profile in profiles:
            have = [found[k] for k in profile.targets if k in found]
            check = ProfileCheck(
                profile.name,
                profile.status,
                None,
                flag=profile.flag_sentence(release=False) if profile.flag else "",
            )
            if unnamed & set(profile.targets):
                kind = next(k for k in TARGETS if k in unnamed and k in profile.targets)
                check.problems.append(
                    f"{targets.DISPLAY[kind]} is looked for only with --{kind} PATH"
                )
            elif len(have) < len(profile.targets):
                check.problems.append("needs " + " and ".join(profile.targets) + " to be found")
            else:
                check.problems = pins.check_pins(profile, have, named)
                check.refused = pins.refusal_lines(profile, have, named)
                check.pinned = len(check.problems) == len(check.refused)
                try:
                    plan = planner.plan_admitted(profile.name, have, named)
                    check.outcomes = [o.to_dict() for o in plan.outcomes]
                except Sm120Error as exc:
                    check.problems.append(exc.message)
            checks.append(check)
        statuses = None
        try:
            statuses = assess.status(named)
            applied = [s.to_dict() for s in statuses]
        except Sm120Error as exc:
            applied = [{"problem": exc.message}]
        from sm120patch.plan.known import condemning, entries
        from sm120patch.trial import known

        box = known.box_of(named, read_gpus=lambda: gpus, statuses=statuses)
        shipped = entries(cat=cat)
        on = {a["profile"]: a.get("root", "") for a in applied if a.get("profile")}
        for check in checks:
            check.condemned = [e.line() for e in condemning(check.name, box, shipped, cat)]
            check.applied_on = [root for name, root in on.items() if name == check.name]
            check.decide()
        return Examination(
            gpus,
            [_described(t) for t in found.values()],
            missing,
            checks,
            applied,
            recommendation=recommendation(checks),
            known=_pointed(
                known.lines(
                    None, named, read_gpus=lambda: gpus, verbose=verbose, statuses=statuses, cat=cat
                ),
                verbose,
            ),
        )


# Optional packages a target's profiles use when they are installed beside it: the patch opens a
# backend upstream's own availability check lets through only with the package (vllm-moe's
# B12X MoE and vllm-fp4-gemm's B12X NVFP4 GEMM need `b12x`, `pip install 'vllm[b12x]'`; without
# it the next backend is taken).
BESIDE = {
    "vllm": (
        (
            "b12x",
            "vllm[b12x]",
            "vllm-moe",
            "vllm-moe's B12X MoE backend (and vllm-fp4-gemm's B12X NVFP4 GEMM)",
        ),
    )
}


def _described(target: targets.Target) -> dict[str, Any]:
    """The target's row, and for each optional package of BESIDE whether it is installed in the
    target's site-packages (read from the dist-info names, never imported here)."""
    from sm120patch.targets.installed import installed_beside

    row: dict[str, Any] = dict(target.to_dict())
    beside = []
    for dist, extra, profile, used in BESIDE.get(target.kind, ()):
        version = installed_beside(target, dist)
        if version is None:
            state = (
                f"unknown for a checkout (its Python is not known here); `sm120patch "
                f"explain --{target.kind} PATH --profile {profile}` asks it"
            )
        elif version:
            state = f"installed ({version})"
        else:
            state = f"not installed: {used} falls through (`pip install '{extra}'`)"
        beside.append({"package": dist, "version": version, "state": state, "used_by": used})
    if beside:
        row["beside"] = beside
    return row


def _pointed(lines: list[str], verbose: bool) -> list[str]:
    """The known lines and, when they are short, where they are in full."""
    if verbose or not any(line.startswith("known: ") for line in lines):
        return lines
    where = "known outcomes in full: `sm120patch doctor --verbose`, or `sm120patch show` a profile"
    return [*lines, where]


def recommendation(checks: list[ProfileCheck]) -> str:
    """Which profiles to use here: the recommended ones that are inside their pins, refused on
    nothing and condemned by no wrong-output entry matching this box; the others with why."""
    good, held = [], []
    for c in checks:
        if c.status != "recommended":
            continue
        why = c.refused or c.condemned or ([] if c.pinned else c.problems)
        if why:
            held.append(f"{c.name} is not recommended here: {why[0].rstrip('.')}.")
        else:
            good.append(c.name)
    lines = []
    if good:
        lines.append(f"recommended here: {', '.join(good)}.")
    lines += held
    if not good:
        lines.append("No profile is recommended on this box.")
    # Every profile that is not recommended, read from the catalog (a pack's too). A profile
    # whose status is "refused" only says why a gate stays (vllm-fp8-moe): not one to trial.
    others = [c.name for c in checks if c.status not in ("recommended", "refused")]
    if others:
        lines.append(
            f"Experimental ({', '.join(others)}): for `sm120patch trial`; see the known outcomes."
        )
    refused = [c.name for c in checks if c.status == "refused"]
    if refused:
        shows = ", ".join(f"`sm120patch show {name}`" for name in refused)
        lines.append(f"Refused by design ({', '.join(refused)}): {shows} says why.")
    return " ".join(lines)
