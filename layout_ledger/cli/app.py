"""``layout-ledger``: parse the command line, run the chosen verb, map its errors to exit codes.

Only the chosen verb's module (``layout_ledger.cli.commands.<verb>``) is imported, after the
arguments parse, so ``--version`` and ``--help`` import neither SQLAlchemy nor any verb (nor
logging, json or the error types: a health check that asks ``--version`` pays for the
interpreter and argparse, scripts/bench_cli.py). A
``LedgerError`` becomes one line on stderr and a non-zero exit (``exit_codes``), never a
traceback; so does a bad argument.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Callable, Sequence

from layout_ledger.cli import exit_codes
from layout_ledger.cli.parser import PROG, UsageError, parse


def _configure_logging() -> None:
    import logging

    from layout_ledger.cli.terminal import PrintableFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


def _verb(command: str) -> Callable[[argparse.Namespace], int]:
    """The chosen verb's ``run`` (its module imported now, and only it).

    The cyclic garbage collector is paused while the verb's modules import (SQLAlchemy's
    among them: its passes over every new object cost a tenth of a ``status``,
    scripts/bench_cli.py), and what they allocated is frozen, never traversed again (module
    objects live as long as the process: ``metrics --serve`` and ``history --follow`` too).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        module = importlib.import_module(f"layout_ledger.cli.commands.{command}")
    finally:
        if was_enabled:
            gc.enable()
    gc.freeze()
    run: Callable[[argparse.Namespace], int] = module.run
    return run


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
    except UsageError as exc:
        from layout_ledger.cli.terminal import printable

        sys.stderr.write(f"{printable(str(exc))}\n")
        return exit_codes.UNUSABLE
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0)
    _configure_logging()
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    import json
    import os

    from sqlalchemy.exc import SQLAlchemyError

    from layout_ledger.cli.output import print_error
    from layout_ledger.core.errors import (
        LedgerError,
        LedgerFileError,
        LedgerInconsistent,
        LedgerStorageError,
        SchemaOutdated,
        SchemaTooNew,
    )

    # Errors that mean "this file is no usable ledger (for this code)"; every other
    # LedgerError means the command could not do what was asked.
    unusable_errors = (LedgerFileError, LedgerStorageError, SchemaOutdated, SchemaTooNew)

    try:
        from layout_ledger.cli.default_ledgers import fill_default_ledgers

        fill_default_ledgers(args)
        return _verb(args.command)(args)
    except unusable_errors as exc:
        print_error(args.command, str(exc))
        return exit_codes.UNUSABLE
    except LedgerInconsistent as exc:
        print_error(args.command, str(exc))
        return exit_codes.INCONSISTENT
    except LedgerError as exc:
        print_error(args.command, str(exc))
        return exit_codes.FAILED
    except (SQLAlchemyError, json.JSONDecodeError) as exc:
        # Rows the reader cannot interpret (a missing version, a row that is not JSON): the
        # file is damaged; verify names what exactly.
        named: str | list[str] = getattr(args, "ledger", None) or getattr(args, "paths", [])
        where = named if isinstance(named, str) else " ".join(map(str, named))
        print_error(
            args.command,
            f"the ledger {where} looks damaged ({type(exc).__name__}: {exc}); run "
            f"`{PROG} verify {where}`",
        )
        return exit_codes.UNUSABLE
    except KeyboardInterrupt:
        print_error(args.command, "interrupted")
        return exit_codes.INTERRUPTED
    except BrokenPipeError:
        # The reader of our stdout went away (| head): it has what it wanted. Stop quietly and
        # exit 0, in every output form (text, --json, --nl, --csv), as `| head` expects.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
