"""A thread that keeps asking daemons small requests while something else happens to them (a
heal reading a blocked or slow shard, a SIGKILL campaign), and keeps what each request got: the
test of checkpoint reads and ``scripts/heal_campaign.py`` both judge a daemon by it (every
request answered, within a bound)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sglang_integration.testing.daemon_control import request

# A request's message: ``message(kind, rank)``, or ``{"type": kind}`` when none is given.
Message = Callable[[str, int], dict[str, Any]]


class DaemonProber:
    """Asks each socket in ``sockets`` (by rank) every kind in ``kinds``, then waits
    ``interval`` seconds, over and over on a thread until the ``with`` block ends. Counts the
    requests (``asked``), keeps the slowest answer's seconds (``slowest``), each request that got
    no reply (an error, or an answer that is not a reply) as a line in ``failures``, and how many
    requests got no reply or got it later than ``answer_within`` seconds, each counted once
    (``missed``; a request is given that long).
    """

    def __init__(
        self,
        sockets: Sequence[str],
        kinds: Sequence[str],
        interval: float,
        answer_within: float,
        message: Message | None = None,
    ) -> None:
        self.sockets, self.kinds = list(sockets), tuple(kinds)
        self.interval, self.answer_within = interval, answer_within
        self._message: Message = message or (lambda kind, rank: {"type": kind})
        self.asked = 0
        self.missed = 0
        self.slowest = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for rank, path in enumerate(self.sockets):
                for kind in self.kinds:
                    self._ask(rank, path, kind)
            self._stop.wait(self.interval)

    def _ask(self, rank: int, path: str, kind: str) -> None:
        started = time.monotonic()
        failed = True
        try:
            reply = request(path, self._message(kind, rank), self.answer_within)
            if not isinstance(reply, dict) or "status" not in reply:
                self.failures.append(f"rank {rank} {kind}: {reply!r}"[:200])
            else:
                failed = False
        except (OSError, EOFError, ValueError) as exc:
            self.failures.append(f"rank {rank} {kind}: {type(exc).__name__} {exc}")
        took = time.monotonic() - started
        self.slowest = max(self.slowest, took)
        self.missed += failed or took > self.answer_within
        self.asked += 1

    def __enter__(self) -> DaemonProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
