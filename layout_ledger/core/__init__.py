"""The rulebook: the layout record, its rules, events, state and errors, the layout and content
values, and the startup verdict the engine and ``layout-ledger fleet`` share. No SQLite, no
sglang: the standard library (and orjson when present) only."""
