"""A progress line on stderr for the commands whose work can take seconds (verify, fleet
--verify, plot --moves, export --check, prune).

Only when stderr is a terminal (a pipe, a file, a log collector get nothing), and only once the
work has run ``DELAY_SECONDS``: work that ends sooner shows nothing, work that passes about 2 s
shows what it is doing and for how long (``layout-ledger verify: digests of incarnation 2,
3 s``), redrawn in place, and the line is erased before the result is printed. The command
names its phases (``phase``); a thread redraws the line, so a long phase still shows its time.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from layout_ledger.cli.parser import PROG
from layout_ledger.cli.terminal import printable

DELAY_ENV = "LAYOUT_LEDGER_PROGRESS_DELAY"  # seconds before the line shows; 0: at once
DELAY_SECONDS = 1.0


def _delay() -> float:
    try:
        seconds = float(os.environ.get(DELAY_ENV, DELAY_SECONDS))
    except ValueError:
        return DELAY_SECONDS
    return seconds if 0 <= seconds < 3600 else DELAY_SECONDS


REDRAW_SECONDS = 0.5
_ERASE = "\r\x1b[K"


class Progress:
    """``with Progress("verify") as progress: progress.phase("digests"); ...``"""

    def __init__(
        self,
        command: str,
        stream: TextIO | None = None,
        *,
        delay: float | None = None,
        redraw: float = REDRAW_SECONDS,
    ) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.delay = _delay() if delay is None else delay
        self.redraw = redraw
        self.shown = False  # a line was drawn (and must be erased)
        self._text = "starting"
        self._started = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _terminal(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):  # a closed or unusual stream
            return False

    def phase(self, text: str) -> None:
        """What the work does now (shown on the next redraw)."""
        self._text = text

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self._terminal():
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        if self._done.wait(self.delay):
            return
        while not self._done.is_set():
            self._draw()
            self._done.wait(self.redraw)

    def _draw(self) -> None:
        seconds = int(time.monotonic() - self._started)
        line = printable(f"{PROG} {self.command}: {self._text}, {seconds} s")
        with self._lock:
            if self._done.is_set():
                return
            self.stream.write(_ERASE + line[:200])
            self.stream.flush()
            self.shown = True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with self._lock:
            self._done.set()
            if self.shown:
                self.stream.write(_ERASE)
                self.stream.flush()
        if self._thread is not None:
            self._thread.join(5)


class _NoProgress:
    """Where the caller gave no progress: phases go nowhere."""

    def phase(self, text: str) -> None:
        pass


NO_PROGRESS = _NoProgress()
