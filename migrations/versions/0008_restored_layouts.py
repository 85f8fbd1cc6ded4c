"""Restored incarnations: what identifies the checkpoint, and which version a start restored.

``incarnations`` gains ``checkpoint_digest`` (what identifies the weights the daemon loaded:
its checkpoint's config and index, dtype and quantization; NULL for rows of older code and
daemons that know none) and ``restored_from_incarnation``, ``restored_from_version``,
``restored_from_digest`` and ``restored_from_source`` (``layout_ledger.core.state.RestoredFrom``):
the committed version whose number and digest the incarnation started at, NULL for an
incarnation that started at version 0 in sglang's initial layout. Such an incarnation's start
event names that version, and a ``restore`` event follows it. The forensic views are unchanged:
``ledger_events`` shows the ``restore`` event.

The downgrade refuses a ledger holding a restored incarnation: revision 0007's code starts every
incarnation at version 0, so it could not replay one (its reader and ``verify`` would call the
ledger damaged).

Revision ID: 0008_restored_layouts
Revises: 0007_fingerprint_digests
Create Date: 2026-12-06 09:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from layout_ledger.core.errors import SchemaDowngradeRefused

revision: str = "0008_restored_layouts"
down_revision: str | None = "0007_fingerprint_digests"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here: this revision's columns, whatever later code calls them.
_COLUMNS = (
    ("checkpoint_digest", sa.Text),
    ("restored_from_incarnation", sa.Integer),
    ("restored_from_version", sa.Integer),
    ("restored_from_digest", sa.Text),
    ("restored_from_source", sa.Text),
)


def upgrade() -> None:
    for name, kind in _COLUMNS:
        op.add_column("incarnations", sa.Column(name, kind()))


def downgrade() -> None:
    restored = (
        op.get_bind()
        .exec_driver_sql(
            "SELECT count(*) FROM incarnations WHERE restored_from_version IS NOT NULL"
        )
        .scalar()
    )
    if restored:
        raise SchemaDowngradeRefused(
            f"the ledger holds {restored} restored incarnations, which the code of revision "
            f"0007_fingerprint_digests cannot read (it starts every incarnation at version 0); "
            f"keep this revision, or move the ledger aside (`layout-ledger backup`) and start "
            f"the older daemon on a new one"
        )
    # SQLite's own DROP COLUMN (3.35+): a batch copy of the table would trip over the views.
    for name, _ in reversed(_COLUMNS):
        op.execute(f"ALTER TABLE incarnations DROP COLUMN {name}")
