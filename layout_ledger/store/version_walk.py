"""Replaying an incarnation's held versions from its rows, oldest first.

The ledger stores per version only the rows of the layers that commit moved. ``walk_versions``
starts from the whole map at the oldest reconstructible version and applies each later
version's rows in order, so every held version's whole map is rebuilt in one pass over the rows
(O(rows), not O(versions x layers) queries). ``check_version_digests`` recomputes every held
version's digest from it (``verify``, and the daemon's retention before it drops rows); ``plot
--moves`` counts the slots each commit moved.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from layout_ledger.core.errors import InvalidRequest, LedgerError, LedgerStorageError
from layout_ledger.core.layout import digest_of_row_jsons, validate_row
from layout_ledger.store.rows import Incarnation, reconstructible_from, row_jsons_at


class WalkInconsistency(LedgerError):
    """The rows of an incarnation cannot be replayed into whole maps."""


@dataclass(frozen=True)
class VersionStep:
    """One held version, rebuilt: what the ``versions`` row records and what the rows give."""

    version: int
    committed_at: str
    engine_id: str | None
    recorded_digest: str
    recorded_layers: tuple[int, ...]
    written_layers: tuple[int, ...]  # layers with a row at exactly this version
    row_jsons: tuple[str, ...]  # the whole map after this version, one JSON text per layer
    moved_slots: int | None  # slots whose expert changed since the previous version (None first)

    @property
    def computed_digest(self) -> str:
        return digest_of_row_jsons(self.row_jsons)


def _parse_row(slots: str, inc: Incarnation, layer: int, version: int) -> list[int]:
    what = f"incarnation {inc.incarnation_id} layer {layer} version {version}"
    try:
        value: Any = json.loads(slots)
    except ValueError as exc:
        raise WalkInconsistency(f"{what}: the row is not JSON ({exc})") from exc
    try:
        return validate_row(value, inc.geometry, f"the row of {what}")
    except InvalidRequest as exc:
        raise WalkInconsistency(str(exc)) from exc


def _floor_map(conn: Connection, inc: Incarnation, floor: int) -> tuple[list[str], list[list[int]]]:
    """The whole map at the reconstructible floor: its rows' JSON texts and parsed rows."""
    try:
        row_jsons = row_jsons_at(conn, inc, floor)
    except LedgerStorageError as exc:
        raise WalkInconsistency(str(exc)) from exc
    rows = [_parse_row(slots, inc, layer, floor) for layer, slots in enumerate(row_jsons)]
    return row_jsons, rows


def _layers_written_at(conn: Connection, incarnation_id: int, version: int) -> list[int]:
    return [
        int(layer)
        for layer in conn.execute(
            text(
                "SELECT layer FROM layout_rows WHERE incarnation_id = :i AND version = :v "
                "ORDER BY layer"
            ),
            {"i": incarnation_id, "v": version},
        ).scalars()
    ]


# No upper bound: the largest version SQLite can store.
_NO_BOUND = 2**63 - 1


def _held_versions(conn: Connection, incarnation_id: int, floor: int, until: int) -> list[Any]:
    versions = conn.execute(
        text(
            "SELECT version, digest, committed_at, engine_id, layers FROM versions "
            "WHERE incarnation_id = :i AND version >= :floor AND version <= :until "
            "ORDER BY version"
        ),
        {"i": incarnation_id, "floor": floor, "until": until},
    ).all()
    if not versions or versions[0].version != floor:
        raise WalkInconsistency(
            f"incarnation {incarnation_id} holds rows from version {floor} but has no versions "
            f"row for it"
        )
    return list(versions)


class _LaterRows:
    """The rows after the floor, streamed in (version, layer) order beside the versions: memory
    stays O(layers) however long the history is."""

    def __init__(self, conn: Connection, incarnation_id: int, floor: int, until: int) -> None:
        self._incarnation_id = incarnation_id
        self._rows = iter(
            conn.execute(
                text(
                    "SELECT layer, version, slots FROM layout_rows "
                    "WHERE incarnation_id = :i AND version > :floor AND version <= :until "
                    "ORDER BY version, layer"
                ),
                {"i": incarnation_id, "floor": floor, "until": until},
            )
        )
        self._next: Any = next(self._rows, None)

    def of_version(self, version: int) -> Iterator[Any]:
        """The rows written at exactly ``version`` (consume them all before the next call); a
        row of an earlier version still waiting has no versions row."""
        while self._next is not None and self._next.version <= version:
            row, self._next = self._next, next(self._rows, None)
            if row.version != version:
                raise _orphan(self._incarnation_id, row)
            yield row

    def finish(self) -> None:
        """After the last version: any row left has no versions row."""
        if self._next is not None:
            raise _orphan(self._incarnation_id, self._next)


def _apply_row(
    inc: Incarnation, version: int, row: Any, rows: list[list[int]], row_jsons: list[str]
) -> int:
    """Put ``row`` (written at ``version``) into the whole map; returns the slots it changed."""
    layer = int(row.layer)
    if not 0 <= layer < inc.geometry.num_layers:
        raise WalkInconsistency(
            f"incarnation {inc.incarnation_id} version {version} has a row for layer {layer}, "
            f"outside 0..{inc.geometry.num_layers - 1}"
        )
    new = _parse_row(row.slots, inc, layer, version)
    moved = sum(1 for a, b in zip(rows[layer], new, strict=True) if a != b)
    rows[layer] = new
    row_jsons[layer] = str(row.slots)
    return moved


def _recorded_layers(incarnation_id: int, version: int, version_row: Any) -> tuple[int, ...]:
    try:
        return tuple(int(layer) for layer in json.loads(version_row.layers))
    except (ValueError, TypeError) as exc:
        raise WalkInconsistency(
            f"incarnation {incarnation_id} version {version}: its layers column is not a JSON list"
        ) from exc


def walk_versions(
    conn: Connection, inc: Incarnation, until: int = _NO_BOUND
) -> Iterator[VersionStep]:
    """Every held version of ``inc`` from the reconstructible floor to the current one (or to
    ``until``): the rows are read in one pass, never beyond ``until``."""
    i = inc.incarnation_id
    floor = reconstructible_from(conn, i)
    row_jsons, rows = _floor_map(conn, inc, floor)
    floor_layers = _layers_written_at(conn, i, floor)
    versions = _held_versions(conn, i, floor, until)
    later = _LaterRows(conn, i, floor, until)
    for index, version_row in enumerate(versions):
        version = int(version_row.version)
        written: list[int] = []
        moved: int | None = None
        if index == 0:
            written = floor_layers
        else:
            moved = 0
            for row in later.of_version(version):
                moved += _apply_row(inc, version, row, rows, row_jsons)
                written.append(int(row.layer))
        yield VersionStep(
            version=version,
            committed_at=str(version_row.committed_at),
            engine_id=version_row.engine_id,
            recorded_digest=str(version_row.digest),
            recorded_layers=_recorded_layers(i, version, version_row),
            written_layers=tuple(written),
            row_jsons=tuple(row_jsons),
            moved_slots=moved,
        )
    later.finish()


def _orphan(incarnation_id: int, row: Any) -> WalkInconsistency:
    return WalkInconsistency(
        f"incarnation {incarnation_id} has a row of layer {row.layer} at version {row.version}, "
        f"which has no versions row"
    )


def check_version_digests(
    conn: Connection, inc: Incarnation, before: int | None = None
) -> tuple[int | None, int | None]:
    """Every held version (those below ``before``) rebuilt from its rows gives its digest, and
    its rows are exactly the layers it lists; returns the first and last version checked, or
    raises ``WalkInconsistency`` naming the first that does not."""
    first = last = None
    steps = walk_versions(conn, inc) if before is None else walk_versions(conn, inc, before - 1)
    for step in steps:
        if first is None:
            first = step.version
        last = step.version
        if sorted(step.recorded_layers) != list(step.written_layers):
            raise WalkInconsistency(
                f"version {step.version} lists layers {sorted(step.recorded_layers)} but "
                f"has rows for layers {list(step.written_layers)}"
            )
        computed = step.computed_digest
        if computed != step.recorded_digest:
            raise WalkInconsistency(
                f"version {step.version} records digest {step.recorded_digest[:12]} but its "
                f"rows give {computed[:12]}"
            )
    return first, last
