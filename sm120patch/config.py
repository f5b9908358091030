"""A command's configuration (`Config`): the pack directories it loads and the versions its
command line states, made once per command (`app.Session`) and passed down, as Alembic's
`Config` is. Nothing here is set for the process: two commands in one process (a test, a
library user) each see their own packs and versions.

It imports nothing of sm120patch but its errors and the kinds, so that every wing from
`targets/` on may take one and `status`, which loads no catalog, pays nothing for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from sm120patch.errors import UsageError
from sm120patch.patchkit.kinds import DISPLAY

PACKS_ENV = "SM120PATCH_PATCHES"


@dataclass(frozen=True)
class Config:
    """What one command loads and states: `packs`, the pack directories (`--patches`, then
    SM120PATCH_PATCHES), which select the catalog (`plan.catalog.load`); `stated`, kind ->
    the version `--KIND-version` gives every target of that kind the command finds
    (`targets.finding.find`). Make one with `Config.made`, which reads the environment and checks
    the versions; the bare constructor takes both as they are."""

    packs: tuple[str, ...] = ()
    stated: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def made(
        cls, packs: Iterable[str] = (), stated: Mapping[str, str | None] | None = None
    ) -> Config:
        """The configuration of a command given `--patches` dirs `packs` and the stated
        versions `stated`: the environment's packs after `packs`; UsageError for a stated
        version that is not a PEP 440 version."""
        env = tuple(d for d in os.environ.get(PACKS_ENV, "").split(os.pathsep) if d)
        checked = {k: _checked(k, v) for k, v in (stated or {}).items() if v}
        return cls((*(str(d) for d in packs), *env), MappingProxyType(checked))


def _checked(kind: str, version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(version))
    except InvalidVersion:
        raise UsageError(
            f"--{kind}-version {version}: not a PEP 440 version",
            f"give the {DISPLAY[kind]} release this tree is, e.g. --{kind}-version 0.5.23",
        ) from None
