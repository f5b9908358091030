"""The command layer's common ground, in the manner of Alembic's `command.py` and its
`Config`: the `Session` every command works in, and the profile or lock a command is given
(`locked`). What each verb does is in `sm120patch/commands/`, one module per family of verbs
(`tree`, `trial`, `profiles`, `survey`): one plain function per verb over a `Session`, returning
a typed result; none prints (the CLI renders results) and each raises the typed errors of
errors.py.

A `Session` is what every command shares: the targets named on the command line, each found
once (`targets`: the `Target` objects every verb of the engine is given, never a path it would
find again), the patch packs, the catalog loaded once with those packs, and one reading of the
GPUs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sm120patch.errors import UnknownProfile, UsageError

if TYPE_CHECKING:
    from sm120patch.config import Config
    from sm120patch.plan.catalog import Catalog, Profile
    from sm120patch.plan.lockfile import Lock, PlanCheck
    from sm120patch.targets import Target
    from sm120patch.targets.resolved import Resolved
    from sm120patch.trial.gpu import GpuInventory

Lines = Callable[[str], None]


def on_interrupt(notice: Callable[[int, int], None]) -> None:
    """Have `notice(signal, count)` acknowledge each deferred SIGINT/SIGTERM/SIGHUP at once
    (it runs inside the signal handler)."""
    from sm120patch.engine import interrupts

    interrupts.notice = notice


@dataclass(frozen=True)
class Named:
    """What a command line names of its targets, one entry per kind of the kinds table
    (`patchkit.kinds.TARGETS`): the path of `--KIND PATH` (None where not named) and the
    release of `--KIND-version` (only where stated)."""

    paths: Mapping[str, str | None] = field(default_factory=dict)
    stated: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Session:
    """What one command works on: targets, packs, the catalog and the GPUs, resolved once.
    Every field has a default, so that a caller names what it gives (`Session(paths=...)`)."""

    # kind -> the path the command line names (None or absent: not named). A kind of
    # kinds.LOOKED_FOR not named is the one installed here; any other (vLLM), none.
    paths: Mapping[str, str | None] = field(default_factory=dict)
    packs: tuple[str, ...] = ()
    stated: Mapping[str, str] = field(default_factory=dict)  # kind -> --KIND-version
    _gpus: GpuInventory | None = field(default=None, repr=False)
    verbose: bool = False  # the known outcomes in full, not one short line each
    config: Config = field(init=False, repr=False)  # made from `packs` and `stated`, below

    def __post_init__(self) -> None:
        from sm120patch.config import Config

        # The command's own, passed down (through `targets`), never set for the process: a
        # second Session in this process sees its own packs and versions.
        self.config = Config.made(self.packs, self.stated)

    def close(self) -> None:
        """Close what the command held: its targets' handles (`Resolved.close`)."""
        if "targets" in self.__dict__:  # found only where the command asked for one
            self.targets.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @functools.cached_property
    def targets(self) -> Resolved:
        """The command's targets, each found on first use and then kept (a refusal too): what
        the verbs are given, so no command finds a target twice."""
        from sm120patch.targets.resolved import Resolved

        return Resolved(self.paths, self.config)

    def target(self, kind: str) -> Target:
        """The target of `kind` (at its path, or the one installed here); its refusal."""
        return self.targets.find(kind)

    @functools.cached_property
    def catalog(self) -> Catalog:
        from sm120patch.plan import catalog

        return catalog.load(self.config)

    def profile(self, name: str) -> Profile:
        return self.catalog.profile(name)

    def gpus(self) -> GpuInventory:
        """The GPUs, read once per command (starting NVML is a tenth of a second)."""
        if self._gpus is None:
            from sm120patch.trial import gpu

            self._gpus = gpu.read_gpus()
        return self._gpus

    def sm120_check(self, gpu_check: bool) -> Callable[[], None] | None:
        """The apply's precondition: an SM120 GPU here, unless the check is off."""
        if not gpu_check:
            return None
        from sm120patch.trial import gpu

        def check() -> None:
            gpu.require_sm120(self.gpus())

        return check

    def known_lines(self, profile: str | None, command: list[str] | None = None) -> list[str]:
        """The known outcomes and the trials measured here that match this box: one short
        line each and where the whole entries are, or the whole entries with `verbose`."""
        from sm120patch.trial import known

        found = known.lines(
            profile, self.targets, command or [], self.gpus, verbose=self.verbose, cat=self.catalog
        )
        return self._with_where_in_full(profile, found)

    def _with_where_in_full(self, profile: str | None, lines: list[str]) -> list[str]:
        """Short known lines end with the command that prints them in full (not with
        --verbose, which already did)."""
        if profile and not self.verbose and any(line.startswith("known: ") for line in lines):
            lines.append(f"known outcomes in full: `sm120patch show {profile}`")
        return lines

    def known_before_apply(self, profile: str, gpu_check: bool) -> list[str]:
        """The known outcomes and the trials measured here that match this box, for `apply`
        and its dry run: data the plan wing reads (`plan.known`) and the trials as recorded,
        never the trial wing. The GPUs are read only where the GPU check reads them anyway;
        unread, a GPU condition does not exclude an entry. Nothing is assessed here: the
        versions and trials are the targets' own, and the apply assesses each target once."""
        from sm120patch.engine import trials as recorded
        from sm120patch.errors import Sm120Error
        from sm120patch.plan import known

        try:
            found_here = self.targets.each()
            trials = recorded.recorded(found_here)
        except Sm120Error:  # the apply itself refuses in its own words
            found_here, trials = [], []
        found = self.gpus() if gpu_check else None
        box = known.Box(
            versions={t.kind: t.version for t in found_here},
            gpu_family=found.family if found else None,
            gpus=(len(found.gpus) or None) if found else None,
        )
        found_lines = known.lines(
            profile, box, known.once_each(trials), verbose=self.verbose, cat=self.catalog
        )
        return self._with_where_in_full(profile, found_lines)


# ---- lock files --------------------------------------------------------------------------


@dataclass(frozen=True)
class Locked:
    """The profile a command works on, and the lock it must reproduce (if any)."""

    profile: str
    lock: Lock | None = None
    lock_path: str | None = None
    check_plan: PlanCheck | None = None


def locked(profile: str | None, lock_path: str | None) -> Locked:
    """PROFILE and/or --locked LOCKFILE, read and checked against each other."""
    if not lock_path:
        if not profile:
            raise UsageError(
                "give a profile or --locked with a lock file",
                "`sm120patch list` shows the profiles; `sm120patch <again> moe` for the "
                "recommended one",
            )
        return Locked(profile)
    from sm120patch.plan import lockfile

    lock = lockfile.read(Path(lock_path))
    if profile and profile != lock.profile:
        raise UsageError(
            f"{lock_path} locks profile {lock.profile}, not {profile}",
            f"leave the profile out (the lock says {lock.profile}), or use a lock of {profile}",
        )
    return Locked(lock.profile, lock, lock_path, lockfile.check(lock, Path(lock_path)))


@contextlib.contextmanager
def profile_of(want: Locked) -> Iterator[None]:
    """A profile the lock names that nothing here defines is said to come from the lock."""
    try:
        yield
    except UnknownProfile as exc:
        if want.lock_path is None or exc.name != want.profile:
            raise
        raise UsageError(
            f"lock file {want.lock_path} locks profile '{exc.name}', which neither this "
            "sm120patch nor its packs define",
            "`sm120patch list` shows the profiles here; a pack's profile needs its pack "
            "(--patches DIR)",
        ) from None
