"""Forensics: ``layout-ledger status``, ``history`` and ``verify`` on the dirty daemon's ledger of
case 3 (b), and the runbook's ``sqlite3`` query naming the engine that left it dirty."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demo_cases.results import CaseResult, yes


@dataclass(frozen=True)
class CommandOutput:
    command: str
    exit_code: int
    output: str


def layout_ledger_command() -> str:
    """The console script beside this Python (the venv's ``bin/layout-ledger``)."""
    import shutil

    beside = Path(sys.executable).parent / "layout-ledger"
    if beside.exists():
        return str(beside)
    found = shutil.which("layout-ledger")
    if found is None:
        raise FileNotFoundError("the layout-ledger console script is not installed")
    return found


def run_layout_ledger(args: list[str]) -> CommandOutput:
    """``layout-ledger ARGS`` through the console script: its command line, exit and output."""
    completed = subprocess.run(
        [layout_ledger_command(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return CommandOutput(
        " ".join(["layout-ledger", *args]),
        completed.returncode,
        (completed.stdout + completed.stderr).rstrip(),
    )


def readme_query(readme: Path, name: str) -> str:
    """The SQL of the cookbook's block (docs/operations.md) that starts ``-- forensic: NAME``."""
    text = readme.read_text()
    for block in re.findall(r"```sql\n(.*?)```", text, flags=re.DOTALL):
        first = block.splitlines()[0].strip()
        if first == f"-- forensic: {name}":
            return str(block).strip()
    raise LookupError(f"{readme} has no sql block '-- forensic: {name}'")


def run_sql_read_only(ledger: str, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The rows of ``sql`` on the ledger opened read-only, as the cookbook says to open it."""
    connection = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        cursor = connection.execute(sql)
        columns = [description[0] for description in cursor.description]
        return columns, cursor.fetchall()
    finally:
        connection.close()


def run_forensics(
    ledger: str, readme: Path, case3: CaseResult, history_last: int = 12
) -> tuple[CaseResult, list[CommandOutput], tuple[str, list[str], list[tuple[Any, ...]]]]:
    """``layout-ledger status/history/verify`` and the cookbook's dirty query on one ledger."""
    result = CaseResult("Forensics: the ledger of case 3 (b)'s rank-0 daemon")
    started = time.monotonic()
    outputs = [
        run_layout_ledger([args[0], ledger, *args[1:]])
        for args in (["status"], ["history", "--last", str(history_last)], ["verify"])
    ]
    status, history, verify = outputs
    result.check(
        "layout-ledger status: state, exit code",
        "dirty, 3",
        f"{_status_state(status.output)}, {status.exit_code}",
        status.exit_code == 3 and _status_state(status.output) == "dirty",
    )
    result.check(
        "layout-ledger history: the dirty event is there",
        "yes",
        yes("  dirty " in history.output),
        history.exit_code == 0 and "  dirty " in history.output,
    )
    result.check(
        "layout-ledger verify: exit code", "0", str(verify.exit_code), verify.exit_code == 0
    )
    sql = readme_query(readme, "dirty")
    columns, rows = run_sql_read_only(ledger, sql)
    engine_a = case3.facts.get("engine_a")
    row = dict(zip(columns, rows[0], strict=True)) if rows else {}
    result.check(
        "runbook query 'dirty': engine, layers, base version",
        f"A, {case3.facts.get('layers')}, {case3.facts.get('base')}",
        (
            f"{'A' if row.get('engine_id') == engine_a else row.get('engine_id')}, "
            f"{row.get('layers')}, {row.get('base_version')}"
            if row
            else "no row"
        ),
        len(rows) == 1
        and row.get("engine_id") == engine_a
        and json.loads(str(row.get("layers"))) == case3.facts.get("layers")
        and row.get("base_version") == case3.facts.get("base"),
    )
    result.seconds = time.monotonic() - started
    return result, outputs, (sql, columns, rows)


def _status_state(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("state:"):
            return line.split(":", 1)[1].strip()
    return "?"
