"""``layout-ledger upgrade``: upgrade an older ledger's schema to this code's; refuse a newer one.

It opens the ledger the way its daemon does (the one-writer lock, then a writer connection), so
while a daemon owns the file it fails at once naming its holder, even with nothing to do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sqlalchemy.exc import DBAPIError

from layout_ledger.cli import exit_codes
from layout_ledger.cli.existing_ledger import require_existing, while_no_daemon_runs
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.core.errors import LedgerFileError, LedgerStorageError, SchemaOutdated
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.connections import open_writer
from layout_ledger.store.migrate import file_revision, upgrade_to_head
from layout_ledger.store.schema import SCHEMA_HEAD

# What the person at the CLI can do when the ledger's daemon runs.
_UPGRADE_INSTEAD = (
    "a daemon upgrades its own ledger when it starts, so a running daemon's ledger has its "
    "code's schema already; to upgrade it for a newer daemon, stop this one and start the new "
    "one (or run upgrade in between)"
)


def run(args: argparse.Namespace) -> int:
    result = upgrade_ledger(args.ledger)
    emit(args, result.to_json(), render_upgrade(result))
    return exit_codes.OK


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
    require_existing(path)
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
    with (
        while_no_daemon_runs("upgrade", _UPGRADE_INSTEAD),
        open_writer(path, create=False) as writer,
    ):
        if at_head:
            return UpgradeResult(str(path), SCHEMA_HEAD, SCHEMA_HEAD)
        conn = writer.connection
        try:
            revision = file_revision(conn)
            if revision is None:
                raise LedgerFileError(
                    f"{path} is an empty SQLite file, not a ledger (a daemon creates its "
                    f"ledger when it starts); name a ledger file"
                )
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
