"""A pending move as ``status`` and ``export`` show it: its wire object, and one line of text."""

from __future__ import annotations

from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.layer_ranges import format_layers
from layout_ledger.core.state import PendingMove
from layout_ledger.wire.protocol import pending_to_wire


def pending_wire(pending: PendingMove | None) -> JsonObject | None:
    """The move as the wire protocol spells it (``--json``), None when none is pending."""
    return None if pending is None else pending_to_wire(pending)


def pending_text(pending: PendingMove) -> str:
    return (
        f"engine {pending.engine_id!r}, layers {format_layers(pending.layers)}, "
        f"from version {pending.base_version}, since {pending.since}"
    )
