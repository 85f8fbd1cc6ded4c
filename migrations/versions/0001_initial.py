"""The ledger's tables: incarnations, versions, layout rows, events.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29 13:00:00

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "incarnations",
        sa.Column("incarnation_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("started_at", sa.Text(), nullable=False),
        sa.Column("ended_at", sa.Text()),
        sa.Column("end_state", sa.Text()),
        sa.Column("config_fingerprint", sa.Text(), nullable=False),
        sa.Column("daemon_label", sa.Text(), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_physical_slots", sa.Integer(), nullable=False),
        sa.Column("num_logical_experts", sa.Integer(), nullable=False),
        sa.Column("initial_map", sa.Text(), nullable=False),
        sa.Column("initial_digest", sa.Text(), nullable=False),
        sa.CheckConstraint(
            "end_state IS NULL OR end_state IN ('clean', 'dirty', 'unknown')",
            name="ck_incarnations_end_state",
        ),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "versions",
        sa.Column(
            "incarnation_id",
            sa.Integer(),
            sa.ForeignKey("incarnations.incarnation_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("committed_at", sa.Text(), nullable=False),
        sa.Column("engine_id", sa.Text()),
        sa.Column("layers", sa.Text(), nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "layout_rows",
        sa.Column("row_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("incarnation_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("slots", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["incarnation_id", "version"],
            ["versions.incarnation_id", "versions.version"],
            ondelete="CASCADE",
            name="fk_layout_rows_version",
        ),
        sa.UniqueConstraint(
            "incarnation_id", "layer", "version", name="uq_layout_rows_layer_version"
        ),
    )
    op.create_table(
        "events",
        sa.Column("event_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "incarnation_id",
            sa.Integer(),
            sa.ForeignKey("incarnations.incarnation_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("engine_id", sa.Text()),
        sa.Column("layers", sa.Text()),
        sa.Column("base_version", sa.Integer()),
        sa.Column("new_version", sa.Integer()),
        sa.Column("digest_after", sa.Text()),
        sa.Column("reason", sa.Text()),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_events_incarnation_kind", "events", ["incarnation_id", "kind", "event_id"])
    op.create_index("ix_events_engine", "events", ["engine_id"])


def downgrade() -> None:
    op.drop_index("ix_events_engine", table_name="events")
    op.drop_index("ix_events_incarnation_kind", table_name="events")
    op.drop_table("events")
    op.drop_table("layout_rows")
    op.drop_table("versions")
    op.drop_table("incarnations")
