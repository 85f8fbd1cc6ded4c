"""Reading a ledger's history: the reader, version walks, verify's checks, overviews, liveness."""
