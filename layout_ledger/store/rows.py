"""The ledger's rows as the code reads them: incarnations, versions, maps and fingerprints.

Every reader of a ledger goes through these queries: the daemon (its next start, its retention)
and the tools alike. The map at any held version is one indexed statement: O(layers), whatever
the history's length. Every value is a bound parameter (``in_list`` writes the placeholders).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text

from layout_ledger.core import events as ev
from layout_ledger.core.content import LocalFingerprints, is_fingerprint
from layout_ledger.core.errors import (
    DamagedRow,
    LedgerError,
    LedgerInconsistent,
    LedgerStorageError,
)
from layout_ledger.core.layout import Geometry, Map, is_digest
from layout_ledger.core.state import RestoredFrom
from layout_ledger.store.origin import COLUMNS as ORIGIN_COLUMNS
from layout_ledger.store.origin import IncarnationOrigin


@dataclass(frozen=True)
class Incarnation:
    incarnation_id: int
    started_at: str
    ended_at: str | None
    end_state: str | None
    geometry: Geometry
    initial_digest: str
    config_fingerprint: str
    daemon_label: str
    origin: IncarnationOrigin = field(default_factory=IncarnationOrigin)
    # What identifies the weights it loaded (None: older code, or a daemon that knows none).
    checkpoint_digest: str | None = None
    # The version it restored at its start (None: it started at version 0).
    restored_from: RestoredFrom | None = None

    @property
    def first_version(self) -> int:
        """The version it started at: 0, or the restored one."""
        return 0 if self.restored_from is None else self.restored_from.version


def _incarnation_from_row(row: Any) -> Incarnation:
    checkpoint = row.checkpoint_digest
    return Incarnation(
        incarnation_id=row.incarnation_id,
        started_at=row.started_at,
        ended_at=row.ended_at,
        end_state=row.end_state,
        geometry=_geometry_of(row),
        initial_digest=row.initial_digest,
        config_fingerprint=row.config_fingerprint,
        daemon_label=row.daemon_label,
        origin=IncarnationOrigin.from_row(row._mapping),
        checkpoint_digest=None if checkpoint is None else str(checkpoint),
        restored_from=_restored_from_of(row),
    )


def _restored_from_of(row: Any) -> RestoredFrom | None:
    """The row's restore columns (revision 0008): all NULL, or a version another incarnation
    committed; anything else is a ``DamagedRow``."""
    values = [getattr(row, name) for name in RESTORED_FROM_COLUMNS]
    incarnation_id, version, digest, source = values
    if all(value is None for value in values[:3]) and source is None:
        return None
    problem = None
    if type(incarnation_id) is not int or incarnation_id < 1:
        problem = "restored_from_incarnation", f"{incarnation_id!r} is not an incarnation id"
    elif type(version) is not int or version < 0:
        problem = "restored_from_version", f"{version!r} is not a version"
    elif not is_digest(digest):
        problem = "restored_from_digest", f"{digest!r} is not a digest"
    elif source is not None and not isinstance(source, str):
        problem = "restored_from_source", f"{source!r} is not text"
    if problem is not None:
        raise DamagedRow("incarnations", int(row.incarnation_id), *problem)
    return RestoredFrom(incarnation_id, version, str(digest), source)


# The ``incarnations`` columns of a restore (revision 0008), in ``RestoredFrom``'s field order.
RESTORED_FROM_COLUMNS = (
    "restored_from_incarnation",
    "restored_from_version",
    "restored_from_digest",
    "restored_from_source",
)


def _geometry_of(row: Any) -> Geometry:
    """The incarnation row's geometry; a value no daemon writes is a ``DamagedRow``."""
    column = "num_layers, num_physical_slots, num_logical_experts"
    for name in ("num_layers", "num_physical_slots", "num_logical_experts"):
        value = getattr(row, name)
        if type(value) is not int or value < 1:
            column = name
            break
    try:
        return Geometry(row.num_layers, row.num_physical_slots, row.num_logical_experts)
    except LedgerError as exc:
        raise DamagedRow("incarnations", int(row.incarnation_id), column, str(exc)) from exc


def incarnation_rows(conn: Connection) -> list[Incarnation | DamagedRow]:
    """Every incarnation, or for a row that cannot be interpreted, why (oldest first)."""
    rows = conn.execute(
        text(f"SELECT {_INCARNATION_COLUMNS} FROM incarnations ORDER BY incarnation_id")
    )
    parsed: list[Incarnation | DamagedRow] = []
    for row in rows:
        try:
            parsed.append(_incarnation_from_row(row))
        except DamagedRow as exc:
            parsed.append(exc)
    return parsed


_INCARNATION_COLUMNS = (
    "incarnation_id, started_at, ended_at, end_state, num_layers, num_physical_slots, "
    "num_logical_experts, initial_digest, config_fingerprint, daemon_label, "
    + ", ".join((*ORIGIN_COLUMNS, "checkpoint_digest", *RESTORED_FROM_COLUMNS))
)


def incarnations(conn: Connection) -> list[Incarnation]:
    """Every incarnation, oldest first (a row that cannot be interpreted raises ``DamagedRow``)."""
    rows = conn.execute(
        text(f"SELECT {_INCARNATION_COLUMNS} FROM incarnations ORDER BY incarnation_id")
    )
    return [_incarnation_from_row(row) for row in rows]


def incarnation(conn: Connection, incarnation_id: int | None = None) -> Incarnation:
    """One incarnation; the latest when ``incarnation_id`` is None."""
    if incarnation_id is None:
        row = conn.execute(
            text(
                f"SELECT {_INCARNATION_COLUMNS} FROM incarnations "
                f"ORDER BY incarnation_id DESC LIMIT 1"
            )
        ).first()
        if row is None:
            raise LedgerError("the ledger holds no incarnation yet (no daemon has started on it)")
    else:
        row = conn.execute(
            text(f"SELECT {_INCARNATION_COLUMNS} FROM incarnations WHERE incarnation_id = :i"),
            {"i": incarnation_id},
        ).first()
        if row is None:
            raise LedgerError(f"the ledger has no incarnation {incarnation_id}")
    return _incarnation_from_row(row)


def current_version(conn: Connection, incarnation_id: int) -> tuple[int, str]:
    """The incarnation's newest version and its digest."""
    row = conn.execute(
        text(
            "SELECT version, digest FROM versions WHERE incarnation_id = :i "
            "ORDER BY version DESC LIMIT 1"
        ),
        {"i": incarnation_id},
    ).first()
    if row is None:
        raise LedgerStorageError(
            f"incarnation {incarnation_id} has no version rows (not even its first); the ledger "
            f"is damaged, run `layout-ledger verify`"
        )
    return int(row.version), str(row.digest)


def reconstructible_from(conn: Connection, incarnation_id: int) -> int:
    """The oldest version whose whole map the rows still hold: the incarnation's first version
    (0, or the one it restored; ``versions`` rows are never pruned), raised by ``prune``."""
    pruned, first = conn.execute(
        text(
            "SELECT (SELECT max(base_version) FROM events WHERE incarnation_id = :i AND kind = :k),"
            " (SELECT min(version) FROM versions WHERE incarnation_id = :i)"
        ),
        {"i": incarnation_id, "k": ev.PRUNE},
    ).one()
    return max(int(pruned or 0), int(first or 0))


# One statement, one index seek per layer: for each layer 0..n-1, the newest row at or before
# the version (the unique (incarnation_id, layer, version) index, searched backwards). Its cost
# grows with the number of layers and the index's depth, never with the history's length.
_LAYERS = (
    "WITH RECURSIVE layers(layer) AS ("
    "  SELECT 0 UNION ALL SELECT layer + 1 FROM layers WHERE layer + 1 < :n"
    ") "
)
_ROWS_AT = text(
    _LAYERS + "SELECT layer, ("
    "  SELECT slots FROM layout_rows"
    "  WHERE incarnation_id = :i AND layer = layers.layer AND version <= :v"
    "  ORDER BY version DESC LIMIT 1"
    ") AS slots FROM layers ORDER BY layer"
)


def row_jsons_at(conn: Connection, inc: Incarnation, version: int) -> list[str]:
    """Each layer's row JSON at ``version``: one index seek per layer."""
    rows = conn.execute(
        _ROWS_AT, {"n": inc.geometry.num_layers, "i": inc.incarnation_id, "v": version}
    ).all()
    jsons = []
    for layer, slots in rows:
        if slots is None:
            raise LedgerStorageError(
                f"incarnation {inc.incarnation_id} has no row for layer {layer} at or before "
                f"version {version}; run `layout-ledger verify`"
            )
        jsons.append(str(slots))
    return jsons


# Per layer, the version of its row in effect at :v and the fingerprint row beside it: one seek
# in each unique (incarnation_id, layer, version) index per layer, as _ROWS_AT.
_FINGERPRINTS_AT = text(
    _LAYERS + ", written AS ("
    "  SELECT layer, ("
    "    SELECT version FROM layout_rows"
    "    WHERE incarnation_id = :i AND layer = layers.layer AND version <= :v"
    "    ORDER BY version DESC LIMIT 1"
    "  ) AS version FROM layers"
    ") SELECT w.layer, w.version, f.row_id, f.first_slot, f.fingerprints FROM written w "
    "LEFT JOIN slot_fingerprints f ON f.incarnation_id = :i AND f.layer = w.layer "
    "AND f.version = w.version WHERE w.version IS NOT NULL ORDER BY w.layer"
)
# The layers with any fingerprint row: one seek per layer.
_FINGERPRINTED_LAYERS = text(
    _LAYERS + "SELECT layer FROM layers WHERE EXISTS ("
    "  SELECT 1 FROM slot_fingerprints WHERE incarnation_id = :i AND layer = layers.layer"
    ")"
)


def fingerprints_at(conn: Connection, inc: Incarnation, version: int) -> LocalFingerprints | None:
    """The daemon's recorded slot fingerprints at ``version``, or None when it recorded none.

    Per layer, the fingerprints written beside the layer's row in effect at ``version`` (the
    newest at or before it), never another version's: a fingerprinted layer whose row has no
    fingerprint row beside it, or a row that is not a JSON list of fingerprints, raises
    ``LedgerInconsistent`` (the ledger fails ``verify``).
    """
    n, i = inc.geometry.num_layers, inc.incarnation_id
    fingerprinted = {
        int(layer) for (layer,) in conn.execute(_FINGERPRINTED_LAYERS, {"n": n, "i": i}).all()
    }
    if not fingerprinted:
        return None
    rows = conn.execute(_FINGERPRINTS_AT, {"n": n, "i": i, "v": version}).all()
    layers: dict[int, tuple[str, ...]] = {}
    first_slots = set()
    for layer, written, row_id, first_slot, values in rows:
        if int(layer) not in fingerprinted:
            continue
        if row_id is None:
            raise LedgerInconsistent(
                f"incarnation {inc.incarnation_id}: version {written} wrote layer {layer}'s row "
                f"but no slot fingerprints beside it (deleted?); run `layout-ledger verify`"
            )
        try:
            parsed = json.loads(values)
        except (TypeError, ValueError):
            parsed = None
        if not isinstance(parsed, list) or not all(is_fingerprint(v) for v in parsed):
            raise LedgerInconsistent(
                f"slot_fingerprints row {row_id} (layer {layer}, version {written}) is not a "
                f"JSON list of fingerprints; run `layout-ledger verify`"
            )
        layers[int(layer)] = tuple(parsed)
        first_slots.add(int(first_slot))
    if not layers:
        return None
    return LocalFingerprints(min(first_slots), layers)


def map_at(conn: Connection, inc: Incarnation, version: int | None = None) -> Map:
    """The whole map at ``version`` (the current one when None)."""
    current, _ = current_version(conn, inc.incarnation_id)
    if version is None:
        version = current
    oldest = reconstructible_from(conn, inc.incarnation_id)
    if not oldest <= version <= current:
        raise LedgerError(
            f"incarnation {inc.incarnation_id} holds versions {oldest}..{current}; "
            f"version {version} is not among them"
            + (" (older versions were pruned)" if version < oldest else "")
        )
    return [json.loads(slots) for slots in row_jsons_at(conn, inc, version)]


def in_list(name: str, values: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """``(:name0, :name1, ...)`` for ``column IN ...`` over ``values``, and its parameters."""
    marks = ", ".join(f":{name}{n}" for n in range(len(values)))
    return f"({marks})", {f"{name}{n}": value for n, value in enumerate(values)}
