"""``layout-ledger prune``: remove the layout rows of old versions; the current map and every
event stay.

It opens the ledger the way its daemon does (the one-writer lock, then a writer connection), so
while a daemon owns the file it fails at once naming its holder, and it runs only on a ledger
that passes ``verify`` (it never destroys evidence).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from layout_ledger.cli import exit_codes
from layout_ledger.cli.existing_ledger import require_existing
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.core.errors import LedgerInconsistent
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.rows import (
    current_version,
    incarnation,
    incarnations,
    reconstructible_from,
)


def run(args: argparse.Namespace) -> int:
    result = prune_ledger(args.ledger, args.keep, args.incarnation)
    emit(args, result.to_json(), render_prune(result))
    return exit_codes.OK


@dataclass(frozen=True)
class PrunedIncarnation(JsonShaped):
    incarnation_id: int
    rows_removed: int
    reconstructible_from: int
    current_version: int


@dataclass(frozen=True)
class PruneResult(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("rows_removed",)

    path: str
    keep: int
    incarnations: tuple[PrunedIncarnation, ...]

    @property
    def rows_removed(self) -> int:
        return sum(inc.rows_removed for inc in self.incarnations)


def prune_ledger(path: str | Path, keep: int, incarnation_id: int | None = None) -> PruneResult:
    """Keep the rows of each incarnation's last ``keep`` versions (``Ledger.prune``)."""
    path = Path(path)
    require_existing(path)
    # Read-only first: a file of an older schema is reported (run `upgrade`), never upgraded as
    # a side effect of a prune; a file of a newer one is refused before any lock is taken.
    LedgerReader(path).close()
    ledger = Ledger.open(path)
    try:
        _refuse_inconsistent(path)
        removed = {
            report.incarnation_id: report.rows_removed
            for report in ledger.prune(keep, incarnation_id)
        }
        with ledger.transaction("reading") as conn:
            targets = (
                [incarnation(conn, incarnation_id)]
                if incarnation_id is not None
                else incarnations(conn)
            )
            pruned = tuple(
                PrunedIncarnation(
                    incarnation_id=inc.incarnation_id,
                    rows_removed=removed.get(inc.incarnation_id, 0),
                    reconstructible_from=reconstructible_from(conn, inc.incarnation_id),
                    current_version=current_version(conn, inc.incarnation_id)[0],
                )
                for inc in targets
            )
    finally:
        ledger.close()
    return PruneResult(str(path), keep, pruned)


def _refuse_inconsistent(path: Path) -> None:
    """Prune never destroys evidence: it runs only on a ledger that passes ``verify``."""
    with LedgerReader(path) as ledger:
        report = collect_verify(ledger)
    if not report.ok:
        raise LedgerInconsistent(
            f"prune refused, the ledger fails verification (first: "
            f"{report.first_inconsistency}); nothing was removed. Find out what changed it "
            f"(`layout-ledger verify {path}`) and keep a copy before pruning it"
        )


def render_prune(result: PruneResult) -> list[str]:
    if not result.incarnations:
        return ["the ledger holds no incarnation; nothing to prune"]
    lines = []
    for inc in result.incarnations:
        held = f"holds versions {inc.reconstructible_from}..{inc.current_version}"
        if inc.rows_removed:
            lines.append(
                f"incarnation {inc.incarnation_id}: removed {inc.rows_removed} layout rows older "
                f"than version {inc.reconstructible_from}; {held}"
            )
        else:
            lines.append(f"incarnation {inc.incarnation_id}: nothing to remove; {held}")
    lines.append(f"removed {result.rows_removed} layout rows in all (every event kept)")
    return lines
