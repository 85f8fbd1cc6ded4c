"""Where this rank's weights came from: the weight cache daemon, or disk.

The IPC loader hook records it once per load (``ipc_loader``); the rebalance hook reads it:
weights from disk on every rank belong to the engine and rebalance as before, weights from the
daemons move only through the two-phase protocol, and a mix never rebalances. Nothing recorded
means the IPC loader did not run (weight cache off). One value per process, i.e. per rank.
"""

from __future__ import annotations

import logging

from sglang_integration.engine.rebalance_decisions import WeightSource

logger = logging.getLogger(__name__)

__all__ = ["WeightSource", "record_weight_source", "weight_source"]


class _ThisRank:
    """The process-wide record (one engine rank per process)."""

    source: WeightSource | None = None


def record_weight_source(source: WeightSource) -> None:
    """Set this rank's weight source (the latest load wins)."""
    _ThisRank.source = source
    logger.info("This rank's weights come from %s", source.value)


def weight_source() -> WeightSource | None:
    """This rank's weight source, or None when the IPC loader never ran."""
    return _ThisRank.source
