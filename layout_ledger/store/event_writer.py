"""Writing the ``events`` table: every row chained, identical consecutive refusals counted.

One ``EventWriter`` per open ledger (its one writer) keeps the last row written, the *head*:

- every new row's ``chain`` is ``chain.link`` of the head's chain value and the row's fields;
- a refusal identical to the head (same incarnation, kind, engine, reason and version) is not
  a new row: the head's ``count`` grows and ``last_at`` moves on, and its chain value is
  recomputed from the row before it (nothing after the head depends on it). A flood of one
  refused request costs a row, not a row each; ``status`` still counts every refusal.

A transaction that rolls back must call ``reload`` so the head is the row the file holds.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.core import events as ev
from layout_ledger.store import chain

_INSERT = (
    "INSERT INTO events (incarnation_id, at, kind, engine_id, layers, base_version, "
    "new_version, digest_after, reason, count, last_at, chain) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_COUNT_AGAIN = "UPDATE events SET count = ?, last_at = ?, chain = ? WHERE event_id = ?"
_HEAD = (
    f"SELECT event_id, {', '.join(chain.FIELDS)}, chain FROM events ORDER BY event_id DESC LIMIT 2"
)


@dataclass(frozen=True)
class Head:
    """The last row of ``events``: its id, its chain fields, its chain value and the one before."""

    event_id: int
    fields: tuple[object, ...]  # chain.FIELDS values, as stored
    value: str
    previous: str

    def repeats(self, fields: tuple[object, ...]) -> bool:
        """Would a refusal with these fields be counted on this row?"""
        kind = fields[2]
        if not isinstance(kind, str) or not ev.is_refusal(kind):
            return False
        same = (0, 2, 3, 4, 5, 6, 7, 8)  # all but at, count, last_at
        return all(self.fields[i] == fields[i] for i in same)


def fields_of(incarnation_id: int, event: ev.Event) -> tuple[object, ...]:
    """A new row's ``chain.FIELDS`` values (count 1, no last_at)."""
    return (
        incarnation_id,
        event.at,
        event.kind,
        event.engine_id,
        event.layers_json(),
        event.base_version,
        event.new_version,
        event.digest_after,
        event.reason,
        1,
        None,
    )


class EventWriter:
    """The writer of one ledger's ``events`` (see the module docstring)."""

    def __init__(self, driver: sqlite3.Connection) -> None:
        self.head: Head | None = None
        self.reload(driver)

    def reload(self, driver: sqlite3.Connection) -> None:
        rows = driver.execute(_HEAD).fetchall()
        if not rows:
            self.head = None
            return
        last = rows[0]
        previous = str(rows[1][-1]) if len(rows) > 1 else chain.GENESIS
        self.head = Head(int(last[0]), tuple(last[1:-1]), str(last[-1]), previous)

    def write(
        self,
        driver: sqlite3.Connection,
        incarnation_id: int,
        events: Sequence[ev.Event],
        fingerprints_digest: str | None = None,
    ) -> None:
        """Append ``events`` of one incarnation in the caller's transaction.

        ``fingerprints_digest``: of the slot fingerprints the one versioned event (start, commit,
        repair) wrote; its link covers it (``chain.link``)."""
        for event in events:
            fields = fields_of(incarnation_id, event)
            head = self.head
            if len(events) == 1 and head is not None and head.repeats(fields):
                self._count_again(driver, head, event.at)
            else:
                versioned = event.kind in chain.VERSIONED_KINDS and event.new_version is not None
                self._insert(driver, fields, fingerprints_digest if versioned else None)

    def _insert(
        self,
        driver: sqlite3.Connection,
        fields: tuple[object, ...],
        fingerprints_digest: str | None = None,
    ) -> None:
        previous = chain.GENESIS if self.head is None else self.head.value
        value = chain.link(previous, fields, fingerprints_digest)
        cursor = driver.execute(_INSERT, (*fields, value))
        if cursor.lastrowid is None:
            raise sqlite3.DatabaseError("the new event got no id")
        self.head = Head(int(cursor.lastrowid), fields, value, previous)

    def _count_again(self, driver: sqlite3.Connection, head: Head, at: str) -> None:
        count = int(str(head.fields[9])) + 1
        fields = (*head.fields[:9], count, at)
        value = chain.link(head.previous, fields)
        driver.execute(_COUNT_AGAIN, (count, at, value, head.event_id))
        self.head = Head(head.event_id, fields, value, head.previous)
