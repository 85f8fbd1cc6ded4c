"""The two writing commands of ``layout-ledger``: ``prune`` and ``upgrade``.

Both open the ledger the way its daemon does (the one-writer lock, then a writer connection),
so while a daemon owns the file they fail at once with ``LedgerLocked`` naming its holder,
and neither ever creates a ledger: a missing path is an error, not a new file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sqlalchemy.exc import DBAPIError

from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.core.errors import (
    LedgerFileError,
    LedgerInconsistent,
    LedgerStorageError,
    SchemaOutdated,
)
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.connections import open_writer
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.migrate import file_revision, upgrade_to_head
from layout_ledger.store.rows import (
    current_version,
    incarnation,
    incarnations,
    reconstructible_from,
)
from layout_ledger.store.schema import SCHEMA_HEAD


def _require_existing(path: Path) -> None:
    if not path.exists():
        raise LedgerFileError(f"ledger {path} does not exist")
    if not path.is_file():
        raise LedgerFileError(f"ledger {path} is not a regular file")


# --- prune --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrunedIncarnation(JsonShaped):
    incarnation_id: int
    rows_removed: int
    reconstructible_from: int
    current_version: int


@dataclass(frozen=True)
class PruneResult(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("rows_removed",)

    path: str
    keep: int
    incarnations: tuple[PrunedIncarnation, ...]

    @property
    def rows_removed(self) -> int:
        return sum(inc.rows_removed for inc in self.incarnations)


def prune_ledger(path: str | Path, keep: int, incarnation_id: int | None = None) -> PruneResult:
    """Keep the rows of each incarnation's last ``keep`` versions (``Ledger.prune``)."""
    path = Path(path)
    _require_existing(path)
    # Read-only first: a file of an older schema is reported (run `upgrade`), never upgraded as
    # a side effect of a prune; a file of a newer one is refused before any lock is taken.
    LedgerReader(path).close()
    ledger = Ledger.open(path)
    try:
        _refuse_inconsistent(path)
        removed = {
            report.incarnation_id: report.rows_removed
            for report in ledger.prune(keep, incarnation_id)
        }
        with ledger.transaction("reading") as conn:
            targets = (
                [incarnation(conn, incarnation_id)]
                if incarnation_id is not None
                else incarnations(conn)
            )
            pruned = tuple(
                PrunedIncarnation(
                    incarnation_id=inc.incarnation_id,
                    rows_removed=removed.get(inc.incarnation_id, 0),
                    reconstructible_from=reconstructible_from(conn, inc.incarnation_id),
                    current_version=current_version(conn, inc.incarnation_id)[0],
                )
                for inc in targets
            )
    finally:
        ledger.close()
    return PruneResult(str(path), keep, pruned)


def _refuse_inconsistent(path: Path) -> None:
    """Prune never destroys evidence: it runs only on a ledger that passes ``verify``."""
    from layout_ledger.history.checks import collect_verify

    with LedgerReader(path) as ledger:
        report = collect_verify(ledger)
    if not report.ok:
        raise LedgerInconsistent(
            f"prune refused, the ledger fails verification (first: "
            f"{report.first_inconsistency}); nothing was removed. Find out what changed it "
            f"(`layout-ledger verify {path}`) and keep a copy before pruning it"
        )


def render_prune(result: PruneResult) -> list[str]:
    if not result.incarnations:
        return ["the ledger holds no incarnation; nothing to prune"]
    lines = []
    for inc in result.incarnations:
        held = f"holds versions {inc.reconstructible_from}..{inc.current_version}"
        if inc.rows_removed:
            lines.append(
                f"incarnation {inc.incarnation_id}: removed {inc.rows_removed} layout rows older "
                f"than version {inc.reconstructible_from}; {held}"
            )
        else:
            lines.append(f"incarnation {inc.incarnation_id}: nothing to remove; {held}")
    lines.append(f"removed {result.rows_removed} layout rows in all (every event kept)")
    return lines


# --- upgrade ------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpgradeResult(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("upgraded",)

    path: str
    from_revision: str
    to_revision: str

    @property
    def upgraded(self) -> bool:
        return self.from_revision != self.to_revision


def upgrade_ledger(path: str | Path) -> UpgradeResult:
    """Upgrade an existing ledger's schema to ``SCHEMA_HEAD``; refuse a newer one."""
    path = Path(path)
    _require_existing(path)
    # Read-only first, so a file that is no ledger of ours (not SQLite, another application's
    # database, a newer schema) is refused before anything touches it: the writer connection
    # would switch it to WAL and create a lock file beside it.
    try:
        LedgerReader(path).close()
    except SchemaOutdated:
        at_head = False
    else:
        at_head = True
    # A writing command fails while a daemon owns the file, even with nothing to do.
    with open_writer(path, create=False) as writer:
        if at_head:
            return UpgradeResult(str(path), SCHEMA_HEAD, SCHEMA_HEAD)
        conn = writer.connection
        try:
            revision = file_revision(conn)
            if revision is None:
                raise LedgerFileError(f"{path} is an empty SQLite file, not a ledger")
            if conn.in_transaction():
                conn.commit()
            upgrade_to_head(conn, path)
        except DBAPIError as exc:
            if "not a database" in str(exc.orig):
                raise LedgerFileError(f"{path} is not an SQLite database") from exc
            raise LedgerStorageError(f"upgrading ledger {path} failed: {exc.orig}") from exc
    return UpgradeResult(str(path), revision, SCHEMA_HEAD)


def render_upgrade(result: UpgradeResult) -> list[str]:
    if result.upgraded:
        return [
            f"upgraded ledger {result.path} from schema {result.from_revision} to "
            f"{result.to_revision}"
        ]
    return [f"ledger {result.path} is already at schema {result.to_revision}; nothing to do"]
