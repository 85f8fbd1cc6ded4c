"""The expert layout side of one daemon: its service, connection threads, attach watcher, ledger.

A daemon gets it once its record is open (the load hook; the model-less daemon and the one-GPU
check's stand-in the same way) and keeps it as one attribute until serve ends, when
``close_daemon_layout`` stops the threads and ends the ledger's incarnation cleanly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.errors import LedgerError
from layout_ledger.store.ledger import Ledger
from layout_ledger.wire.service import LayoutService
from sglang_integration import settings
from sglang_integration.daemon.attach_watcher import AttachWatcher
from sglang_integration.daemon.connections import ConnectionThreads

logger = logging.getLogger(__name__)

# The attribute of a WeightCacheDaemon that holds its DaemonLayoutSide.
_LAYOUT_ATTR = "_expert_layout"


@dataclass
class DaemonLayoutSide:
    """The expert layout side of one daemon: its service, connections, watcher and ledger."""

    service: LayoutService
    watcher: AttachWatcher
    connections: ConnectionThreads
    ledger: Ledger | None = None

    def close(self) -> None:
        """Stop every checkpoint read (a heal waiting on a blocked file ends now), serving
        connections and watching attach connections, then end the incarnation."""
        self.service.healing.stop()
        self.connections.stop()
        self.watcher.stop()
        if self.ledger is not None:
            self.ledger.close()


def set_daemon_layout(
    daemon: Any,
    service: LayoutService,
    ledger: Ledger | None = None,
    request_timeout: float | None = None,
) -> None:
    """Give ``daemon`` its layout side and start its attach watcher.

    ``request_timeout``: the connection deadline in seconds (None: ``settings.REQUEST_TIMEOUT``).
    """
    if request_timeout is None:
        request_timeout = settings.REQUEST_TIMEOUT.read()
    previous = getattr(daemon, _LAYOUT_ATTR, None)
    if previous is not None:
        raise RuntimeError("this daemon already has an expert layout service")

    def detach(engine_id: str, reason: str) -> None:
        try:
            service.detach(engine_id, reason)
        except LedgerError as exc:
            logger.error(
                "could not record engine %r's detach (%s): %s; the daemon counts it as "
                "attached until it restarts, so no other engine may move experts",
                engine_id,
                reason,
                exc,
            )

    watcher = AttachWatcher(detach)
    watcher.start()
    connections = ConnectionThreads(request_timeout)
    setattr(daemon, _LAYOUT_ATTR, DaemonLayoutSide(service, watcher, connections, ledger))


def daemon_layout(daemon: Any) -> DaemonLayoutSide | None:
    """The daemon's layout side, or None (its load did not run through the hook)."""
    layout: DaemonLayoutSide | None = getattr(daemon, _LAYOUT_ATTR, None)
    return layout


def close_daemon_layout(daemon: Any) -> None:
    """End the daemon's layout side (clean incarnation end); safe to call twice."""
    layout = daemon_layout(daemon)
    if layout is None:
        return
    setattr(daemon, _LAYOUT_ATTR, None)
    try:
        layout.close()
    except LedgerError as exc:
        logger.error("could not end the expert layout ledger's incarnation cleanly: %s", exc)
