"""Typed errors the engine raises and the CLI renders as one line plus what to do.

Each maps to a documented exit code (docs/operator.md): a refusal or failed precondition leaves
every file as it was (1), a usage error (2), a trial that crashed and was reverted (3), a bug
(4), a measured trial whose server never answered (8).
"""

from __future__ import annotations

from typing import Any

# In a hint, `sm120patch <again> WORDS` is the user's own command line with WORDS added (the
# CLI fills it in): a refusal deep in the engine can say "the same again, with --no-gpu-check"
# as a command that pastes.
AGAIN = "<again>"


class Sm120Error(Exception):
    exit_code = 4

    def __init__(self, message: str, hint: str = "", details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # What a script reading `--json` gets beside the message (outcomes of a refused plan,
        # a crashed trial's verdict): plain JSON values only.
        self.details: dict[str, Any] = dict(details or {})


class Refused(Sm120Error):
    """A precondition failed or a patch refused; nothing was changed."""

    exit_code = 1


class UsageError(Sm120Error):
    exit_code = 2


class UnknownProfile(UsageError):
    """A profile name no loaded profiles.toml defines (`name`: the name asked for), so that a
    caller who took the name from a lock file can say so."""

    def __init__(self, name: str, message: str, hint: str = "") -> None:
        super().__init__(message, hint)
        self.name = name


class TrialCrashed(Sm120Error):
    exit_code = 3
    record: dict[str, object] | None = None  # the trial's record, for `--json`


class TrialUnreachable(Sm120Error):
    """`trial --measure`: nothing answered at the API on the baseline (no load request, no
    probe); the setup is wrong, the patch is not judged (reverted, never evidence)."""

    exit_code = 8


class NotWritable(Refused):
    """A refusal only because this user (or anyone: a read-only filesystem) cannot write where
    a command would write. A dry run, which writes nothing, reports it and goes on: reviewing
    a diff needs only read access."""


def not_writable(what: str, path: object, reason: str | None = None) -> NotWritable:
    """The refusal for `what` at `path` that this run cannot write, with what to do: on a
    filesystem mounted read-only no user can write it, so the hint says so instead of asking
    for another user."""
    import os
    import shlex

    where = str(path)
    probe = where
    while probe and not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return NotWritable(
            f"{what} {where}: the filesystem is mounted read-only; nothing was changed",
            "no user can write a read-only filesystem: remount it read-write, or apply where "
            "the tree is built (an image build, with --no-gpu-check)",
        )
    because = f" ({reason})" if reason else ""
    return NotWritable(
        f"{what} {where}{because}; nothing was changed",
        f"run sm120patch as the owner of {shlex.quote(where)} (or as root), or make it writable",
    )
