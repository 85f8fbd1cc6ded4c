"""Argument parsing for ``layout-ledger``: the verbs, their options, the argument types.

Cheap on purpose: ``--version`` and ``--help`` end here, so this module imports only argparse
and the event kinds (``history --kind``); no verb module, no SQLAlchemy. Options several verbs
take are defined once (``SHARED_OPTIONS``) and shared as parent parsers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import layout_ledger
from layout_ledger.core.events import ALL_KINDS

if TYPE_CHECKING:
    from layout_ledger.cli.layer_ranges import LayerRanges

PROG = "layout-ledger"

# SQLite integers are signed 64-bit: a larger number can name no version or incarnation.
_LARGEST = 2**63 - 1

OptionAdder = Callable[[argparse.ArgumentParser], None]


def tool_version() -> str:
    """This tool's version: the package's own, which tests/test_cli_arguments.py keeps equal to
    the installed distribution's (importlib.metadata alone costs a ``--version`` 25 ms)."""
    return layout_ledger.__version__


class UsageError(Exception):
    """A bad command line; argparse's message, on one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and never exits by itself."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


class _VersionAction(argparse._VersionAction):
    """``--version``: the version is looked up only when asked for."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        self.version = f"{PROG} {tool_version()}"
        super().__call__(parser, namespace, values, option_string)


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
    from layout_ledger.cli.layer_ranges import LayerRanges

    try:
        return LayerRanges.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kinds(value: str) -> list[str]:
    """``commit,dirty``: event kinds, each one the ledger writes."""
    kinds = [part.strip() for part in value.split(",")]
    for kind in kinds:
        if kind not in ALL_KINDS:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {kind!r} (choose from {', '.join(ALL_KINDS)})"
            )
    return kinds


def _timestamp(value: str) -> str:
    """An ISO-8601 time (no zone = UTC) or a relative one (``1h``, ``30min``, ``2d``,
    ``"1 hour ago"``: back from now), as the ledger writes times, so text order is time order."""
    from layout_ledger.cli.time_text import EXAMPLE, parse_time

    try:
        return parse_time(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a time like {EXAMPLE}, got {value!r}") from None


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
    """``HOST:PORT`` (``[::1]:9400``; ``:9400`` for the loopback only, ``0.0.0.0:9400`` for every
    IPv4 interface; port 0: any free one)."""
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
    return host or "127.0.0.1", number


def _label(value: str) -> tuple[str, str]:
    from layout_ledger.cli.metric_labels import label_name_problem

    name, equals, text = value.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE like engine=ds-v3, got {value!r}")
    problem = label_name_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return name, text


# --- options several verbs share (each defined once) ----------------------------------------


# What no PATH means, for every command that takes ledgers (cli.default_ledgers).
NO_PATH = (
    "none: the daemons' ledgers on this host ($SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE, else "
    "/var/lib/sglang/expert_layouts/ as root, $XDG_STATE_HOME/sglang/expert_layouts/ for "
    "another user)"
)
_MANY = (
    "a ledger file, a directory (its ledgers), or the daemons' ledger template with "
    "{device_uuid} (the ledgers it matches)"
)


def _ledger(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "ledger",
        nargs="?",
        metavar="LEDGER",
        help=f"path of the ledger file ({NO_PATH}, which must be one)",
    )


def _ledgers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "ledger",
        nargs="*",
        metavar="LEDGER",
        help=f"{_MANY}; many ledgers: one report each ({NO_PATH})",
    )


def _timeline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "ledger",
        nargs="*",
        metavar="LEDGER",
        help=f"{_MANY}; many ledgers: one timeline, each line naming its rank ({NO_PATH})",
    )


def _paths(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="PATH", help=f"{_MANY} ({NO_PATH})")


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
    "ledgers": _ledgers,
    "timeline": _timeline,
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
        help=f"only events of these kinds (repeatable): {', '.join(ALL_KINDS)}",
    )
    parser.add_argument(
        "--since",
        type=_timestamp,
        metavar="TIME",
        help="events at or after TIME, in UTC: ISO-8601 (no zone means UTC), HH:MM (today), "
        "today, yesterday, @UNIXTIME, or a span back from now: 1h, 30min, 2d, '1 hour ago'",
    )
    parser.add_argument(
        "--until", type=_timestamp, metavar="TIME", help="events before TIME (as --since)"
    )
    parser.add_argument("--last", type=_positive, metavar="N", help="only the last N events")
    parser.add_argument(
        "--after-event",
        type=_non_negative,
        metavar="N",
        help="only events whose event_id is above N: a poller passes the last event_id it "
        "printed (--nl/--csv column event_id, --json cursor) and never sees an event twice",
    )
    parser.add_argument("-r", "--reverse", action="store_true", help="newest event first")
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="after the matching events (the last 10 unless --last, --since or --after-event "
        "says otherwise), print each new one as the daemon commits it, until interrupted "
        "(Ctrl-C: exit 0); text, --nl or --csv; --json: one JSON object a line, as --nl "
        "(journalctl -f -o json's form)",
    )


def _show_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fingerprints",
        action="store_true",
        help="also show the fingerprint the daemon recorded for each of its slots at that "
        "version (which expert's bytes the slot held)",
    )


def _diff_options(parser: argparse.ArgumentParser) -> None:
    # [LEDGER] V1 V2 as one list, sorted out by _diff_operands: argparse cannot match an
    # optional positional before two required ones once options come between them.
    parser.add_argument(
        "operands",
        nargs="*",
        metavar="[LEDGER] V1 V2",
        help=f"the ledger file ({NO_PATH}, which must be one), the version before and the "
        "version after",
    )
    parser.add_argument("--slots", action="store_true", help="also list every changed slot")


def _diff_operands(
    verb: argparse.ArgumentParser, args: argparse.Namespace, more: list[str]
) -> None:
    """``diff``'s ``[LEDGER] V1 V2`` (with the words argparse left over after its options)."""
    words = [*args.operands, *more]
    if len(words) == 2 and not words[0].isdigit():
        verb.error("the following arguments are required: V2")
    if len(words) not in (2, 3):
        verb.error("expected [LEDGER] V1 V2: a ledger (or none), the version before and after")
    versions = []
    for name, word in zip(("V1", "V2"), words[-2:], strict=True):
        try:
            versions.append(_non_negative(word))
        except argparse.ArgumentTypeError as exc:
            verb.error(f"argument {name}: {exc}")
    args.ledger = words[0] if len(words) == 3 else None
    args.from_version, args.to_version = versions
    del args.operands


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
    parser.add_argument(
        "--force",
        action="store_true",
        help="export even a dirty ledger's or a pending move's layout (no engine should start "
        "from it), and replace FILE when it exists",
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
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="only say what would be removed (reads only: also while a daemon runs)",
    )
    parser.add_argument(
        "--no-vacuum",
        action="store_true",
        help="do not VACUUM after removing rows (the file then keeps its size; SQLite reuses "
        "the freed pages)",
    )


def _fleet_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verify",
        action="store_true",
        help="run verify on every ledger instead, one line each",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("wide",),
        help="wide: add the attached engines, pending-since, last-commit and cordon columns",
    )
    parser.add_argument("--wide", action="store_true", help="the same as -o wide")
    parser.add_argument(
        "--ready-to-stop",
        metavar="ENGINE",
        help="instead: is engine ENGINE (an engine id, or a unique prefix of one) ready to stop, "
        "on every rank attached, cordoned, with no move pending? exit 0, else why",
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
        help="serve /metrics over HTTP instead, reading what changed in the ledgers on every "
        "scrape; :PORT binds the loopback only (127.0.0.1): a Prometheus on another host needs "
        "this host's address or 0.0.0.0:PORT (every interface), and a firewall that lets only "
        "it in (the exporter has no authentication)",
    )
    parser.add_argument(
        "--label",
        action="append",
        type=_label,
        metavar="KEY=VALUE",
        help="a label added to every series (repeatable), e.g. engine=ds-v3 to tell engines "
        "apart in alerts",
    )


def _cordon_targets(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="SOCKET|PATH",
        help="a daemon's control socket, or a ledger file, a directory of ledgers or the daemons' "
        f"ledger template with {{device_uuid}} (the sockets their daemons recorded) ({NO_PATH})",
    )


def _cordon_options(parser: argparse.ArgumentParser) -> None:
    _cordon_targets(parser)
    parser.add_argument(
        "--reason",
        metavar="TEXT",
        help="why, recorded with the cordon (your user and host are added) and shown in every "
        "busy begin's reason",
    )


def _retire_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reason",
        metavar="TEXT",
        help="why (recorded in the retirement note with your user and host)",
    )


def _backup_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "destination",
        metavar="DEST",
        help="the copy to write (a new file), or a directory to write it into",
    )


# --- the parser ---------------------------------------------------------------------------

# Each verb and its one-line summary (its help, and its description); app.py runs
# layout_ledger.cli.commands.<verb>.
COMMANDS: dict[str, str] = {
    "status": "current version, digest, dirty mark, pending move, attached engines",
    "history": "the events, filtered by incarnation, engine, layer, kind, time",
    "show": "the map at a version, in sglang's format_expert_location_layout text",
    "diff": "the slots that changed between two versions",
    "export": "write a map as a file that --init-expert-location accepts",
    "verify": "integrity check, digests, version chain, events against rows",
    "plot": "draw the map (and with --moves the moves over time) as a PNG, SVG or PDF",
    "prune": "remove layout rows of old versions (keeps the current map and events)",
    "upgrade": "upgrade an older ledger's schema to this code's (refuses a newer one)",
    "fleet": "every ledger of an engine at once, and the verdict the engine's startup would reach",
    "metrics": "the ledgers' state as Prometheus series (text file, stdout, or an HTTP exporter)",
    "backup": "a consistent single-file copy of a ledger with SQLite's backup API, also while its "
    "daemon writes",
    "cordon": "ask daemons to answer every begin busy (no move begins) until uncordon; a daemon "
    "restart clears it",
    "uncordon": "lift a cordon: engines may begin moves again",
    "heal": "ask dirty daemons to reload their dirty layers from their checkpoint and be clean "
    "again at the same version",
    "retire": "stop counting a ledger whose GPU is gone for good (fleet, metrics, alerts); "
    "recorded beside it, undone by unretire",
    "unretire": "count a retired ledger again",
}

# Each verb: the shared options it takes (in this order), then its own.
VERB_OPTIONS: dict[str, tuple[tuple[str, ...], OptionAdder | None]] = {
    "status": (("ledgers", "json", "incarnation"), None),
    "history": (("timeline", "rows", "incarnations", "layers"), _history_options),
    "show": (("ledger", "json", "incarnation", "version", "layers", "ep_size"), _show_options),
    "diff": (("rows", "incarnation", "layers"), _diff_options),
    "export": (("ledger", "json", "incarnation", "version", "ep_size"), _export_options),
    "verify": (("ledger", "json"), None),
    "plot": (("ledger", "json", "incarnation", "version", "ep_size"), _plot_options),
    "prune": (("ledger", "json", "incarnations"), _prune_options),
    "upgrade": (("ledger", "json"), None),
    "fleet": (("paths", "json"), _fleet_options),
    "metrics": (("paths", "json"), _metrics_options),
    "backup": (("ledgers", "json"), _backup_options),
    "cordon": (("json",), _cordon_options),
    "uncordon": (("json",), _cordon_targets),
    "heal": (("json",), _cordon_targets),
    "retire": (("paths", "json"), _retire_options),
    "unretire": (("paths", "json"), None),
}

# Each verb's --help ends with examples (the README's command table shows the first) and the
# exit codes it can give; docs/cli.md repeats the codes under each command ("Exit codes:" line,
# tests/test_cli_docs.py keeps the three in step).
_BAD = "bad arguments, or no usable ledger file"
VERB_EXAMPLES: dict[str, tuple[str, ...]] = {
    "status": (
        "layout-ledger status",
        "layout-ledger status LEDGER --json",
        "layout-ledger status '/var/lib/sglang/expert_layouts/expert_layout_{device_uuid}.sqlite'",
    ),
    "history": (
        "layout-ledger history --kind dirty --since today",
        "layout-ledger history LEDGER --layers 17 --kind commit,dirty",
        "layout-ledger history LEDGER --since '1 hour ago' --follow",
        "layout-ledger history LEDGER --after-event 4182 --nl",
    ),
    "show": ("layout-ledger show LEDGER --version 12 --ep-size 2",),
    "diff": ("layout-ledger diff LEDGER 3 12", "layout-ledger diff LEDGER 3 12 --slots --csv"),
    "export": (
        "layout-ledger export LEDGER -o layout.json",
        "layout-ledger export LEDGER -o layout.json --check --model-path /models/DeepSeek-V3",
    ),
    "verify": ("layout-ledger verify LEDGER",),
    "plot": (
        "layout-ledger plot LEDGER -o layout.svg --ep-size 2",
        "layout-ledger plot LEDGER -o moves.png --moves",
    ),
    "prune": (
        "layout-ledger prune LEDGER --keep 100",
        "layout-ledger prune LEDGER --keep 100 --dry-run",
    ),
    "upgrade": ("layout-ledger upgrade LEDGER",),
    "fleet": (
        "layout-ledger fleet",
        "layout-ledger fleet --wide",
        "layout-ledger fleet '/var/lib/sglang/expert_layouts/expert_layout_{device_uuid}.sqlite'",
        "layout-ledger fleet --ready-to-stop engine-a && stop-the-engine",
    ),
    "metrics": (
        "layout-ledger metrics -o /var/lib/node_exporter/textfile/expert_layout.prom",
        "layout-ledger metrics --serve :9400 --label engine=ds-v3",
    ),
    "backup": ("layout-ledger backup /backups/today/", "layout-ledger backup LEDGER /backups/"),
    "cordon": ('layout-ledger cordon --reason "engine upgrade"',),
    "uncordon": ("layout-ledger uncordon",),
    "heal": ("layout-ledger heal", "layout-ledger heal /tmp/sglang_weight_cache_GPU-0000.sock"),
    "retire": ('layout-ledger retire LEDGER --reason "GPU 3 replaced"',),
    "unretire": ("layout-ledger unretire LEDGER",),
}
VERB_EXIT_CODES: dict[str, tuple[tuple[int, str], ...]] = {
    "status": (
        (0, "clean (or retired)"),
        (2, _BAD),
        (3, "dirty"),
        (4, "a move pending, or a refusal in the last 10 minutes"),
        (6, "the daemon of the latest incarnation does not run"),
    ),
    "history": (
        (0, "ok, also when nothing matches, and --follow ended by Ctrl-C"),
        (1, "a layer beyond the ledger's maps, or an ambiguous --engine prefix"),
        (2, _BAD),
    ),
    "show": (
        (0, "ok"),
        (1, "a version not held, a layer out of range, a bad --ep-size"),
        (2, _BAD),
    ),
    "diff": ((0, "ok"), (1, "a version not held"), (2, _BAD)),
    "export": (
        (0, "written"),
        (
            1,
            "a version not held, a bad --ep-size, FILE exists (without --force) or cannot be "
            "written",
        ),
        (2, _BAD),
        (3, "refused: the incarnation is dirty (without --force)"),
        (4, "refused: a move is pending (without --force)"),
        (5, "--check: sglang's map differs from the ledger's (nothing written)"),
    ),
    "verify": ((0, "no inconsistency"), (2, _BAD), (5, "an inconsistency (the first is named)")),
    "plot": ((0, "written"), (1, "a bad suffix or --ep-size, matplotlib missing"), (2, _BAD)),
    "prune": (
        (0, "pruned (or --dry-run)"),
        (1, "refused: a move pending, or a daemon owns the file"),
        (2, _BAD),
        (5, "refused: the ledger fails verify (nothing removed)"),
    ),
    "upgrade": ((0, "upgraded, or already current"), (1, "a daemon owns the file"), (2, _BAD)),
    "fleet": (
        (0, "an engine would start (adopt V or keep the initial layout); --ready-to-stop: ready"),
        (2, _BAD),
        (3, "a running daemon is dirty"),
        (4, "a move is pending"),
        (5, "the ledgers disagree; --verify: a ledger fails verify"),
        (6, "no daemon of the ledgers runs (--ready-to-stop: one does not)"),
        (7, "--ready-to-stop: not ready (a rank not cordoned, or the engine not attached)"),
    ),
    "metrics": (
        (0, "written or served"),
        (1, "prometheus_client missing, or --serve cannot listen"),
        (2, "bad arguments, or a ledger cannot be read (the others are still written)"),
    ),
    "backup": ((0, "copied"), (1, "DEST exists or cannot be written"), (2, _BAD)),
    "cordon": (
        (0, "every daemon cordoned"),
        (1, "a daemon refused or could not be read"),
        (2, _BAD),
        (6, "a daemon does not run"),
    ),
    "uncordon": (
        (0, "every cordon lifted"),
        (1, "a daemon refused or could not be read"),
        (2, _BAD),
        (6, "a daemon does not run"),
    ),
    "heal": (
        (0, "every daemon healed"),
        (1, "a daemon refused (not dirty, heal unavailable, the heal failed) or could not be read"),
        (2, _BAD),
        (6, "a daemon does not run"),
    ),
    "retire": ((0, "retired (or already)"), (1, "a ledger's daemon may run"), (2, _BAD)),
    "unretire": ((0, "counted again (or already)"), (2, _BAD)),
}
# Every command: Ctrl-C.
_INTERRUPTED = (130, "interrupted (Ctrl-C)")


def verb_exit_codes(verb: str) -> tuple[tuple[int, str], ...]:
    """The exit codes ``verb`` can give, in order, Ctrl-C's last (``history --follow`` and
    ``metrics --serve`` end with 0 on Ctrl-C: it is how they stop)."""
    return (*VERB_EXIT_CODES[verb], _INTERRUPTED)


def exit_codes_line(verb: str) -> str:
    """The exit codes of ``verb`` on one line, as docs/cli.md gives them."""
    return "; ".join(f"{code} {meaning}" for code, meaning in verb_exit_codes(verb))


def verb_epilog(verb: str) -> str:
    examples = "\n".join(f"  {example}" for example in VERB_EXAMPLES[verb])
    codes = "\n".join(f"  {code:<3} {meaning}" for code, meaning in verb_exit_codes(verb))
    return f"examples:\n{examples}\n\nexit codes:\n{codes}"


EPILOG = (
    "exit codes: 0 ok; 1 the command could not do what was asked; 2 bad arguments or no usable "
    "ledger file; 3 (status, fleet) dirty, (export) refused: dirty; 4 (status) move pending or "
    "recent refusals, (fleet) a move pending, (export) refused: a move pending; 5 verify or "
    "export --check found an inconsistency, prune refused a ledger that fails verify, or "
    "(fleet) the ledgers disagree; 6 (status, fleet, cordon, heal) the daemon "
    "does not run; 7 (fleet --ready-to-stop) not ready; 130 interrupted"
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
        "--version", action=_VersionAction, help="print this tool's version and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = _shared_parents()
    for name, summary in COMMANDS.items():
        shared, own = VERB_OPTIONS[name]
        command = sub.add_parser(
            name,
            parents=[parents[option] for option in shared],
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog=verb_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if own is not None:
            own(command)
    return parser


def _verb_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The verb's own parser (its errors name ``layout-ledger VERB``), else the tool's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            verb: argparse.ArgumentParser = action.choices[command]
            return verb
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    verb = _verb_parser(parser, getattr(args, "command", None))
    if args.command == "diff":
        words = [extra for extra in extras if not extra.startswith("-")]
        extras = [extra for extra in extras if extra.startswith("-")]
        _diff_operands(verb, args, words)
    if extras:
        verb.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "export" and args.check and not args.model_path:
        verb.error("export --check needs --model-path DIR (the model's config.json)")
    if args.command == "metrics" and args.serve is not None and (args.output or args.json):
        verb.error("metrics --serve prints no -o file and no --json")
    if args.command == "metrics" and args.label:
        names = [name for name, _ in args.label]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            verb.error(f"argument --label: {twice[0]!r} given twice; give each label once")
    if args.command == "history" and args.follow:
        for given, name in (
            (args.reverse, "--reverse"),
            (args.until, "--until"),
        ):
            if given:
                verb.error(f"--follow prints events as they come: it takes no {name}")
    if args.command == "fleet":
        args.wide = args.wide or args.output == "wide"
        if args.verify and args.ready_to_stop is not None:
            verb.error("fleet takes one of --verify and --ready-to-stop")
    return args
