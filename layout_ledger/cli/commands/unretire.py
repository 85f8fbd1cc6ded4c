"""``layout-ledger unretire``: count a retired ledger again (``retire``'s module holds both)."""

from __future__ import annotations

from layout_ledger.cli.commands.retire import run_unretire as run

__all__ = ["run"]
