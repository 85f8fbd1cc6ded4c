"""``layout-ledger uncordon``: lift the cordon (``cordon``'s module holds both verbs)."""

from __future__ import annotations

from layout_ledger.cli.commands.cordon import run_uncordon as run

__all__ = ["run"]
