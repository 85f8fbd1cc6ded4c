"""What a verb prints: its result on stdout, its error lines on stderr.

A result is its ``--json`` object (sort_keys), its ``--nl``/``--csv`` rows (``row_formats``), or
its human lines; every human line and every error line passes through ``terminal.printable``,
so what a ledger holds is shown on the terminal, never obeyed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.parser import PROG
from layout_ledger.cli.row_formats import write_rows
from layout_ledger.cli.terminal import printable

# A listing's rows: its columns in order, and one object per row.
Rows = tuple[Sequence[str], Sequence[JsonObject]]


def emit(
    args: argparse.Namespace,
    payload: JsonObject,
    lines: Sequence[str],
    rows: Rows | None = None,
) -> None:
    """The command's result on stdout: ``--json``, ``--nl``/``--csv`` rows, or human lines
    (each through ``printable``: a ledger's text never drives the terminal)."""
    form = getattr(args, "rows", None)
    if args.json:
        sys.stdout.write(json.dumps(payload, sort_keys=True, indent=2) + "\n")
    elif form is not None:
        if rows is None:
            raise ValueError(f"{args.command} has no rows to print as {form}")
        write_rows(sys.stdout, form, *rows)
    else:
        sys.stdout.write("".join(printable(line) + "\n" for line in lines))


def print_note(command: str, message: str) -> None:
    """One line on stderr about how the command was read (stdout stays the result alone)."""
    sys.stderr.write(f"{PROG} {command}: {printable(' '.join(message.split()))}\n")


def print_warning(command: str, message: str) -> None:
    """One warning line on stderr (the command goes on), as ``print_error`` writes errors."""
    sys.stderr.write(f"{PROG} {command}: warning: {printable(' '.join(message.split()))}\n")


def print_error(command: str | None, message: str) -> None:
    """One line on stderr: whitespace (line breaks included) runs become one space, every
    other control character a visible escape."""
    prefix = PROG if command is None else f"{PROG} {command}"
    one_line = printable(" ".join(message.split()))
    sys.stderr.write(f"{prefix}: error: {one_line}\n")
