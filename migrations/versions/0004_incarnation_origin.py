"""Where each incarnation ran: host, device, ranks, pid, socket, software versions.

incarnations gains ``host``, ``device_uuid``, ``gpu_id``, ``tp_rank``, ``pp_rank``,
``ep_rank``, ``pid``, ``socket_path``, ``sglang_version`` and ``plugin_version``
(``layout_ledger.store.origin.IncarnationOrigin``), NULL where unknown and for every row an older
ledger holds. The ``ledger_incarnations`` view shows them after its earlier columns.

Revision ID: 0004_incarnation_origin
Revises: 0003_event_counts_and_chain
Create Date: 2026-12-02 06:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_incarnation_origin"
down_revision: str | None = "0003_event_counts_and_chain"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here: this revision's columns, whatever later code calls them.
_COLUMNS = (
    ("host", sa.Text),
    ("device_uuid", sa.Text),
    ("gpu_id", sa.Integer),
    ("tp_rank", sa.Integer),
    ("pp_rank", sa.Integer),
    ("ep_rank", sa.Integer),
    ("pid", sa.Integer),
    ("socket_path", sa.Text),
    ("sglang_version", sa.Text),
    ("plugin_version", sa.Text),
)

_LAST_EVENT = (
    "(SELECT max(e.event_id) FROM events e "
    "WHERE e.incarnation_id = i.incarnation_id AND e.kind {cond})"
)

# The view as revision 0002 created it; 0004 appends the origin columns.
_INCARNATIONS_0002 = f"""
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
    i.daemon_label{{origin}}
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
"""


def _incarnations_view(origin: bool) -> str:
    columns = "".join(f",\n    i.{name}" for name, _ in _COLUMNS) if origin else ""
    return f"CREATE VIEW ledger_incarnations AS {_INCARNATIONS_0002.strip().format(origin=columns)}"


def upgrade() -> None:
    for name, kind in _COLUMNS:
        op.add_column("incarnations", sa.Column(name, kind()))
    op.execute("DROP VIEW ledger_incarnations")
    op.execute(_incarnations_view(origin=True))


def downgrade() -> None:
    op.execute("DROP VIEW ledger_incarnations")
    op.execute(_incarnations_view(origin=False))
    # SQLite's own DROP COLUMN (3.35+): a batch copy of the table would trip over the views.
    for name, _ in reversed(_COLUMNS):
        op.execute(f"ALTER TABLE incarnations DROP COLUMN {name}")
