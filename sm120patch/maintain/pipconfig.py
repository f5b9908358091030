"""Where pip looks for distributions, as pip itself is configured.

pip merges its config files (site, user, virtualenv, `PIP_CONFIG_FILE`) and its `PIP_*`
environment variables; `python -m pip config list` prints the merged result, so we ask pip
rather than re-implement its file search. Options are read as `pip download` would: the
environment first, then the `[download]` section, then `[global]`. When pip cannot be run we
fall back to the environment variables alone.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache

from sm120patch import safeio

DEFAULT_INDEX = "https://pypi.org/simple"
SECTIONS = (":env:", "download", "global")  # highest precedence first, as pip orders them
TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class PipIndex:
    """The index pages and find-links locations pip would read, in pip's order."""

    index_url: str | None  # None with `no-index`
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    cert: str | None = None

    @property
    def index_urls(self) -> tuple[str, ...]:
        if self.index_url is None:
            return ()
        return (self.index_url, *self.extra_index_urls)

    @property
    def sources(self) -> tuple[str, ...]:
        return (*self.index_urls, *self.find_links)


def parse_config_list(text: str) -> dict[str, str]:
    """`section.option='value'` lines of `pip config list` as a dict."""
    settings: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        settings[key.strip()] = str(value)
    return settings


def from_settings(settings: dict[str, str]) -> PipIndex:
    def get(option: str) -> str | None:
        for section in SECTIONS:
            value = settings.get(f"{section}.{option}")
            if value is not None:
                return value
        return None

    def many(option: str) -> tuple[str, ...]:
        return tuple((get(option) or "").split())  # pip splits list options on whitespace

    no_index = (get("no-index") or "").strip().lower() in TRUE
    return PipIndex(
        index_url=None if no_index else (get("index-url") or DEFAULT_INDEX),
        extra_index_urls=() if no_index else many("extra-index-url"),
        find_links=many("find-links"),
        cert=get("cert"),
    )


def _environment() -> dict[str, str]:
    """What `pip config list` reports for the PIP_* variables, when pip cannot be run."""
    return {
        f":env:.{name[4:].lower().replace('_', '-')}": value
        for name, value in os.environ.items()
        if name.startswith("PIP_")
    }


@cache
def pip_index() -> PipIndex:
    """pip's index configuration, read once per process."""
    try:
        proc = subprocess.run(
            safeio.python_command(sys.executable, "-m", "pip", "config", "list"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=safeio.CHILD_CWD,
            env=safeio.pip_env(),
        )
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is None or proc.returncode != 0:
        return from_settings(_environment())
    return from_settings(parse_config_list(proc.stdout))
