"""Is the daemon that wrote an incarnation still running?

The daemon that owns a ledger holds its writer lock for its whole life, and the kernel drops
it however the daemon dies (``storage.WriterLock``). So for the latest incarnation, not yet
ended, the lock says it: held means running, free means the daemon is gone (SIGKILL, a crash:
no clean end was recorded). The lock is probed without being taken
(``storage.writer_lock_held``), so asking never disturbs the daemon.

The lock's holder writes its pid beside the ledger (``<ledger>.lock``): a lock held by another
process than the one the incarnation recorded (``layout-ledger prune`` or ``upgrade``, which
only take the lock while no daemon holds it) is not its daemon running.

The probe sees only this machine's locks. It cannot answer, and the answer is "unknown"
(``alive`` None), for an incarnation recorded on another host (a ledger read over shared
storage), for a file on read-only media (an evidence copy: nobody could own it for writing),
or when the file cannot be opened for the probe. An ended incarnation, or one a later
incarnation followed, is not running.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from layout_ledger.store.connections import lock_holder_pid, writer_lock_held
from layout_ledger.store.rows import Incarnation


@dataclass(frozen=True)
class Liveness:
    """Whether an incarnation's daemon runs (None: cannot tell here) and, in words, why."""

    alive: bool | None
    detail: str

    @property
    def word(self) -> str:
        """``running``, ``not running`` or ``unknown`` (a table cell)."""
        if self.alive is None:
            return "unknown"
        return "running" if self.alive else "not running"


NO_CLEAN_END = "not running, no clean end recorded"


def daemon_liveness(
    path: str | os.PathLike[str],
    inc: Incarnation,
    *,
    latest: bool,
    this_host: str | None = None,
) -> Liveness:
    """Whether the daemon of ``inc`` (an incarnation of the ledger at ``path``) is running;
    ``latest`` says whether it is the ledger's newest incarnation."""
    if inc.ended_at is not None:
        return Liveness(False, f"not running, ended {inc.end_state}")
    if not latest:
        return Liveness(False, f"{NO_CLEAN_END}; a later incarnation started")
    here = socket.gethostname() if this_host is None else this_host
    recorded = inc.origin.host
    if recorded is not None and recorded != here:
        return Liveness(None, f"unknown: its daemon ran on host {recorded}, this is {here}")
    if _on_read_only_media(Path(path)):
        return Liveness(None, "unknown: the file is on read-only media (a copy no daemon owns)")
    held = writer_lock_held(path)
    if held is None:
        return Liveness(None, "unknown: the file could not be opened to probe its writer lock")
    if not held:
        return Liveness(False, NO_CLEAN_END)
    holder, daemon = lock_holder_pid(path), inc.origin.pid
    if holder is not None and daemon is not None and holder != daemon:
        return Liveness(
            False,
            f"{NO_CLEAN_END}; pid {holder}, not its daemon (pid {daemon}), holds the writer lock",
        )
    return Liveness(True, "running")


def _on_read_only_media(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
