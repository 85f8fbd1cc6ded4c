"""The forensic views: the stable, sqlite3-facing interface (docs/design.md).

ledger_incarnations, ledger_events, ledger_current_layout, ledger_layout_history, and
ledger_attachments (which engines were attached when). Tables may change in later revisions;
these views keep their names and columns.

Revision ID: 0002_forensic_views
Revises: 0001_initial
Create Date: 2026-11-29 13:00:01

"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002_forensic_views"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LAST_EVENT = (
    "(SELECT max(e.event_id) FROM events e "
    "WHERE e.incarnation_id = i.incarnation_id AND e.kind {cond})"
)

VIEWS = {
    "ledger_incarnations": f"""
SELECT
    i.incarnation_id,
    i.started_at,
    i.ended_at,
    i.end_state,
    cv.version AS current_version,
    cv.digest AS current_digest,
    CASE WHEN d.event_id IS NULL THEN 0 ELSE 1 END AS dirty,
    d.reason AS dirty_reason,
    d.engine_id AS dirty_engine_id,
    d.layers AS dirty_layers,
    d.base_version AS dirty_base_version,
    b.engine_id AS pending_engine_id,
    b.layers AS pending_layers,
    b.base_version AS pending_base_version,
    EXISTS (
        SELECT 1 FROM events n
        WHERE n.incarnation_id = i.incarnation_id AND n.kind = 'non_following_fetch'
    ) AS non_following_fetch,
    i.num_layers,
    i.num_physical_slots,
    i.num_logical_experts,
    i.initial_digest,
    i.config_fingerprint,
    i.daemon_label
FROM incarnations i
LEFT JOIN versions cv
    ON cv.incarnation_id = i.incarnation_id
    AND cv.version = (
        SELECT max(v.version) FROM versions v WHERE v.incarnation_id = i.incarnation_id
    )
LEFT JOIN events d ON d.event_id = {_LAST_EVENT.format(cond="= 'dirty'")}
LEFT JOIN events b
    ON b.event_id = {_LAST_EVENT.format(cond="= 'begin'")}
    AND b.event_id > coalesce({_LAST_EVENT.format(cond="IN ('commit', 'abort', 'dirty')")}, 0)
""",
    "ledger_events": """
SELECT event_id, incarnation_id, at, kind, engine_id, layers, base_version, new_version,
       digest_after, reason
FROM events
""",
    "ledger_current_layout": """
SELECT r.incarnation_id, r.layer, r.version, r.slots
FROM layout_rows r
WHERE r.version = (
    SELECT max(r2.version) FROM layout_rows r2
    WHERE r2.incarnation_id = r.incarnation_id AND r2.layer = r.layer
)
""",
    "ledger_layout_history": """
SELECT incarnation_id, layer, version,
       lead(version) OVER (PARTITION BY incarnation_id, layer ORDER BY version) - 1
           AS valid_through_version,
       slots
FROM layout_rows
""",
    "ledger_attachments": """
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
        ORDER BY d.event_id LIMIT 1) AS detach_reason
FROM events a JOIN incarnations i ON i.incarnation_id = a.incarnation_id
WHERE a.kind = 'attach'
""",
}


def upgrade() -> None:
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body.strip()}")


def downgrade() -> None:
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW {name}")
