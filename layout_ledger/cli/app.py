"""``layout-ledger``: the operator's command line over an expert layout ledger.

Each verb is a thin wrapper: parse arguments, call one typed function of ``report``, ``verify``,
``plot``, ``admin``, ``fleet``, ``metrics`` or ``backup``, print its human lines or its
``--json`` object (sort_keys), return the exit code (``layout_ledger.cli.exit_codes``). Commands
that list rows (``history``, ``diff``) also print them as ``--nl`` or ``--csv``
(``layout_ledger.cli.row_formats``). A ``LedgerError`` becomes one line on stderr and a non-zero
exit, never a traceback; so does a bad argument.
Whatever a ledger holds reaches the terminal through ``terminal.printable``: every human line
and every error line is escaped here, in ``_emit`` and ``_error``. Read commands open the ledger
read-only and work while its daemon writes. No verb imports sglang or torch except
``export --check``, which loads ``layout_ledger.cli.sglang_export_check`` when asked to; only
``metrics`` imports ``prometheus_client`` (the ``metrics`` extra).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from sqlalchemy.exc import SQLAlchemyError

import layout_ledger
from layout_ledger.cli import admin, exit_codes, fleet, report
from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.layer_ranges import LayerRanges
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.cli.row_formats import write_rows
from layout_ledger.cli.terminal import PrintableFormatter, printable
from layout_ledger.core.errors import (
    LedgerError,
    LedgerFileError,
    LedgerInconsistent,
    LedgerStorageError,
    SchemaOutdated,
    SchemaTooNew,
)
from layout_ledger.core.layout import Map
from layout_ledger.history.overview import require_one_readable
from layout_ledger.history.reader import LedgerReader

PROG = "layout-ledger"
DISTRIBUTION = "sglang-expert-layout-ledger"

# Errors that mean "this file is no usable ledger (for this code)"; every other LedgerError
# means the command could not do what was asked.
UNUSABLE_ERRORS = (LedgerFileError, LedgerStorageError, SchemaOutdated, SchemaTooNew)

# SQLite integers are signed 64-bit: a larger number can name no version or incarnation.
_LARGEST = 2**63 - 1

Handler = Callable[[argparse.Namespace], int]
OptionAdder = Callable[[argparse.ArgumentParser], None]


def tool_version() -> str:
    """This tool's version: the installed distribution's, else the package's own."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return layout_ledger.__version__


class UsageError(Exception):
    """A bad command line; argparse's message, on one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and never exits by itself."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# --- argument types -----------------------------------------------------------------------


def _whole_number(value: str, lowest: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < lowest:
        raise argparse.ArgumentTypeError(f"expected a number >= {lowest}, got {number}")
    if number > _LARGEST:
        raise argparse.ArgumentTypeError(f"expected a number <= {_LARGEST}, got {number}")
    return number


def _non_negative(value: str) -> int:
    return _whole_number(value, 0)


def _positive(value: str) -> int:
    return _whole_number(value, 1)


def _layers_spec(value: str) -> LayerRanges:
    """``0,3,5-7``, kept as ranges: expanded only once the ledger's layer count is known."""
    try:
        return LayerRanges.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kinds(value: str) -> list[str]:
    """``commit,dirty``: event kinds, each one the ledger writes."""
    kinds = [part.strip() for part in value.split(",")]
    for kind in kinds:
        if kind not in report.EVENT_KINDS:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {kind!r} (choose from {', '.join(report.EVENT_KINDS)})"
            )
    return kinds


def _timestamp(value: str) -> str:
    """An ISO-8601 time (no zone = UTC) as the ledger writes times, so text order is time order.
    A trailing ``Z`` means UTC on every Python (``fromisoformat`` takes it only from 3.11)."""
    spelled = value.strip()
    if spelled[-1:] in ("Z", "z"):
        spelled = spelled[:-1] + "+00:00"
    try:
        moment = datetime.datetime.fromisoformat(spelled)
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


def _address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400``, ``:9400`` for every interface; port 0: any free one)."""
    host, colon, port = value.rpartition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT like 127.0.0.1:9400, got {value!r}")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {port!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "0.0.0.0", number


def _label(value: str) -> tuple[str, str]:
    name, equals, text = value.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE like engine=ds-v3, got {value!r}")
    return name, text


# --- output -------------------------------------------------------------------------------

Rows = tuple[Sequence[str], Sequence[JsonObject]]


def _emit(
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


def _error(command: str | None, message: str) -> None:
    """One line on stderr: whitespace (line breaks included) runs become one space, every
    other control character a visible escape."""
    prefix = PROG if command is None else f"{PROG} {command}"
    one_line = printable(" ".join(message.split()))
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
    wanted = report.HistoryRequest(
        incarnation_id=args.incarnation,
        engine=args.engine,
        layers=args.layers,
        kinds=tuple(dict.fromkeys(args.kind or ())),
        since=args.since,
        until=args.until,
        last=args.last,
    )
    with _reading(args) as ledger:
        collected = report.collect_history(ledger, wanted)
    rows = (report.EVENT_COLUMNS, report.history_rows(collected))
    _emit(args, collected.to_json(), report.render_history(collected), rows)
    return exit_codes.OK


def cmd_show(args: argparse.Namespace) -> int:
    with _reading(args) as ledger:
        collected = report.collect_show(
            ledger,
            incarnation_id=args.incarnation,
            version=args.version,
            layers=args.layers,
            ep_size=args.ep_size,
            fingerprints=args.fingerprints,
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
    lines = report.render_diff(collected, slots=args.slots)
    _emit(args, collected.to_json(), lines, (report.DIFF_COLUMNS, collected.slot_rows()))
    return exit_codes.OK


def cmd_export(args: argparse.Namespace) -> int:
    with _reading(args) as ledger:
        exported, the_map = report.read_export(
            ledger, args.output, incarnation_id=args.incarnation, version=args.version
        )
    if args.check:
        return _export_checked(args, exported, the_map)
    exported = report.write_export(exported, the_map)
    _emit(args, {**exported.to_json(), "check": None}, report.render_export(exported))
    return exit_codes.OK


def _export_checked(args: argparse.Namespace, exported: report.ExportReport, the_map: Map) -> int:
    """``export --check``: the file becomes the output only once sglang loaded it and found the
    ledger's map; on any failure nothing is written (an earlier file stays as it was)."""
    from layout_ledger.cli import sglang_export_check as sglang_check

    sglang_check.check_inputs(args.model_path, exported.geometry, args.ep_size)
    checks: list[sglang_check.ExportCheck] = []

    def accept(temporary: Path) -> bool:
        check = sglang_check.check_export(
            temporary,
            args.model_path,
            the_map,
            exported.geometry,
            ep_size=args.ep_size,
            shown_as=args.output,
        )
        checks.append(check)
        return check.equal

    exported = report.write_export(exported, the_map, accept)
    (check,) = checks
    lines = report.render_export(exported)
    lines.append(f"check with sglang: {'ok' if check.equal else 'FAILED'}: {check.detail}")
    _emit(args, {**exported.to_json(), "check": check.to_json()}, lines)
    if check.equal:
        return exit_codes.OK
    _error("export", f"check failed: {check.detail}")
    return exit_codes.INCONSISTENT


def cmd_verify(args: argparse.Namespace) -> int:
    from layout_ledger.cli.json_shape import json_object
    from layout_ledger.cli.report import render_verify
    from layout_ledger.history.checks import collect_verify

    with _reading(args) as ledger:
        collected = collect_verify(ledger)
    _emit(args, json_object(collected), render_verify(collected))
    if collected.ok:
        return exit_codes.OK
    _error("verify", f"inconsistent: {collected.first_inconsistency}")
    return exit_codes.INCONSISTENT


def cmd_plot(args: argparse.Namespace) -> int:
    from layout_ledger.cli import plot

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


def cmd_fleet(args: argparse.Namespace) -> int:
    paths = expand_ledger_paths(args.paths)
    if args.verify:
        verified = fleet.collect_fleet_verify(paths)
        _emit(args, verified.to_json(), fleet.render_fleet_verify(verified))
        return verified.exit_code
    collected = fleet.collect_fleet(paths)
    _emit(args, collected.to_json(), fleet.render_fleet(collected))
    for row in collected.ledgers:
        if row.problem is not None:
            _error("fleet", f"cannot read ledger {row.path}: {row.problem}")
    return collected.exit_code


def cmd_metrics(args: argparse.Namespace) -> int:
    from layout_ledger.cli import metrics

    labels = dict(args.label or ())
    metrics.check_constant_labels(labels)
    if args.serve is not None:
        return _serve_metrics(args, labels)
    collected = metrics.collect_metrics(args.paths, labels)
    require_one_readable(collected.ledgers)
    text = metrics.exposition(collected)
    if args.output is not None:
        metrics.write_textfile(Path(args.output), text)
    payload = {
        "output": args.output,
        "ledgers": len(collected.ledgers),
        "unreadable": [item.path for item in collected.unreadable],
        "samples": metrics.samples_json(collected),
    }
    if args.output is not None:
        lines = [f"wrote {args.output}: {len(collected.ledgers)} ledgers"]
    else:
        lines = text.decode().splitlines()
    _emit(args, payload, lines)
    for item in collected.unreadable:
        _error("metrics", f"cannot read ledger {item.path}: {item.problem}")
    return exit_codes.UNUSABLE if collected.unreadable else exit_codes.OK


def _serve_metrics(args: argparse.Namespace, labels: dict[str, str]) -> int:
    """Serve until SIGTERM or SIGINT, then stop cleanly (exit 0)."""
    from layout_ledger.cli import metrics

    host, port = args.serve
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server = metrics.serve_metrics(host, port, args.paths, labels)
        try:
            sys.stdout.write(
                f"serving {server.url}: {len(args.paths)} ledger path(s), re-read read-only "
                f"on every scrape; SIGTERM or Ctrl-C stops\n"
            )
            sys.stdout.flush()
            stop.wait()
        finally:
            server.close()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return exit_codes.OK


def cmd_backup(args: argparse.Namespace) -> int:
    from layout_ledger.cli import backup

    result = backup.backup_ledger(args.ledger, args.destination)
    _emit(args, result.to_json(), backup.render_backup(result))
    return exit_codes.OK


# --- options several verbs share (each defined once) ----------------------------------------


def _ledger(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ledger", metavar="LEDGER", help="path of the ledger file")


def _paths(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a ledger file, a directory (its ledgers), or the daemons' ledger template with "
        "{device_uuid} (the ledgers it matches)",
    )


def _add_json(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (stable keys, sorted)"
    )


def _json(parser: argparse.ArgumentParser) -> None:
    _add_json(parser)


def _json_or_rows(parser: argparse.ArgumentParser) -> None:
    """The output forms of a command that lists rows: one of --json, --nl, --csv."""
    forms = parser.add_mutually_exclusive_group()
    _add_json(forms)
    forms.add_argument(
        "--nl",
        dest="rows",
        action="store_const",
        const="nl",
        help="print one JSON object per row, one per line (newline-delimited JSON)",
    )
    forms.add_argument(
        "--csv",
        dest="rows",
        action="store_const",
        const="csv",
        help="print CSV: a header line, then one line per row",
    )


def _incarnation_latest(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--incarnation",
        type=_positive,
        metavar="N",
        help="the daemon incarnation (default: the latest)",
    )


def _incarnation_all(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--incarnation",
        type=_positive,
        metavar="N",
        help="only this daemon incarnation (default: all incarnations)",
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
        help="the engines' EP size: slots are grouped per EP rank; it must divide the physical "
        "slots per layer (default: 1)",
    )


SHARED_OPTIONS: dict[str, OptionAdder] = {
    "ledger": _ledger,
    "paths": _paths,
    "json": _json,
    "rows": _json_or_rows,
    "incarnation": _incarnation_latest,
    "incarnations": _incarnation_all,
    "version": _version,
    "layers": _layers,
    "ep_size": _ep_size,
}


def _output(parser: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    parser.add_argument("-o", "--output", required=required, metavar="FILE", help=what)


# --- each verb's own options ----------------------------------------------------------------


def _history_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        metavar="ID",
        help="only events of this engine_id, or of the one engine_id it begins",
    )
    parser.add_argument(
        "--kind",
        action="extend",
        type=_kinds,
        metavar="KIND[,KIND...]",
        help=f"only events of these kinds (repeatable): {', '.join(report.EVENT_KINDS)}",
    )
    parser.add_argument("--since", type=_timestamp, metavar="TIME", help="events at or after")
    parser.add_argument("--until", type=_timestamp, metavar="TIME", help="events before")
    parser.add_argument("--last", type=_positive, metavar="N", help="only the last N events")


def _show_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fingerprints",
        action="store_true",
        help="also show the fingerprint the daemon recorded for each of its slots at that "
        "version (which expert's bytes the slot held)",
    )


def _diff_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("from_version", type=_non_negative, metavar="V1", help="the version before")
    parser.add_argument("to_version", type=_non_negative, metavar="V2", help="the version after")
    parser.add_argument("--slots", action="store_true", help="also list every changed slot")


def _export_options(parser: argparse.ArgumentParser) -> None:
    _output(parser, "the JSON file to write (its name must end in .json)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="load the file through sglang's compute_initial_expert_location_metadata "
        "(imports sglang) and confirm its map equals the ledger's; nothing is written unless "
        "it does",
    )
    parser.add_argument(
        "--model-path", metavar="DIR", help="the model directory (config.json) for --check"
    )


def _plot_options(parser: argparse.ArgumentParser) -> None:
    _output(parser, "the picture to write: FILE.png, FILE.svg or FILE.pdf")
    parser.add_argument(
        "--moves", action="store_true", help="add the slots each commit moved, over time"
    )
    parser.add_argument(
        "--size",
        type=_pixels,
        default=(1200, 800),
        metavar="WxH",
        help="picture size in pixels (default: 1200x800)",
    )


def _prune_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep",
        type=_positive,
        required=True,
        metavar="N",
        help="keep the rows of the last N versions of each incarnation",
    )


def _fleet_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verify",
        action="store_true",
        help="run verify on every ledger instead, one line each",
    )


def _metrics_options(parser: argparse.ArgumentParser) -> None:
    _output(
        parser,
        "write the text exposition format to FILE atomically (node_exporter's textfile "
        "collector reads FILE.prom); default: print it",
        required=False,
    )
    parser.add_argument(
        "--serve",
        type=_address,
        metavar="HOST:PORT",
        help="serve /metrics over HTTP instead, re-reading the ledgers on every scrape",
    )
    parser.add_argument(
        "--label",
        action="append",
        type=_label,
        metavar="KEY=VALUE",
        help="a label added to every series (repeatable), e.g. engine=ds-v3 to tell engines "
        "apart in alerts",
    )


def _backup_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "destination",
        metavar="DEST",
        help="the copy to write (a new file), or a directory to write it into",
    )


# --- the parser ---------------------------------------------------------------------------

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
    "plot": (
        "draw the map (and with --moves the moves over time) as a PNG, SVG or PDF",
        cmd_plot,
    ),
    "prune": ("remove layout rows of old versions (keeps the current map and events)", cmd_prune),
    "upgrade": (
        "upgrade an older ledger's schema to this code's (refuses a newer one)",
        cmd_upgrade,
    ),
    "fleet": (
        "every ledger of an engine at once, and the verdict the engine's startup would reach",
        cmd_fleet,
    ),
    "metrics": (
        "the ledgers' state as Prometheus series (text file, stdout, or an HTTP exporter)",
        cmd_metrics,
    ),
    "backup": (
        "a consistent single-file copy of a ledger with SQLite's backup API, also while its "
        "daemon writes",
        cmd_backup,
    ),
}

# Each verb: the shared options it takes (in this order), then its own.
VERB_OPTIONS: dict[str, tuple[tuple[str, ...], OptionAdder | None]] = {
    "status": (("ledger", "json", "incarnation"), None),
    "history": (("ledger", "rows", "incarnations", "layers"), _history_options),
    "show": (("ledger", "json", "incarnation", "version", "layers", "ep_size"), _show_options),
    "diff": (("ledger", "rows", "incarnation", "layers"), _diff_options),
    "export": (("ledger", "json", "incarnation", "version", "ep_size"), _export_options),
    "verify": (("ledger", "json"), None),
    "plot": (("ledger", "json", "incarnation", "version", "ep_size"), _plot_options),
    "prune": (("ledger", "json", "incarnations"), _prune_options),
    "upgrade": (("ledger", "json"), None),
    "fleet": (("paths", "json"), _fleet_options),
    "metrics": (("paths", "json"), _metrics_options),
    "backup": (("ledger", "json"), _backup_options),
}

EPILOG = (
    "exit codes: 0 ok; 1 the command could not do what was asked; 2 bad arguments or no usable "
    "ledger file; 3 (status, fleet) dirty; 4 (status) move pending or refusals seen, (fleet) a "
    "move pending; 5 verify or export --check found an inconsistency, prune refused a ledger "
    "that fails verify, or (fleet) the ledgers disagree; 130 interrupted"
)


def _shared_parents() -> dict[str, _Parser]:
    """One parent parser per shared option, so each is defined once for every verb."""
    parents = {}
    for name, add in SHARED_OPTIONS.items():
        parent = _Parser(add_help=False)
        add(parent)
        parents[name] = parent
    return parents


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Read, check and maintain an expert layout ledger of SGLang's weight cache "
        "daemon. Read commands open the ledger read-only and work while the daemon writes.",
        epilog=EPILOG,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {tool_version()}",
        help="print this tool's version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = _shared_parents()
    for name, (summary, handler) in COMMANDS.items():
        shared, own = VERB_OPTIONS[name]
        command = sub.add_parser(
            name,
            parents=[parents[option] for option in shared],
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog=EPILOG,
        )
        if own is not None:
            own(command)
        command.set_defaults(handler=handler)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export" and args.check and not args.model_path:
        parser.error("export --check needs --model-path DIR (the model's config.json)")
    if args.command == "metrics" and args.serve is not None and (args.output or args.json):
        parser.error("metrics --serve prints no -o file and no --json")
    return args


def _configure_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    _configure_logging()
    try:
        args = parse(argv)
    except UsageError as exc:
        sys.stderr.write(f"{printable(str(exc))}\n")
        return exit_codes.UNUSABLE
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0)
    handler: Handler = args.handler
    try:
        return handler(args)
    except UNUSABLE_ERRORS as exc:
        _error(args.command, str(exc))
        return exit_codes.UNUSABLE
    except LedgerInconsistent as exc:
        _error(args.command, str(exc))
        return exit_codes.INCONSISTENT
    except LedgerError as exc:
        _error(args.command, str(exc))
        return exit_codes.FAILED
    except (SQLAlchemyError, json.JSONDecodeError) as exc:
        # Rows the reader cannot interpret (a missing version, a row that is not JSON): the
        # file is damaged; verify names what exactly.
        where = getattr(args, "ledger", None) or " ".join(getattr(args, "paths", ()))
        _error(
            args.command,
            f"the ledger {where} looks damaged ({type(exc).__name__}: {exc}); run "
            f"`{PROG} verify {where}`",
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
