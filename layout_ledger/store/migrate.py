"""The ledger's schema revision: read it, check it, upgrade it through Alembic.

Readers compare the file's revision with ``schema.KNOWN_REVISIONS`` without importing Alembic;
only a writer that must upgrade loads it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from sqlalchemy import Connection, inspect, text

from layout_ledger.core.errors import LedgerFileError, SchemaOutdated, SchemaTooNew
from layout_ledger.store.schema import KNOWN_REVISIONS, SCHEMA_HEAD

logger = logging.getLogger(__name__)


def migrations_dir() -> Path:
    """The Alembic environment: the top-level ``migrations/`` folder of a source tree, which an
    install ships as the package ``layout_ledger.migrations`` (setup.cfg ``package_dir``)."""
    beside = Path(__file__).resolve().parent.parent / "migrations"
    if (beside / "env.py").is_file():
        return beside
    spec = importlib.util.find_spec("layout_ledger.migrations")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not locations:
        raise LedgerFileError(
            "this installation of layout_ledger has no migrations (layout_ledger.migrations); "
            "reinstall the sglang-expert-layout-ledger package"
        )
    return Path(locations[0])


def alembic_config(connection: Connection | None = None):  # type: ignore[no-untyped-def]
    """An Alembic ``Config`` for the packaged migrations, optionally bound to ``connection``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def file_revision(conn: Connection) -> str | None:
    """The Alembic revision stamped in the file; None for an empty file."""
    tables = set(inspect(conn).get_table_names())
    if "alembic_version" not in tables:
        if tables:
            raise LedgerFileError(
                f"this SQLite file holds tables ({', '.join(sorted(tables))}) but is not an "
                f"expert layout ledger (no alembic_version); pass the path of a ledger"
            )
        return None
    rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    if len(rows) != 1:
        raise LedgerFileError(f"the ledger's alembic_version holds {len(rows)} rows; expected 1")
    return str(rows[0])


def refuse_newer(revision: str, path: Path) -> None:
    """Refuse a revision this code does not know (newer code wrote the file)."""
    if revision not in KNOWN_REVISIONS:
        raise SchemaTooNew(
            f"ledger {path} has schema revision {revision!r}, newer than this code knows "
            f"(newest known: {SCHEMA_HEAD!r}); upgrade the sglang-expert-layout-ledger package"
        )


def check_readable(conn: Connection, path: Path) -> None:
    """Refuse a file a read-only opener cannot interpret."""
    revision = file_revision(conn)
    if revision is None:
        raise LedgerFileError(f"{path} is an empty SQLite file, not an expert layout ledger")
    refuse_newer(revision, path)
    if revision != SCHEMA_HEAD:
        raise SchemaOutdated(
            f"ledger {path} has the older schema revision {revision!r}; run "
            f"`layout-ledger upgrade {path}` (or restart its daemon, which upgrades it)"
        )


def upgrade_to_head(conn: Connection, path: Path) -> str | None:
    """Bring a writer's file to ``SCHEMA_HEAD``; returns the revision it started from."""
    revision = file_revision(conn)
    if revision is not None:
        refuse_newer(revision, path)
        if revision == SCHEMA_HEAD:
            return revision
        logger.info("upgrading ledger %s from schema %s to %s", path, revision, SCHEMA_HEAD)
    from alembic import command

    command.upgrade(alembic_config(conn), "head")
    conn.commit()
    return revision
