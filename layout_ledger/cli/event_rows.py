"""One row of the ``ledger_events`` view as the CLI reads and prints it (history, status).

The CLI reads events through the forensic view, the same stable interface an operator with
``sqlite3`` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.layer_ranges import format_layers


@dataclass(frozen=True)
class EventRow(JsonShaped):
    """One row of the ``ledger_events`` view: its columns, in its order."""

    event_id: int
    incarnation_id: int
    at: str
    kind: str
    engine_id: str | None
    layers: tuple[int, ...] | None
    base_version: int | None
    new_version: int | None
    digest_after: str | None
    reason: str | None
    count: int = 1  # identical consecutive refusals on one row
    last_at: str | None = None  # the time of the last of them
    chain: str | None = None  # the events' hash chain value (layout_ledger.store.chain)

    @classmethod
    def from_row(cls, row: Any) -> EventRow:
        return cls(
            event_id=int(row.event_id),
            incarnation_id=int(row.incarnation_id),
            at=str(row.at),
            kind=str(row.kind),
            engine_id=row.engine_id,
            layers=None if row.layers is None else tuple(json.loads(row.layers)),
            base_version=row.base_version,
            new_version=row.new_version,
            digest_after=row.digest_after,
            reason=row.reason,
            count=int(row.count),
            last_at=row.last_at,
            chain=row.chain,
        )


# The columns of an event row, in the view's order (history's --csv header), and as a SELECT
# list.
EVENT_COLUMNS: tuple[str, ...] = tuple(column.name for column in fields(EventRow))
EVENT_COLUMNS_SQL = ", ".join(EVENT_COLUMNS)


def render_event(event: EventRow) -> str:
    """One line per event: time, incarnation, id, kind, then only the fields it has."""
    parts = [f"{event.at}  inc={event.incarnation_id}  #{event.event_id}  {event.kind}"]
    if event.engine_id is not None:
        parts.append(f"engine={event.engine_id}")
    if event.layers is not None:
        parts.append(f"layers={format_layers(event.layers)}")
    if event.base_version is not None:
        parts.append(f"base={event.base_version}")
    if event.new_version is not None:
        parts.append(f"version={event.new_version}")
    if event.digest_after is not None:
        parts.append(f"digest={event.digest_after[:12]}")
    if event.count > 1:
        parts.append(f"x{event.count} until {event.last_at}")
    line = " ".join(parts)
    if event.reason:
        line += f"  ({event.reason})"
    return line
