"""Heals and reloads: a dirty daemon reloads its slots from its checkpoint, an engine has one
reload its slots into a new map.

``incarnations`` gains ``heal``: whether the incarnation could heal itself (``auto``, ``off``
or ``unavailable: REASON``, as its daemon decided at load; NULL for rows of older code). The new
event kinds are ``reload`` (a new version whose number jumps from ``base_version`` to
``new_version``; its intent is the ``begin`` before it), ``heal`` (clean again at the same version
and digest), ``heal_failed``, and the refusals ``reload_refused`` and ``heal_refused``.
``ledger_incarnations`` ends a pending move at a ``reload`` too, and a dirty mark at a ``heal``;
its columns are 0005's.

The downgrade refuses a ledger holding any such event: revision 0008's code cannot replay them
(its reader and ``verify`` would call the ledger damaged, and the version gap of a reload
missing versions).

Revision ID: 0009_heals
Revises: 0008_restored_layouts
Create Date: 2026-12-06 05:30:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from layout_ledger.core.errors import SchemaDowngradeRefused

revision: str = "0009_heals"
down_revision: str | None = "0008_restored_layouts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here: this revision's event kinds, whatever later code calls them.
_KINDS = ("reload", "heal", "heal_failed", "reload_refused", "heal_refused")

_LAST_EVENT = (
    "(SELECT max(e.event_id) FROM events e "
    "WHERE e.incarnation_id = i.incarnation_id AND e.kind {cond})"
)

_INCARNATIONS_HEAD = """
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
    i.daemon_label,
    i.host,
    i.device_uuid,
    i.gpu_id,
    i.tp_rank,
    i.pp_rank,
    i.ep_rank,
    i.pid,
    i.socket_path,
    i.sglang_version,
    i.plugin_version
FROM incarnations i
LEFT JOIN versions cv
    ON cv.incarnation_id = i.incarnation_id
    AND cv.version = (
        SELECT max(v.version) FROM versions v WHERE v.incarnation_id = i.incarnation_id
    )
"""


def _incarnations(ends_move: str, clears_dirty: str) -> str:
    """0005's ``ledger_incarnations`` (text for text) with these kinds ending a pending move
    and clearing a dirty mark."""
    pending = f"""
LEFT JOIN events b
    ON b.event_id = {_LAST_EVENT.format(cond="= 'begin'")}
    AND b.event_id > coalesce({_LAST_EVENT.format(cond=f"IN ({ends_move})")}, 0)
"""
    return (
        _INCARNATIONS_HEAD
        + "LEFT JOIN events d ON d.event_id = "
        + _LAST_EVENT.format(cond="IN ('dirty', 'content_dirty')")
        + " "
        + f"AND d.event_id > coalesce({_LAST_EVENT.format(cond=clears_dirty)}, 0)"
        + pending
    )


_INCARNATIONS_0005 = _incarnations("'commit', 'abort', 'dirty'", "= 'repair'")
_INCARNATIONS_0009 = _incarnations("'commit', 'abort', 'dirty', 'reload'", "IN ('repair', 'heal')")


def upgrade() -> None:
    op.add_column("incarnations", sa.Column("heal", sa.Text()))
    op.execute("DROP VIEW ledger_incarnations")
    op.execute(f"CREATE VIEW ledger_incarnations AS {_INCARNATIONS_0009.strip()}")


def downgrade() -> None:
    kinds = ", ".join(f"'{kind}'" for kind in _KINDS)
    found = (
        op.get_bind()
        .exec_driver_sql(f"SELECT count(*) FROM events WHERE kind IN ({kinds})")
        .scalar()
    )
    if found:
        raise SchemaDowngradeRefused(
            f"the ledger holds {found} heal or reload events, which the code of revision "
            f"0008_restored_layouts cannot replay (a reload's version jump, a heal's clean "
            f"mark); keep this revision, or move the ledger aside (`layout-ledger backup`) and "
            f"start the older daemon on a new one"
        )
    op.execute("DROP VIEW ledger_incarnations")
    op.execute(f"CREATE VIEW ledger_incarnations AS {_INCARNATIONS_0005.strip()}")
    op.execute("ALTER TABLE incarnations DROP COLUMN heal")
