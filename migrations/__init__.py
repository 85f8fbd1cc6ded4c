"""Alembic environment and revisions of the expert layout ledger schema (see alembic.ini)."""
