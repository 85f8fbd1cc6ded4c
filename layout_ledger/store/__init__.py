"""The ledger file: opening it, its schema and migrations, the record's SQLite journal, the rows
read back and replayed, retention and checkpoints (the daemon's write path and what it needs)."""
