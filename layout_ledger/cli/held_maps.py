"""The map a ledger holds at one version, for the verbs that read one (show, diff, export, plot).

Also the two things those verbs say of its geometry: its ``--json`` keys, and whether an
``--ep-size`` splits its physical slots evenly (show, plot and export --check ask the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map
from layout_ledger.store.rows import Incarnation, current_version, incarnation, map_at


@dataclass(frozen=True)
class HeldMap:
    """A whole map at one version of one incarnation, with the digest the ledger recorded."""

    incarnation: Incarnation
    version: int
    digest: str
    physical_to_logical_map: Map


def held_map(conn: Connection, incarnation_id: int | None, version: int | None) -> HeldMap:
    """The map at ``version`` (current when None) of an incarnation (latest when None)."""
    inc = incarnation(conn, incarnation_id)
    current, _ = current_version(conn, inc.incarnation_id)
    chosen = current if version is None else version
    the_map = map_at(conn, inc, chosen)
    return HeldMap(inc, chosen, version_digest(conn, inc.incarnation_id, chosen), the_map)


def version_digest(conn: Connection, incarnation_id: int, version: int) -> str:
    digest = conn.execute(
        text("SELECT digest FROM versions WHERE incarnation_id = :i AND version = :v"),
        {"i": incarnation_id, "v": version},
    ).scalar()
    if digest is None:
        raise LedgerError(
            f"incarnation {incarnation_id} has no version {version}; `layout-ledger status` "
            f"shows the versions it holds (history held), `--incarnation N` picks another"
        )
    return str(digest)


def geometry_json(geometry: Geometry) -> JsonObject:
    return {
        "num_layers": geometry.num_layers,
        "num_physical_slots": geometry.num_physical_slots,
        "num_logical_experts": geometry.num_logical_experts,
    }


def check_ep_size(ep_size: int, geometry: Geometry) -> None:
    """``--ep-size`` must split every layer's physical slots evenly into the EP ranks' shares,
    as an engine's EP size does (the one check of show, plot and export --check)."""
    if ep_size < 1:
        raise LedgerError(f"--ep-size must be at least 1, got {ep_size}")
    slots = geometry.num_physical_slots
    if slots % ep_size:
        raise LedgerError(
            f"--ep-size {ep_size} does not divide the {slots} physical slots per layer; pass the "
            f"EP size the engines run with"
        )
