"""``--nl`` and ``--csv``: the row-per-line forms of a listing command, written once.

A command that lists rows (``history``'s events, ``diff``'s changed slots) hands its rows here
as JSON objects with its columns in order. ``nl`` writes one JSON object per line, keys in
column order; ``csv`` a header and one row per row, lists as JSON text, ``None`` empty, and text
through ``terminal.printable`` (a CSV is read on terminals too; ``--nl`` keeps bytes exact).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from typing import Any, TextIO

from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.terminal import printable

ROW_FORMATS = ("nl", "csv")


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value)
    return printable(str(value))


def write_rows(
    stream: TextIO,
    form: str,
    columns: Sequence[str],
    rows: Sequence[JsonObject],
    *,
    header: bool = True,
) -> None:
    """Write ``rows`` (objects with exactly ``columns``) to ``stream`` as ``form`` (a CSV's
    header line only when ``header``: ``history --follow`` writes more rows later)."""
    if form == "nl":
        for row in rows:
            stream.write(json.dumps({column: row[column] for column in columns}) + "\n")
    elif form == "csv":
        writer = csv.writer(stream)
        if header:
            writer.writerow(columns)
        writer.writerows([_csv_cell(row[column]) for column in columns] for row in rows)
    else:
        raise ValueError(f"unknown row format {form!r}; expected one of {ROW_FORMATS}")
