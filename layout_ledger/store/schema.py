"""The ledger's tables (SQLAlchemy Core) and the schema version this code writes.

The tables are append-only except ``incarnations.ended_at/end_state`` and pruning: the state a
restarted process needs (pending move, dirty mark, non-following flag, current version and
digest) is derived from ``events`` and ``versions`` (``layout_ledger.store.replay``), so a
crash between any two statements can never leave a cached flag out of step with the history.

Forensic views (``ledger_*``) are created by the migrations; they are the stable interface for
``sqlite3`` users, while these tables may change between schema revisions.
"""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Column,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
)

# The Alembic revision of the newest schema this code reads and writes (migrations/versions/).
# Mixed versions: a writer upgrades an older file to this revision when it opens it; a file at
# a revision not in KNOWN_REVISIONS was written by newer code and is refused by every opener,
# read-only ones included, because its tables may no longer mean what this code assumes.
SCHEMA_HEAD = "0010_checkpoint_changes"
KNOWN_REVISIONS = (
    "0001_initial",
    "0002_forensic_views",
    "0003_event_counts_and_chain",
    "0004_incarnation_origin",
    "0005_slot_fingerprints",
    "0006_engine_roles",
    "0007_fingerprint_digests",
    "0008_restored_layouts",
    "0009_heals",
    "0010_checkpoint_changes",
)

metadata = MetaData()

incarnations = Table(
    "incarnations",
    metadata,
    Column("incarnation_id", Integer, primary_key=True, autoincrement=True),
    Column("started_at", Text, nullable=False),
    Column("ended_at", Text),
    Column("end_state", Text),
    Column("config_fingerprint", Text, nullable=False),
    Column("daemon_label", Text, nullable=False),
    Column("num_layers", Integer, nullable=False),
    Column("num_physical_slots", Integer, nullable=False),
    Column("num_logical_experts", Integer, nullable=False),
    Column("initial_map", Text, nullable=False),
    Column("initial_digest", Text, nullable=False),
    # Where the incarnation ran (layout_ledger.store.origin); NULL where unknown or older (0004).
    Column("host", Text),
    Column("device_uuid", Text),
    Column("gpu_id", Integer),
    Column("tp_rank", Integer),
    Column("pp_rank", Integer),
    Column("ep_rank", Integer),
    Column("pid", Integer),
    Column("socket_path", Text),
    Column("sglang_version", Text),
    Column("plugin_version", Text),
    # What identifies the weights the daemon loaded (its checkpoint's config and index, dtype,
    # quantization): a restore needs the same; NULL for rows of older code (0008).
    Column("checkpoint_digest", Text),
    # The committed version whose number and digest the incarnation started at (a restore,
    # layout_ledger.core.state.RestoredFrom); all NULL for a start at version 0 (0008).
    Column("restored_from_incarnation", Integer),
    Column("restored_from_version", Integer),
    Column("restored_from_digest", Text),
    Column("restored_from_source", Text),
    # Whether the incarnation could heal itself from its checkpoint: ``auto``, ``off`` or
    # ``unavailable: REASON`` (decided at load); NULL for rows of older code (0009).
    Column("heal", Text),
    CheckConstraint(
        "end_state IS NULL OR end_state IN ('clean', 'dirty', 'unknown')",
        name="ck_incarnations_end_state",
    ),
    sqlite_autoincrement=True,
)

versions = Table(
    "versions",
    metadata,
    Column(
        "incarnation_id",
        Integer,
        ForeignKey("incarnations.incarnation_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("digest", Text, nullable=False),
    Column("committed_at", Text, nullable=False),
    Column("engine_id", Text),
    # JSON array of the layers whose rows this version wrote (every layer for version 0).
    Column("layers", Text, nullable=False),
    # SHA-256 over the slot fingerprint rows this version wrote (store.chain.fingerprints_digest);
    # its event's chain link covers it. NULL: none written, or written before revision 0007.
    Column("fingerprints_digest", Text),
    sqlite_with_rowid=False,
)

# A rowid table (rows are ~1 KiB, too large to be B-tree keys cheaply), looked up through the
# unique (incarnation_id, layer, version) index: the newest row of a layer at or before a
# version is one index seek.
layout_rows = Table(
    "layout_rows",
    metadata,
    Column("row_id", Integer, primary_key=True, autoincrement=True),
    Column("incarnation_id", Integer, nullable=False),
    Column("layer", Integer, nullable=False),
    Column("version", Integer, nullable=False),
    # Compact JSON array of ints: the logical expert in each physical slot of this layer.
    Column("slots", Text, nullable=False),
    ForeignKeyConstraint(
        ["incarnation_id", "version"],
        ["versions.incarnation_id", "versions.version"],
        ondelete="CASCADE",
        name="fk_layout_rows_version",
    ),
    UniqueConstraint("incarnation_id", "layer", "version", name="uq_layout_rows_layer_version"),
)

# Written beside layout_rows (same key): the fingerprints of one daemon's local slots of a layer
# at a version that wrote the layer's row (layout_ledger.core.content; 64 hex digits per slot).
slot_fingerprints = Table(
    "slot_fingerprints",
    metadata,
    Column("row_id", Integer, primary_key=True, autoincrement=True),
    Column("incarnation_id", Integer, nullable=False),
    Column("layer", Integer, nullable=False),
    Column("version", Integer, nullable=False),
    # The physical slot of the first fingerprint; the others follow it.
    Column("first_slot", Integer, nullable=False),
    # Compact JSON array of fingerprints (strings).
    Column("fingerprints", Text, nullable=False),
    ForeignKeyConstraint(
        ["incarnation_id", "version"],
        ["versions.incarnation_id", "versions.version"],
        ondelete="CASCADE",
        name="fk_slot_fingerprints_version",
    ),
    UniqueConstraint(
        "incarnation_id", "layer", "version", name="uq_slot_fingerprints_layer_version"
    ),
)

events = Table(
    "events",
    metadata,
    Column("event_id", Integer, primary_key=True, autoincrement=True),
    Column(
        "incarnation_id",
        Integer,
        ForeignKey("incarnations.incarnation_id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("at", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("engine_id", Text),
    Column("layers", Text),
    Column("base_version", Integer),
    Column("new_version", Integer),
    Column("digest_after", Text),
    Column("reason", Text),
    # Identical consecutive refusals are one row: how many, and the time of the last.
    Column("count", Integer, nullable=False, server_default="1"),
    Column("last_at", Text),
    # SHA-256 over the previous row's chain value and this row's fields (layout_ledger.store.chain).
    Column("chain", Text),
    sqlite_autoincrement=True,
)
Index(
    "ix_events_incarnation_kind",
    events.c.incarnation_id,
    events.c.kind,
    events.c.event_id,
)
Index("ix_events_engine", events.c.engine_id)
