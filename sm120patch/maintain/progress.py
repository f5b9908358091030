"""Progress of `matrix` on stderr, for the CLI to render (the library only calls back).

click's progress bar, drawn only once a phase has lasted `delay` seconds (a warm run of a few
releases stays silent), and never when stderr is not a terminal or with `--quiet`. A timer
thread draws the bar, so a phase that blocks (reading an index, the first download) shows up
as well; a lock keeps it and the updates from the main thread apart.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

import click

DELAY_S = 1.0


class Progress:
    def __init__(self, *, quiet: bool = False, delay: float = DELAY_S, file: IO[str] | None = None):
        self.file = file if file is not None else sys.stderr
        try:
            tty = self.file.isatty()
        except (AttributeError, ValueError):
            tty = False
        self.enabled = tty and not quiet
        self.delay = delay
        self._lock = threading.Lock()
        self._bar: Any = None
        self._timer: threading.Timer | None = None
        self._label = ""
        self._length = 0  # 0: no phase running
        self._done = 0
        self._item: str | None = None

    @contextlib.contextmanager
    def phase(self, label: str, length: int) -> Iterator[Progress]:
        with self._lock:
            self._label, self._length, self._done, self._item = label, max(length, 1), 0, None
        if self.enabled:
            self._timer = threading.Timer(self.delay, self._show)
            self._timer.daemon = True
            self._timer.start()
        try:
            yield self
        finally:
            if self._timer is not None:
                self._timer.cancel()
            with self._lock:
                if self._bar is not None:
                    self._bar.render_finish()
                    self._bar = None
                self._length = 0

    def advance(self, item: str) -> None:
        with self._lock:
            self._done += 1
            self._item = item
            if self._bar is not None:
                self._bar.update(1, current_item=item)

    def _show(self) -> None:
        with self._lock:
            if self._length == 0 or self._bar is not None:
                return
            bar = click.progressbar(
                length=self._length,
                label=self._label,
                file=self.file,  # type: ignore[arg-type]  # click takes any text stream
                item_show_func=lambda item: item,
            )
            bar.__enter__()
            if self._done:
                bar.update(self._done, current_item=self._item)
            self._bar = bar
