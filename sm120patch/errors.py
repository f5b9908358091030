"""Typed errors the engine raises and the CLI renders as one line plus what to do.

Each maps to a documented exit code (docs/operator.md): a refusal or failed precondition leaves
every file as it was (1), a usage error (2), a trial that crashed and was reverted (3), a bug
(4), a measured trial whose server never answered (8).
"""

from __future__ import annotations

from typing import Any


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


class TrialCrashed(Sm120Error):
    exit_code = 3
    record: dict[str, object] | None = None  # the trial's record, for `--json`


class TrialUnreachable(Sm120Error):
    """`trial --measure`: nothing answered at the API on the baseline (no load request, no
    probe); the setup is wrong, the patch is not judged (reverted, never evidence)."""

    exit_code = 8
