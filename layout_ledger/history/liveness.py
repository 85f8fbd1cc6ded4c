"""Is the daemon that wrote an incarnation still running?

The daemon that owns a ledger holds its writer lock for its whole life, and the kernel drops it
however the daemon dies (``store.connections.WriterLock``). So for the latest incarnation, not
yet ended, the lock says it, probed without being taken (``writer_lock_held``), so asking never
disturbs the daemon. Where this machine cannot tell, the answer is "unknown" (``daemon_liveness``).
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


NO_CLEAN_END = "not running, no clean end recorded"


def daemon_liveness(
    path: str | os.PathLike[str],
    inc: Incarnation,
    *,
    latest: bool,
    this_host: str | None = None,
) -> Liveness:
    """Whether the daemon of ``inc`` (an incarnation of the ledger at ``path``) is running;
    ``latest`` says whether it is the ledger's newest incarnation.

    An ended incarnation, or one a later incarnation followed, is not running. The probe sees
    only this machine's locks: unknown (``alive`` None) for an incarnation recorded on another
    host (a ledger read over shared storage), a file on read-only media (an evidence copy no
    daemon owns), or a file the probe cannot open. A lock held by another process than the
    recorded daemon (``layout-ledger prune`` or ``upgrade``, which take it only while no daemon
    does; the holder's pid is in ``<ledger>.lock``) is not its daemon running.
    """
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
