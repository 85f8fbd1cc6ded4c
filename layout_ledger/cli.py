"""``layout-ledger``: the operator's command line over an expert layout ledger.

Each verb is a thin wrapper: parse arguments, call one typed function of ``report``, ``verify``,
``plot`` or ``admin``, print its human text or its ``--json`` object (sort_keys), return
the exit code (``layout_ledger.exit_codes``). A ``LedgerError`` becomes one line on stderr and a
non-zero exit, never a traceback; so does a bad argument. Read commands open the ledger
read-only and work while its daemon writes. No verb imports sglang or torch except
``export --check``, which loads ``layout_ledger.sglang_export_check`` when asked to.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from sqlalchemy.exc import SQLAlchemyError

from layout_ledger import admin, exit_codes, report
from layout_ledger.errors import (
    LedgerError,
    LedgerFileError,
    LedgerStorageError,
    SchemaOutdated,
    SchemaTooNew,
)
from layout_ledger.reader import LedgerReader

PROG = "layout-ledger"

# Errors that mean "this file is no usable ledger (for this code)"; every other LedgerError
# means the command could not do what was asked.
UNUSABLE_ERRORS = (LedgerFileError, LedgerStorageError, SchemaOutdated, SchemaTooNew)

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A bad command line; argparse's message, on one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and never exits by itself."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# --- argument types -----------------------------------------------------------------------


def _non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {number}")
    return number


def _positive(value: str) -> int:
    number = _non_negative(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {number}")
    return number


def _layers_spec(value: str) -> tuple[int, ...]:
    """``0,3,5-7`` -> (0, 3, 5, 6, 7): sorted, without duplicates."""
    layers: set[int] = set()
    for raw in value.split(","):
        part = raw.strip()
        first, dash, last = part.partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected layers like 0,3,5-7, got {value!r}"
            ) from None
        if low < 0 or high < low:
            raise argparse.ArgumentTypeError(f"bad layer range {part!r} in {value!r}")
        layers.update(range(low, high + 1))
    return tuple(sorted(layers))


def _timestamp(value: str) -> str:
    """An ISO-8601 time (no zone = UTC) as the ledger writes times, so text order is time order."""
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO-8601 time like 2026-11-29T13:00:00Z, got {value!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.astimezone(datetime.timezone.utc).isoformat(timespec="microseconds")


def _pixels(value: str) -> tuple[int, int]:
    width, x, height = value.lower().partition("x")
    try:
        if not x:
            raise ValueError(value)
        return int(width), int(height)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxHEIGHT like 1200x800, got {value!r}"
        ) from None


# --- output -------------------------------------------------------------------------------


def _emit(args: argparse.Namespace, payload: dict[str, Any], human: str) -> None:
    if args.json:
        sys.stdout.write(json.dumps(payload, sort_keys=True, indent=2) + "\n")
    else:
        sys.stdout.write(human + "\n")


def _error(command: str | None, message: str) -> None:
    prefix = PROG if command is None else f"{PROG} {command}"
    one_line = " ".join(message.split())
    sys.stderr.write(f"{prefix}: error: {one_line}\n")


@contextmanager
def _reading(args: argparse.Namespace) -> Iterator[LedgerReader]:
    ledger = LedgerReader(args.ledger)
    try:
        yield ledger
    finally:
        ledger.close()


# --- the verbs ----------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    with _reading(args) as ledger:
        collected = report.collect_status(ledger, args.incarnation)
    _emit(args, collected.to_json(), report.render_status(collected))
    return collected.exit_code


def cmd_history(args: argparse.Namespace) -> int:
    wanted = report.HistoryFilter(
        incarnation_id=args.incarnation,
        engine_id=args.engine,
        layers=args.layers or (),
        kinds=tuple(args.kind or ()),
        since=args.since,
        until=args.until,
        last=args.last,
    )
    with _reading(args) as ledger:
        collected = report.collect_history(ledger, wanted)
    _emit(args, collected.to_json(), report.render_history(collected))
    return exit_codes.OK


def cmd_show(args: argparse.Namespace) -> int:
    with _reading(args) as ledger:
        collected = report.collect_show(
            ledger,
            incarnation_id=args.incarnation,
            version=args.version,
            layers=args.layers,
            ep_size=args.ep_size,
        )
    _emit(args, collected.to_json(), report.render_show(collected))
    return exit_codes.OK


def cmd_diff(args: argparse.Namespace) -> int:
    with _reading(args) as ledger:
        collected = report.collect_diff(
            ledger,
            args.from_version,
            args.to_version,
            incarnation_id=args.incarnation,
            layers=args.layers,
        )
    _emit(args, collected.to_json(), report.render_diff(collected, slots=args.slots))
    return exit_codes.OK


def cmd_export(args: argparse.Namespace) -> int:
    with _reading(args) as ledger:
        exported, the_map = report.export_map(
            ledger, args.output, incarnation_id=args.incarnation, version=args.version
        )
    payload = exported.to_json()
    human = report.render_export(exported)
    payload["check"] = None
    code = exit_codes.OK
    if args.check:
        from layout_ledger import sglang_export_check

        check = sglang_export_check.check_export(
            args.output, args.model_path, the_map, exported.geometry, ep_size=args.ep_size
        )
        payload["check"] = check.to_json()
        human += f"\ncheck with sglang: {'ok' if check.equal else 'FAILED'}: {check.detail}"
        if not check.equal:
            code = exit_codes.INCONSISTENT
            _error("export", f"check failed: {check.detail}")
    _emit(args, payload, human)
    return code


def cmd_verify(args: argparse.Namespace) -> int:
    from layout_ledger import verify

    with _reading(args) as ledger:
        collected = verify.collect_verify(ledger)
    _emit(args, collected.to_json(), verify.render_verify(collected))
    if collected.ok:
        return exit_codes.OK
    _error("verify", f"inconsistent: {collected.first_inconsistency}")
    return exit_codes.INCONSISTENT


def cmd_plot(args: argparse.Namespace) -> int:
    from layout_ledger import plot

    width, height = args.size
    with _reading(args) as ledger:
        collected = plot.plot_layout(
            ledger,
            args.output,
            incarnation_id=args.incarnation,
            version=args.version,
            ep_size=args.ep_size,
            moves=args.moves,
            width=width,
            height=height,
        )
    _emit(args, collected.to_json(), plot.render_plot(collected))
    return exit_codes.OK


def cmd_prune(args: argparse.Namespace) -> int:
    result = admin.prune_ledger(args.ledger, args.keep, args.incarnation)
    _emit(args, result.to_json(), admin.render_prune(result))
    return exit_codes.OK


def cmd_upgrade(args: argparse.Namespace) -> int:
    result = admin.upgrade_ledger(args.ledger)
    _emit(args, result.to_json(), admin.render_upgrade(result))
    return exit_codes.OK


# --- the parser ---------------------------------------------------------------------------


def _options(*adders: Callable[[argparse.ArgumentParser], None]) -> _Parser:
    """A parent parser holding options that several verbs share (each defined once)."""
    parent = _Parser(add_help=False)
    for add in adders:
        add(parent)
    return parent


def _ledger(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ledger", metavar="LEDGER", help="path of the ledger file")


def _json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (stable keys, sorted)"
    )


def _incarnation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--incarnation",
        type=_positive,
        metavar="N",
        help="the daemon incarnation (default: the latest)",
    )


def _version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version",
        type=_non_negative,
        metavar="V",
        help="a version still held (default: the current one)",
    )


def _layers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers", type=_layers_spec, metavar="SPEC", help="only these layers, e.g. 0,3,5-7"
    )


def _ep_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ep-size",
        type=_positive,
        default=1,
        metavar="N",
        help="the engines' EP size: slots are grouped per EP rank (default: 1)",
    )


def _output(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help=what)


COMMANDS: dict[str, tuple[str, Handler]] = {
    "status": (
        "current version, digest, dirty mark, pending move, attached engines",
        cmd_status,
    ),
    "history": ("the events, filtered by incarnation, engine, layer, kind, time", cmd_history),
    "show": ("the map at a version, in sglang's format_expert_location_layout text", cmd_show),
    "diff": ("the slots that changed between two versions", cmd_diff),
    "export": ("write a map as a file that --init-expert-location accepts", cmd_export),
    "verify": ("integrity check, digests, version chain, events against rows", cmd_verify),
    "plot": ("draw the map (and with --moves the moves over time) as a PNG", cmd_plot),
    "prune": ("remove layout rows of old versions (keeps the current map and events)", cmd_prune),
    "upgrade": (
        "upgrade an older ledger's schema to this code's (refuses a newer one)",
        cmd_upgrade,
    ),
}

EPILOG = (
    "exit codes: 0 ok; 1 the command could not do what was asked; 2 bad arguments or no usable "
    "ledger file; 3 (status) dirty; 4 (status) move pending or refusals seen; 5 verify or "
    "export --check found an inconsistency; 130 interrupted"
)


def build_parser() -> argparse.ArgumentParser:
    common = _options(_ledger, _json)
    incarnation = _options(_incarnation)
    version = _options(_version)
    layers = _options(_layers)
    ep_size = _options(_ep_size)

    parser = _Parser(
        prog=PROG,
        description="Read, check and maintain an expert layout ledger of SGLang's weight cache "
        "daemon. Read commands open the ledger read-only and work while the daemon writes.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, *parents: _Parser) -> _Parser:
        summary, handler = COMMANDS[name]
        command = sub.add_parser(
            name,
            parents=[common, *parents],
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog=EPILOG,
        )
        command.set_defaults(handler=handler)
        return command

    add("status", incarnation)

    history = add("history", incarnation, layers)
    history.add_argument("--engine", metavar="ID", help="only events of this engine_id")
    history.add_argument(
        "--kind",
        action="append",
        choices=report.EVENT_KINDS,
        metavar="KIND",
        help=f"only events of this kind (repeatable): {', '.join(report.EVENT_KINDS)}",
    )
    history.add_argument("--since", type=_timestamp, metavar="TIME", help="events at or after")
    history.add_argument("--until", type=_timestamp, metavar="TIME", help="events before")
    history.add_argument("--last", type=_positive, metavar="N", help="only the last N events")

    add("show", incarnation, version, layers, ep_size)

    diff = add("diff", incarnation, layers)
    diff.add_argument("from_version", type=_non_negative, metavar="V1", help="the version before")
    diff.add_argument("to_version", type=_non_negative, metavar="V2", help="the version after")
    diff.add_argument("--slots", action="store_true", help="also list every changed slot")

    export = add("export", incarnation, version, ep_size)
    _output(export, "the JSON file to write (its name must end in .json)")
    export.add_argument(
        "--check",
        action="store_true",
        help="load the file through sglang's compute_initial_expert_location_metadata "
        "(imports sglang) and confirm its map equals the ledger's",
    )
    export.add_argument(
        "--model-path", metavar="DIR", help="the model directory (config.json) for --check"
    )

    add("verify")

    plot = add("plot", incarnation, version, ep_size)
    _output(plot, "the PNG file to write")
    plot.add_argument(
        "--moves", action="store_true", help="add the slots each commit moved, over time"
    )
    plot.add_argument(
        "--size",
        type=_pixels,
        default=(1200, 800),
        metavar="WxH",
        help="picture size in pixels (default: 1200x800)",
    )

    prune = add("prune", incarnation)
    prune.add_argument(
        "--keep",
        type=_positive,
        required=True,
        metavar="N",
        help="keep the rows of the last N versions of each incarnation",
    )

    add("upgrade")
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export" and args.check and not args.model_path:
        parser.error("export --check needs --model-path DIR (the model's config.json)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s")
    try:
        args = parse(argv)
    except UsageError as exc:
        sys.stderr.write(f"{exc}\n")
        return exit_codes.UNUSABLE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    handler: Handler = args.handler
    try:
        return handler(args)
    except UNUSABLE_ERRORS as exc:
        _error(args.command, str(exc))
        return exit_codes.UNUSABLE
    except LedgerError as exc:
        _error(args.command, str(exc))
        return exit_codes.FAILED
    except (SQLAlchemyError, json.JSONDecodeError) as exc:
        # Rows the reader cannot interpret (a missing version, a row that is not JSON): the
        # file is damaged; verify names what exactly.
        _error(
            args.command,
            f"the ledger {args.ledger} looks damaged ({type(exc).__name__}: {exc}); run "
            f"`{PROG} verify {args.ledger}`",
        )
        return exit_codes.UNUSABLE
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return exit_codes.INTERRUPTED
    except BrokenPipeError:
        # The reader of our stdout went away (| head): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return exit_codes.FAILED


if __name__ == "__main__":
    sys.exit(main())
