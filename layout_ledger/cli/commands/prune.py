"""``layout-ledger prune``: remove the layout rows of old versions; the current map and every
event stay.

It opens the ledger the way its daemon does (the one-writer lock, then a writer connection), so
while a daemon owns the file it fails at once naming its holder, and it runs only on a ledger
that passes ``verify`` (it never destroys evidence). Deleted rows leave free pages, which SQLite
reuses but never gives back: a prune that removed rows then runs ``VACUUM`` (it owns the file,
no daemon runs, so no commit waits for it; ``--no-vacuum`` skips it). The daemon's own retention
never vacuums: it runs beside the daemon's commits, and its freed pages hold the next commits'
rows, so the file stops growing at its retention's size (``incremental_vacuum`` would need
``auto_vacuum`` chosen when the file was created, and a full ``VACUUM`` of every existing
ledger to switch it on). ``--dry-run`` says what a prune would remove, reading only, also while
a daemon runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from layout_ledger.cli import exit_codes
from layout_ledger.cli.existing_ledger import require_existing, while_no_daemon_runs
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.cli.progress import Progress
from layout_ledger.core.errors import LedgerInconsistent
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.retention import prunable_rows
from layout_ledger.store.rows import (
    current_version,
    incarnation,
    incarnations,
    reconstructible_from,
)

# What the person at the CLI can do when the ledger's daemon runs.
_PRUNE_INSTEAD = (
    "a running daemon prunes its own ledger (--expert-layout-keep-versions, "
    "--expert-layout-prune-every); to prune now, stop that daemon (`layout-ledger status LEDGER` "
    "shows its pid), then run prune again, or try --dry-run, which reads only"
)


def run(args: argparse.Namespace) -> int:
    with Progress("prune") as progress:
        if args.dry_run:
            result = prune_dry_run(args.ledger, args.keep, args.incarnation)
        else:
            result = prune_ledger(
                args.ledger,
                args.keep,
                args.incarnation,
                vacuum=not args.no_vacuum,
                on_phase=progress.phase,
            )
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
    dry_run: bool = False
    vacuumed: bool = False  # VACUUM ran after the rows were removed
    bytes_before: int = 0  # the file and its -wal, before the prune
    bytes_after: int = 0  # and after it (after the VACUUM, if one ran)

    @property
    def rows_removed(self) -> int:
        return sum(inc.rows_removed for inc in self.incarnations)


def _bytes(path: Path) -> int:
    total = 0
    for file in (path, path.with_name(path.name + "-wal")):
        with contextlib.suppress(OSError):
            total += os.stat(file).st_size
    return total


def prune_dry_run(path: str | Path, keep: int, incarnation_id: int | None = None) -> PruneResult:
    """What ``prune_ledger`` would remove, read only (the same refusals, nothing written)."""
    path = Path(path)
    require_existing(path)
    _refuse_inconsistent(path)
    with LedgerReader(path) as ledger, ledger.connect() as conn:
        targets = (
            [incarnation(conn, incarnation_id)]
            if incarnation_id is not None
            else incarnations(conn)
        )
        found = []
        for inc in targets:
            current = current_version(conn, inc.incarnation_id)[0]
            would = prunable_rows(conn, inc, keep)
            held_from = reconstructible_from(conn, inc.incarnation_id)
            found.append(
                PrunedIncarnation(
                    incarnation_id=inc.incarnation_id,
                    rows_removed=0 if would is None else would[1],
                    reconstructible_from=held_from if would is None else would[0],
                    current_version=current,
                )
            )
    size = _bytes(path)
    return PruneResult(str(path), keep, tuple(found), True, False, size, size)


def prune_ledger(
    path: str | Path,
    keep: int,
    incarnation_id: int | None = None,
    *,
    vacuum: bool = True,
    on_phase: Callable[[str], None] | None = None,
) -> PruneResult:
    """Keep the rows of each incarnation's last ``keep`` versions (``Ledger.prune``), then
    ``VACUUM`` when rows were removed (unless ``vacuum`` is False)."""
    path = Path(path)
    require_existing(path)
    before = _bytes(path)
    # Read-only first: a file of an older schema is reported (run `upgrade`), never upgraded as
    # a side effect of a prune; a file of a newer one is refused before any lock is taken.
    LedgerReader(path).close()
    phase = on_phase or (lambda text: None)
    with while_no_daemon_runs("prune", _PRUNE_INSTEAD):
        ledger = Ledger.open(path)
    try:
        _refuse_inconsistent(path, lambda text: phase(f"verify first: {text}"))
        phase("removing the rows of old versions")
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
        vacuumed = vacuum and any(inc.rows_removed for inc in pruned)
        if vacuumed:
            phase("VACUUM (giving the freed pages back to the file system)")
            ledger.vacuum()
    finally:
        ledger.close()
    return PruneResult(str(path), keep, pruned, False, vacuumed, before, _bytes(path))


def _refuse_inconsistent(path: Path, on_phase: Callable[[str], None] | None = None) -> None:
    """Prune never destroys evidence: it runs only on a ledger that passes ``verify``."""
    with LedgerReader(path) as ledger:
        report = collect_verify(ledger, on_phase)
    if not report.ok:
        raise LedgerInconsistent(
            f"prune refused, the ledger fails verification (first: "
            f"{report.first_inconsistency}); nothing was removed. Find out what changed it "
            f"(`layout-ledger verify {path}`) and keep a copy before pruning it"
        )


def render_prune(result: PruneResult) -> list[str]:
    if not result.incarnations:
        return ["the ledger holds no incarnation; nothing to prune"]
    removed, held_word = ("would remove", "would hold") if result.dry_run else ("removed", "holds")
    lines = []
    for inc in result.incarnations:
        held = f"{held_word} versions {inc.reconstructible_from}..{inc.current_version}"
        if inc.rows_removed:
            lines.append(
                f"incarnation {inc.incarnation_id}: {removed} {inc.rows_removed} layout rows "
                f"older than version {inc.reconstructible_from}; {held}"
            )
        else:
            lines.append(f"incarnation {inc.incarnation_id}: nothing to remove; {held}")
    lines.append(f"{removed} {result.rows_removed} layout rows in all (every event kept)")
    if result.dry_run:
        lines.append("dry run: nothing was removed")
    elif result.vacuumed:
        lines.append(
            f"VACUUM: file and -wal {result.bytes_before} -> {result.bytes_after} bytes "
            f"({result.bytes_before - result.bytes_after} freed)"
        )
    return lines
