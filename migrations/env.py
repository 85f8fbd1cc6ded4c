"""Alembic environment for the ledger.

Two ways in:
- programmatic (``layout_ledger.store.migrate``): the caller passes its open writer connection in
  ``config.attributes["connection"]``, already holding the ledger's writer lock;
- command line: ``alembic -x url=sqlite:///PATH upgrade head`` opens PATH the way the daemon
  does (writer lock, WAL, 0600), so it fails at once while a daemon owns the file.
"""

from __future__ import annotations

from pathlib import Path

from alembic import context
from sqlalchemy.engine import make_url

from layout_ledger.store.schema import metadata

config = context.config


def _configure_and_run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("pass the ledger as: alembic -x url=sqlite:///PATH upgrade head")
    return url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=metadata, literal_binds=True, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    from layout_ledger.store.connections import open_writer

    database = make_url(_url()).database
    if not database:
        raise SystemExit("the url must name a ledger file: sqlite:///PATH")
    with open_writer(Path(database)) as writer:
        _configure_and_run(writer.connection)
        writer.connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
