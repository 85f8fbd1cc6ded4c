"""A pending move as ``status`` and ``export`` show it: its wire object, and one line of text."""

from __future__ import annotations

from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.layer_ranges import format_layers
from layout_ledger.core.state import PendingMove


def pending_wire(pending: PendingMove | None) -> JsonObject | None:
    """The move as the wire protocol spells it (``--json``), None when none is pending.

    The protocol's module is imported here, by ``--json`` alone: its many shapes cost text
    ``status`` 30 ms to import (scripts/bench_cli.py)."""
    if pending is None:
        return None
    from layout_ledger.wire.protocol import pending_to_wire

    return pending_to_wire(pending)


def pending_text(pending: PendingMove) -> str:
    return (
        f"engine {pending.engine_id!r}, layers {format_layers(pending.layers)}, "
        f"from version {pending.base_version}, since {pending.since}"
    )
