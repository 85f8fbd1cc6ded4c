"""Engine roles: an attachment is active or standby, and a standby's leases are events.

No table changes: an attach event of a standby records its role in ``reason``
(``'role: standby'``; an active engine's attach leaves it NULL, as every attach before roles
did), and a standby's lease grants and releases are events of the new kinds ``lease`` and
``release`` (refusals ``lease_refused``, ``release_refused``, ``lease_busy``), in the same
chain as every event. ``ledger_attachments`` gains ``role`` (``active`` or ``standby``);
its other columns are 0002's.

Revision ID: 0006_engine_roles
Revises: 0005_slot_fingerprints
Create Date: 2026-12-02 12:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006_engine_roles"
down_revision: str | None = "0005_slot_fingerprints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ATTACHMENTS_HEAD = """
SELECT a.incarnation_id, a.engine_id, a.at AS attached_at,
       coalesce(
           (SELECT min(d.at) FROM events d
            WHERE d.incarnation_id = a.incarnation_id AND d.engine_id = a.engine_id
              AND d.kind = 'detach' AND d.event_id > a.event_id),
           i.ended_at
       ) AS detached_at,
       (SELECT d.reason FROM events d
        WHERE d.incarnation_id = a.incarnation_id AND d.engine_id = a.engine_id
          AND d.kind = 'detach' AND d.event_id > a.event_id
        ORDER BY d.event_id LIMIT 1) AS detach_reason"""

_ATTACHMENTS_TAIL = """
FROM events a JOIN incarnations i ON i.incarnation_id = a.incarnation_id
WHERE a.kind = 'attach'
"""

_ATTACHMENTS_0002 = _ATTACHMENTS_HEAD + _ATTACHMENTS_TAIL

_ATTACHMENTS_0006 = (
    _ATTACHMENTS_HEAD
    + """,
       CASE WHEN a.reason = 'role: standby' THEN 'standby' ELSE 'active' END AS role"""
    + _ATTACHMENTS_TAIL
)


def upgrade() -> None:
    op.execute("DROP VIEW ledger_attachments")
    op.execute(f"CREATE VIEW ledger_attachments AS {_ATTACHMENTS_0006.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW ledger_attachments")
    op.execute(f"CREATE VIEW ledger_attachments AS {_ATTACHMENTS_0002.strip()}")
