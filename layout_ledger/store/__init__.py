"""The ledger file: opening it, its schema and migrations, the SQLite journal, replay, upkeep."""
