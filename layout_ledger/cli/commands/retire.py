"""``layout-ledger retire`` and ``unretire``: stop counting a ledger whose GPU is gone for good.

A retirement is a note beside the ledger (``history.retirement``), never a change to the ledger:
``fleet`` shows the ledger as ``retired`` and reaches its verdict without it, ``metrics`` exports
nothing for it but ``ledger_retired`` (so no alert counts it), ``status`` says so (exit 0). It
names the ledger's latest incarnation, so a daemon that starts on the ledger again ends it. Only
a ledger whose daemon is known not to run can be retired. ``unretire`` undoes it; both are
recorded in the note (who, when, why). Exit 0, 1 when a ledger's daemon runs (or may), 2 for
no usable ledger.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from layout_ledger.cli import exit_codes
from layout_ledger.cli.atomic_files import write_atomically
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.state import utc_now
from layout_ledger.history.liveness import daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.history.retirement import (
    Retirement,
    RetirementStep,
    note_path,
    read_retirement,
)
from layout_ledger.store.files import FILE_MODE
from layout_ledger.store.rows import incarnation


def run(args: argparse.Namespace) -> int:
    return _run(args, "retire")


def run_unretire(args: argparse.Namespace) -> int:
    return _run(args, "unretire")


@dataclass(frozen=True)
class RetireResult(JsonShaped):
    """One ledger: what was done (``retired``, ``unretired``, ``unchanged``) and the note."""

    path: str
    note: str
    result: str
    incarnation_id: int
    step: RetirementStep | None  # the step in force afterwards (None: not retired)


@dataclass(frozen=True)
class RetireReport(JsonShaped):
    action: str
    ledgers: tuple[RetireResult, ...]


def _run(args: argparse.Namespace, action: str) -> int:
    paths = expand_ledger_paths(args.paths)
    reason = " ".join((getattr(args, "reason", None) or "no reason given").split())
    plans = [_plan(path, action) for path in paths]  # every refusal before any note is written
    results = tuple(_apply(plan, action, reason) for plan in plans)
    report = RetireReport(action, results)
    emit(args, report.to_json(), render_retire(report))
    return exit_codes.OK


@dataclass(frozen=True)
class _Plan:
    path: Path
    incarnation_id: int
    note: Retirement | None


def _plan(path: Path, action: str) -> _Plan:
    with LedgerReader(path) as ledger, ledger.connect() as conn:
        inc = incarnation(conn)
    note = read_retirement(path)
    if action == "retire":
        liveness = daemon_liveness(path, inc, latest=True)
        if liveness.alive is not False:
            raise LedgerError(
                f"the daemon of {path} is {liveness.detail}: a ledger is retired only when no "
                f"daemon writes it (stop that daemon first; a GPU back in service is counted "
                f"again by itself when a daemon starts on it)"
            )
    return _Plan(path, inc.incarnation_id, note)


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user} on {socket.gethostname()}"


def _apply(plan: _Plan, action: str, reason: str) -> RetireResult:
    note = plan.note or Retirement(())
    retired = note.applies_to(plan.incarnation_id)
    path = note_path(plan.path)
    if (action == "retire") == retired:  # already so
        return RetireResult(
            str(plan.path),
            str(path),
            "unchanged",
            plan.incarnation_id,
            note.last if retired else None,
        )
    step = RetirementStep(action, utc_now(), _who(), reason, plan.incarnation_id)
    steps = (*note.steps, step)
    data = json.dumps(Retirement(steps).to_json(), indent=2, sort_keys=True) + "\n"
    try:
        write_atomically(path, data.encode(), temporary_suffix=".tmp", mode=FILE_MODE)
    except LedgerError as exc:
        raise LedgerError(f"cannot record the {action} of {plan.path}: {exc}") from exc
    return RetireResult(
        str(plan.path),
        str(path),
        "retired" if action == "retire" else "unretired",
        plan.incarnation_id,
        step if action == "retire" else None,
    )


def render_retire(report: RetireReport) -> list[str]:
    lines = []
    for item in report.ledgers:
        inc = f"incarnation {item.incarnation_id}"
        if item.result == "retired":
            lines.append(
                f"retired {item.path} ({inc}): fleet, metrics and the alerts stop counting it; "
                f"recorded in {item.note}; undo with `layout-ledger unretire {item.path}`"
            )
        elif item.result == "unretired":
            lines.append(f"unretired {item.path} ({inc}): counted again; recorded in {item.note}")
        else:
            state = "retired" if report.action == "retire" else "not retired"
            lines.append(f"{item.path} ({inc}): already {state}; nothing changed")
    return lines
