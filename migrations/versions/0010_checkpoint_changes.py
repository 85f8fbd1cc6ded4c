"""Checkpoint changes: a restored incarnation that loads another checkpoint of the same geometry
keeps the placement and records so.

New event kind: ``checkpoint_changed``, right after a ``restore`` in the start's transaction
(its reason names the identity the ledger's latest incarnation recorded and the new one). From
this revision on, ``incarnations.checkpoint_digest`` also covers the weight files (their names,
sizes, inodes and change times: ``sglang_integration.daemon.checkpoint_identity``); rows of
older code keep the identity they recorded (config, index, load settings), which this code
counts as the same checkpoint as any whose structure gives that value.

A new forensic view, ``ledger_checkpoints`` (incarnation_id, checkpoint_digest,
restored_from_incarnation, restored_from_version, checkpoint_changed, load_dirty): per
incarnation, the checkpoint it loaded, whether its restore loaded another checkpoint than the one
before it, and whether its own load marked it dirty (the first event after its start's
``start``, ``restore`` and ``checkpoint_changed`` is a ``content_dirty``: such an incarnation's
fingerprints are never a later restore's baseline, ``layout_ledger.store.baseline``). The other
views are unchanged (the new kind is in ``ledger_events`` as every kind is).

The downgrade refuses a ledger holding a ``checkpoint_changed`` event: revision 0009's code
cannot replay it (its reader and ``verify`` would call the ledger damaged). Otherwise it drops
the view.

Revision ID: 0010_checkpoint_changes
Revises: 0009_heals
Create Date: 2026-12-07 02:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from layout_ledger.core.errors import SchemaDowngradeRefused

revision: str = "0010_checkpoint_changes"
down_revision: str | None = "0009_heals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here: this revision's event kind, whatever later code calls it.
_KIND = "checkpoint_changed"


_CHECKPOINTS = """
SELECT
    i.incarnation_id,
    i.checkpoint_digest,
    i.restored_from_incarnation,
    i.restored_from_version,
    EXISTS (
        SELECT 1 FROM events c
        WHERE c.incarnation_id = i.incarnation_id AND c.kind = 'checkpoint_changed'
    ) AS checkpoint_changed,
    coalesce((
        SELECT e.kind = 'content_dirty' FROM events e
        WHERE e.incarnation_id = i.incarnation_id
            AND e.kind NOT IN ('start', 'restore', 'checkpoint_changed')
        ORDER BY e.event_id LIMIT 1
    ), 0) AS load_dirty
FROM incarnations i
"""


def upgrade() -> None:
    op.execute(f"CREATE VIEW ledger_checkpoints AS {_CHECKPOINTS.strip()}")


def downgrade() -> None:
    found = (
        op.get_bind()
        .exec_driver_sql("SELECT count(*) FROM events WHERE kind = ?", (_KIND,))
        .scalar()
    )
    if found:
        raise SchemaDowngradeRefused(
            f"the ledger holds {found} checkpoint_changed events, which the code of revision "
            f"0009_heals cannot replay; keep this revision, or move the ledger aside "
            f"(`layout-ledger backup`) and start the older daemon on a new one"
        )
    op.execute("DROP VIEW ledger_checkpoints")
