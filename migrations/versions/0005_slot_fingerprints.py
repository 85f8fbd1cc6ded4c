"""Slot fingerprints, recorded with the layout, and dirty marks a repair clears.

``slot_fingerprints`` holds, keyed like ``layout_rows`` (incarnation, layer, version), the
fingerprints of one daemon's local slots of a layer at each version that wrote the layer's row
(version 0, commits, repairs): ``first_slot`` and a JSON array of 64-hex-digit fingerprints.
The view ``ledger_slot_fingerprints`` shows one row per slot: incarnation_id, layer, slot,
version, logical_expert (what the layout row of that version names there) and fingerprint.

``ledger_incarnations`` derives ``dirty`` from the last ``dirty`` or ``content_dirty`` event
(an engine left mid-move; slot content that is not what the record says) that no ``repair``
event follows; its other columns are 0004's (0002's and the incarnation's origin).

Revision ID: 0005_slot_fingerprints
Revises: 0004_incarnation_origin
Create Date: 2026-12-02 09:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_slot_fingerprints"
down_revision: str | None = "0004_incarnation_origin"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

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

_PENDING = f"""
LEFT JOIN events b
    ON b.event_id = {_LAST_EVENT.format(cond="= 'begin'")}
    AND b.event_id > coalesce({_LAST_EVENT.format(cond="IN ('commit', 'abort', 'dirty')")}, 0)
"""

_LAST_DIRTY_0002 = _LAST_EVENT.format(cond="= 'dirty'")
_LAST_DIRTY = _LAST_EVENT.format(cond="IN ('dirty', 'content_dirty')")
_LAST_REPAIR = _LAST_EVENT.format(cond="= 'repair'")

# 0004's ledger_incarnations (restored by the downgrade).
_INCARNATIONS_0004 = (
    _INCARNATIONS_HEAD + f"LEFT JOIN events d ON d.event_id = {_LAST_DIRTY_0002}" + _PENDING
)

_INCARNATIONS_0005 = (
    _INCARNATIONS_HEAD
    + f"LEFT JOIN events d ON d.event_id = {_LAST_DIRTY} "
    + f"AND d.event_id > coalesce({_LAST_REPAIR}, 0)"
    + _PENDING
)

_SLOT_FINGERPRINTS = """
SELECT f.incarnation_id,
       f.layer,
       f.first_slot + j.key AS slot,
       f.version,
       json_extract(r.slots, '$[' || (f.first_slot + j.key) || ']') AS logical_expert,
       j.value AS fingerprint
FROM slot_fingerprints f
JOIN json_each(f.fingerprints) j
LEFT JOIN layout_rows r
    ON r.incarnation_id = f.incarnation_id AND r.layer = f.layer AND r.version = f.version
"""


def upgrade() -> None:
    op.create_table(
        "slot_fingerprints",
        sa.Column("row_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("incarnation_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("first_slot", sa.Integer(), nullable=False),
        sa.Column("fingerprints", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["incarnation_id", "version"],
            ["versions.incarnation_id", "versions.version"],
            ondelete="CASCADE",
            name="fk_slot_fingerprints_version",
        ),
        sa.UniqueConstraint(
            "incarnation_id", "layer", "version", name="uq_slot_fingerprints_layer_version"
        ),
    )
    op.execute("DROP VIEW ledger_incarnations")
    op.execute(f"CREATE VIEW ledger_incarnations AS {_INCARNATIONS_0005.strip()}")
    op.execute(f"CREATE VIEW ledger_slot_fingerprints AS {_SLOT_FINGERPRINTS.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW ledger_slot_fingerprints")
    op.execute("DROP VIEW ledger_incarnations")
    op.execute(f"CREATE VIEW ledger_incarnations AS {_INCARNATIONS_0004.strip()}")
    op.drop_table("slot_fingerprints")
