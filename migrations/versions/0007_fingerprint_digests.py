"""Each version's slot fingerprints covered by the event chain: ``versions.fingerprints_digest``.

``fingerprints_digest`` (nullable) is SHA-256 over the slot fingerprint rows the version wrote
(``layout_ledger.store.chain.fingerprints_digest``); a version written by this code with
fingerprints has it, and its start, commit or repair event's chain link covers it
(``chain.link``). Rows of older code have NULL: their links are the old ones, verified as before.
Versions rows are never pruned, so the chain stays verifiable after the fingerprint rows of old
versions are pruned; where a version's rows are still held, ``verify`` recomputes the digest.

Revision ID: 0007_fingerprint_digests
Revises: 0006_engine_roles
Create Date: 2026-12-02 12:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_fingerprint_digests"
down_revision: str | None = "0006_engine_roles"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("versions", sa.Column("fingerprints_digest", sa.Text()))


def downgrade() -> None:
    # SQLite's own DROP COLUMN (3.35+): a batch copy of the table would trip over the views.
    # The chain values of events that covered a digest no longer follow from the rows then;
    # a downgraded file verifies only up to them (the older code knows no digest).
    op.execute("ALTER TABLE versions DROP COLUMN fingerprints_digest")
