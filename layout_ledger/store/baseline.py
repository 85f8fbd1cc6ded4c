"""What a restored load is checked against: fingerprints a clean load of the same checkpoint
recorded, never those of a load that went wrong.

A daemon that restores loads its checkpoint into the restored map and compares each local
slot with what its ledger knows of that expert's bytes. Those bytes belong to a checkpoint, not
to a version: a new checkpoint of the same geometry (fine-tuned or RL-updated weights) keeps the
placement and brings new bytes. So the ledger's knowledge is taken from its *baseline*: the
newest incarnation that loaded the same checkpoint (``identities``: its identity, and the one
older code recorded for it) and whose load was clean, with the fingerprints it recorded at its
newest version. An incarnation that was dirty from its own load (its start's transaction holds a
``content_dirty`` right after its ``start``, ``restore`` and ``checkpoint_changed`` events:
``load_was_dirty``) recorded what a bad load left, and is never a baseline, however many
restarts follow it. No baseline (a checkpoint this ledger never loaded cleanly): the load is
judged by the checks of any first load (replicas agree, no empty expert) and becomes one.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import Connection, text

from layout_ledger.core import events as ev
from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import DamagedRow, LedgerError
from layout_ledger.core.layout import Geometry, Map
from layout_ledger.store.rows import current_version, fingerprints_at, incarnation_rows, map_at

# The events of an incarnation's start transaction, before its load's verdict.
START_KINDS = (ev.START, ev.RESTORE, ev.CHECKPOINT_CHANGED)


@dataclass(frozen=True)
class Baseline:
    """The fingerprints ``incarnation`` recorded at its newest ``version`` (its map then), of a
    clean load of the checkpoint a daemon loads now."""

    incarnation: int
    version: int
    physical_to_logical_map: Map
    recorded: LocalFingerprints


def load_was_dirty(conn: Connection, incarnation_id: int) -> bool:
    """Whether the incarnation's own load marked it dirty: the first event after its start's
    (``START_KINDS``) is a ``content_dirty``. Its start and its load's verdict are one
    transaction (``Ledger.start_incarnation``), so no kill can separate them."""
    kinds = [
        str(kind)
        for (kind,) in conn.execute(
            text(
                "SELECT kind FROM events WHERE incarnation_id = :i ORDER BY event_id "
                f"LIMIT {len(START_KINDS) + 1}"
            ),
            {"i": incarnation_id},
        )
    ]
    after = [kind for kind in kinds if kind not in START_KINDS]
    return bool(after) and after[0] == ev.CONTENT_DIRTY


def newest_baseline(
    conn: Connection, identities: Collection[str], geometry: Geometry
) -> Baseline | None:
    """The newest incarnation of ``geometry`` whose checkpoint identity is one of
    ``identities``, whose load was clean and which recorded fingerprints: its baseline."""
    for inc in reversed(incarnation_rows(conn)):
        if isinstance(inc, DamagedRow):
            continue
        if inc.checkpoint_digest not in identities or inc.geometry != geometry:
            continue
        if load_was_dirty(conn, inc.incarnation_id):
            continue
        try:
            version, _ = current_version(conn, inc.incarnation_id)
            recorded = fingerprints_at(conn, inc, version)
            if recorded is None:
                continue
            the_map = map_at(conn, inc, version)
        except LedgerError:
            continue  # rows that cannot be read are no baseline (verify names them)
        return Baseline(inc.incarnation_id, version, the_map, recorded)
    return None
