"""The events' hash chain: each event row carries SHA-256 over the previous row's chain value
and its own fields, so an edit, an insertion or a deletion anywhere in the history changes
every chain value after it.

A chain can be recomputed by whoever edits the file, so the daemon logs the chain head with each
commit (``layout_ledger.store.ledger``): a copy of the daemon's log proves what the file held then,
and ``layout-ledger verify`` recomputes the chain and prints its head to compare with the log.

The definition is part of the file format: it never changes in place (a new definition would be
a new schema revision that recomputes the chain). Revision 0003 computes it for the rows older
ledgers hold, with this module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

# The chain value "before" the first event of a ledger.
GENESIS = "0" * 64

# The ``events`` columns a link covers, in this order (``event_id`` is not among them: a row's
# place is its predecessor's chain value, which every link includes).
FIELDS = (
    "incarnation_id",
    "at",
    "kind",
    "engine_id",
    "layers",
    "base_version",
    "new_version",
    "digest_after",
    "reason",
    "count",
    "last_at",
)


def link(previous: str, row: Sequence[Any]) -> str:
    """The chain value of a row whose ``FIELDS`` values are ``row``, after ``previous``."""
    encoded = json.dumps([previous, *row], separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()
