"""Shared helpers for the ledger's tests: build ledgers, read them back, run sqlite3 queries."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from layout_ledger.core.layout import Geometry, Map, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.retention import Retention

SMALL = Geometry(num_layers=8, num_physical_slots=12, num_logical_experts=8)


def open_ledger(path: Path, **retention: int) -> Ledger:
    return Ledger.open(path, Retention(**retention) if retention else None)


def start(ledger: Ledger, geometry: Geometry = SMALL, initial: Map | None = None) -> LayoutRecord:
    initial = initial or trivial_map(
        geometry.num_layers, geometry.num_physical_slots, geometry.num_logical_experts
    )
    return ledger.start_incarnation(
        geometry, initial, config_fingerprint="test", daemon_label="test-daemon"
    )


def random_row(rng: random.Random, geometry: Geometry = SMALL) -> list[int]:
    return [rng.randrange(geometry.num_logical_experts) for _ in range(geometry.num_physical_slots)]


def move(record: LayoutRecord, engine_id: str, layers: list[int], rng: random.Random) -> int:
    """begin + commit of ``layers`` with random rows; returns the new version."""
    record.begin(engine_id, record.version, layers)
    version, _ = record.commit(
        engine_id, {layer: random_row(rng, record.geometry) for layer in layers}
    )
    return version


def table_dump(
    path: Path, tables: tuple[str, ...] = ("incarnations", "versions", "layout_rows", "events")
) -> dict[str, list[tuple]]:
    """Every row of the ledger's tables, for 'nothing changed' assertions."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall() for table in tables
        }


def refusals_added(path: Path, before: dict[str, list[tuple]]) -> list[str]:
    """The kinds of the events appended since ``before``, after checking that nothing else
    changed: a refused request leaves its one ``*_refused``/``begin_busy`` event and no other
    row (the record writes that event itself, in the same locked step)."""
    after = table_dump(path)
    for table in ("incarnations", "versions", "layout_rows"):
        assert after[table] == before[table], table
    assert after["events"][: len(before["events"])] == before["events"]
    added = [row[3] for row in after["events"][len(before["events"]) :]]
    assert all(kind.endswith("_refused") or kind in ("begin_busy", "lease_busy") for kind in added)
    return added
