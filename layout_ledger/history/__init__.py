"""Reading a ledger for the tools: the reader, verify's checks, overviews, daemon liveness."""
