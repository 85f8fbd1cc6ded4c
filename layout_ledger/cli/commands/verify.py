"""``layout-ledger verify``: the integrity checks of ``history.checks``, one line each.

Exit 5 on the first inconsistency found, else 0. On a terminal, a progress line names the check
running once the work takes a second (``cli.progress``).
"""

from __future__ import annotations

import argparse

from layout_ledger.cli import exit_codes
from layout_ledger.cli.json_shape import json_object
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.progress import Progress
from layout_ledger.history.checks import VerifyReport, collect_verify
from layout_ledger.history.reader import LedgerReader


def run(args: argparse.Namespace) -> int:
    with LedgerReader(args.ledger) as ledger, Progress("verify") as progress:
        collected = collect_verify(ledger, progress.phase)
    emit(args, json_object(collected), render_verify(collected))
    if collected.ok:
        return exit_codes.OK
    print_error("verify", f"inconsistent: {collected.first_inconsistency}")
    return exit_codes.INCONSISTENT


def render_verify(report: VerifyReport) -> list[str]:
    lines = [f"ledger {report.path} (schema {report.schema_revision})"]
    for result in report.checks:
        verdict = "ok" if result.ok else "INCONSISTENT"
        detail = "" if result.ok and result.detail == "ok" else f": {result.detail}"
        lines.append(f"{result.label}: {verdict}{detail}")
    if report.ok:
        lines.append("verified: no inconsistency")
    else:
        lines.append(
            f"{len(report.inconsistencies)} inconsistent; first: {report.first_inconsistency}"
        )
    return lines
