"""The runbook's sections a command's message or an alert points to (docs/operations.md).

One constant per section, its heading as the page writes it; ``see`` is how a message names it.
tests/test_runbook_links.py checks every one is a heading of the page, and that every alert's
``runbook_url`` is the anchor of one.
"""

from __future__ import annotations

RUNBOOK = "docs/operations.md"

DIRTY = "... because a daemon is dirty"
DISAGREE = "... because the daemons disagree"
PENDING = "... because a move is pending, or stuck"
PAUSED = "Rebalancing paused"
DIED = "A daemon died, or restarted"
WAL_HELD = "The daemon logs that a reader holds the WAL"
BACKUPS = "Backups: never `cp` a live ledger"

SECTIONS = (DIRTY, DISAGREE, PENDING, PAUSED, DIED, WAL_HELD, BACKUPS)


def see(section: str) -> str:
    """A section as a message names it: ``docs/operations.md, "... because a daemon is dirty"``."""
    return f'{RUNBOOK}, "{section}"'
