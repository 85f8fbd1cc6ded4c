"""Repeated refusals counted on one row, and the events' hash chain.

events gains ``count`` (how many identical refusals the row stands for, 1 for every other
event), ``last_at`` (the time of the last of them; NULL when count is 1) and ``chain`` (SHA-256
over the previous row's chain value and this row's fields, ``layout_ledger.store.chain``), computed
here for the rows an older ledger holds. The ``ledger_events`` view shows the three columns.

Revision ID: 0003_event_counts_and_chain
Revises: 0002_forensic_views
Create Date: 2026-12-01 06:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from layout_ledger.store import chain

revision: str = "0003_event_counts_and_chain"
down_revision: str | None = "0002_forensic_views"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_EVENTS_0002 = """
SELECT event_id, incarnation_id, at, kind, engine_id, layers, base_version, new_version,
       digest_after, reason
FROM events
"""

_EVENTS_0003 = """
SELECT event_id, incarnation_id, at, kind, engine_id, layers, base_version, new_version,
       digest_after, reason, count, last_at, chain
FROM events
"""


def upgrade() -> None:
    op.add_column("events", sa.Column("count", sa.Integer(), nullable=False, server_default="1"))
    op.add_column("events", sa.Column("last_at", sa.Text()))
    op.add_column("events", sa.Column("chain", sa.Text()))
    conn = op.get_bind()
    columns = ", ".join(chain.FIELDS)
    previous = chain.GENESIS
    rows = conn.exec_driver_sql(f"SELECT event_id, {columns} FROM events ORDER BY event_id").all()
    for event_id, *fields in rows:
        previous = chain.link(previous, fields)
        conn.exec_driver_sql("UPDATE events SET chain = ? WHERE event_id = ?", (previous, event_id))
    op.execute("DROP VIEW ledger_events")
    op.execute(f"CREATE VIEW ledger_events AS {_EVENTS_0003.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW ledger_events")
    op.execute(f"CREATE VIEW ledger_events AS {_EVENTS_0002.strip()}")
    # SQLite's own DROP COLUMN (3.35+): a batch copy of the table would trip over the views.
    for column in ("chain", "last_at", "count"):
        op.execute(f"ALTER TABLE events DROP COLUMN {column}")
