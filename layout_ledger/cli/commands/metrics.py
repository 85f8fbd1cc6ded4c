"""``layout-ledger metrics``: the ledgers' state as Prometheus series (docs/cli.md lists them).

Collecting reads each ledger read-only (``history.overview``), never blocking its daemon. Only
the rendering needs ``prometheus_client`` (the ``metrics`` extra), imported when asked for;
``write_textfile`` writes for node_exporter's textfile collector, ``serve_metrics`` serves
``/metrics``, re-reading the ledgers on every scrape.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_ledger.cli import exit_codes
from layout_ledger.cli.atomic_files import write_atomically
from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.cli.terminal import printable
from layout_ledger.core.errors import LedgerError, LedgerFileError
from layout_ledger.history.overview import (
    REFUSAL_KINDS,
    LedgerOverview,
    UnreadableLedger,
    read_overviews,
    require_one_readable,
)

logger = logging.getLogger(__name__)

PREFIX = "sglang_expert_layout"
LEDGER_LABELS = ("ledger", "host", "device_uuid", "gpu_id", "tp_rank")
EXTRA_HINT = "pip install 'sglang-expert-layout-ledger[metrics]'"
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def run(args: argparse.Namespace) -> int:
    labels = dict(args.label or ())
    check_constant_labels(labels)
    if args.serve is not None:
        return _serve_metrics(args, labels)
    collected = collect_metrics(args.paths, labels)
    require_one_readable(collected.ledgers)
    text = exposition(collected)
    if args.output is not None:
        write_textfile(Path(args.output), text)
    payload = {
        "output": args.output,
        "ledgers": len(collected.ledgers),
        "unreadable": [item.path for item in collected.unreadable],
        "samples": samples_json(collected),
    }
    if args.output is not None:
        lines = [f"wrote {args.output}: {len(collected.ledgers)} ledgers"]
    else:
        lines = text.decode().splitlines()
    emit(args, payload, lines)
    for item in collected.unreadable:
        print_error("metrics", f"cannot read ledger {item.path}: {item.problem}")
    return exit_codes.UNUSABLE if collected.unreadable else exit_codes.OK


def _serve_metrics(args: argparse.Namespace, labels: dict[str, str]) -> int:
    """Serve until SIGTERM or SIGINT, then stop cleanly (exit 0)."""
    host, port = args.serve
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server = serve_metrics(host, port, args.paths, labels)
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


def check_constant_labels(labels: Mapping[str, str]) -> None:
    """``--label`` names: Prometheus label names, none of the series' own."""
    for name in labels:
        if not _LABEL_NAME.match(name) or name.startswith("__"):
            raise LedgerError(f"--label {name!r} is not a Prometheus label name")
        if name in (*LEDGER_LABELS, "kind", "digest"):
            raise LedgerError(f"--label {name!r} is a label every series already has")


@dataclass(frozen=True)
class MetricsReport:
    """What one collection read: each ledger's overview (or why it could not), and when."""

    ledgers: tuple[LedgerOverview | UnreadableLedger, ...]
    labels: Mapping[str, str]
    collected_at: float  # UNIX seconds

    @property
    def unreadable(self) -> tuple[UnreadableLedger, ...]:
        return tuple(item for item in self.ledgers if isinstance(item, UnreadableLedger))


def collect_metrics(
    specs: Sequence[str | os.PathLike[str]],
    labels: Mapping[str, str] | None = None,
    now: Callable[[], float] | None = None,
) -> MetricsReport:
    """Read the ledgers the PATH ``specs`` name (a spec naming none is itself unreadable)."""
    read: list[LedgerOverview | UnreadableLedger] = []
    for spec in specs:
        try:
            paths = expand_ledger_paths([spec])
        except LedgerFileError as exc:
            read.append(UnreadableLedger(os.fspath(spec), str(exc)))
            continue
        read.extend(read_overviews(paths))
    clock = now or (lambda: datetime.datetime.now(datetime.timezone.utc).timestamp())
    return MetricsReport(tuple(read), dict(labels or {}), clock())


# --- the series -----------------------------------------------------------------------------


def _seconds(timestamp: str) -> float:
    return datetime.datetime.fromisoformat(timestamp).timestamp()


def _label_value(value: object) -> str:
    """A label value: empty when unknown; a ledger's control characters as visible escapes."""
    return "" if value is None else printable(str(value))


def _ledger_labels(item: LedgerOverview) -> list[str]:
    origin = item.incarnation.origin
    values = (item.path, origin.host, origin.device_uuid, origin.gpu_id, origin.tp_rank)
    return [_label_value(value) for value in values]


def _gauges(item: LedgerOverview, now: float) -> dict[str, float]:
    state, alive = item.state, item.liveness.alive
    pending = state.pending
    pending_for = 0.0
    if pending is not None and pending.since is not None:
        pending_for = max(0.0, now - _seconds(pending.since))
    return {
        "version": float(state.version),
        "dirty": float(state.dirty is not None),
        "move_pending": float(pending is not None),
        "move_pending_seconds": pending_for,
        "attached_engines": float(len(state.attached)),
        "daemon_up": math.nan if alive is None else float(alive),
        "last_commit_timestamp_seconds": _seconds(item.last_commit_at),
        "incarnation": float(item.incarnation.incarnation_id),
    }


# name -> help text, for the gauges above (name without the prefix).
_GAUGE_HELP = {
    "version": "The current expert layout version of the daemon's latest incarnation.",
    "dirty": "1 while the layout is unknown (an engine left mid-move): restart the daemon.",
    "move_pending": "1 while an engine's two-phase move is pending (begun, not committed).",
    "move_pending_seconds": "How long the pending move has been pending, 0 when none is.",
    "attached_engines": "Engines attached to the daemon (open attach connections).",
    "daemon_up": "1 while the daemon owning the ledger runs (its writer lock is held), 0 when "
    "it does not; NaN when this host cannot tell (another host, read-only media).",
    "last_commit_timestamp_seconds": "When the current version was recorded (UNIX seconds).",
    "incarnation": "The id of the daemon's latest incarnation (one per daemon start).",
}


def families(report: MetricsReport) -> list[Any]:
    """The report as ``prometheus_client`` metric families (needs the ``metrics`` extra)."""
    core = _prometheus_core()
    constant = list(report.labels)
    extra = [_label_value(value) for value in report.labels.values()]
    labels = [*LEDGER_LABELS, *constant]
    readable = [item for item in report.ledgers if isinstance(item, LedgerOverview)]
    found: list[Any] = []
    for name, help_text in _GAUGE_HELP.items():
        gauge = core.GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
        for item in readable:
            gauge.add_metric(_ledger_labels(item) + extra, _gauges(item, report.collected_at)[name])
        found.append(gauge)
    found.extend(_counters(core, readable, labels, extra))
    info = core.InfoMetricFamily(
        PREFIX, "The layout's digest and where the daemon runs, as labels.", labels=labels
    )
    for item in readable:
        info.add_metric(_ledger_labels(item) + extra, _info_labels(item))
    found.append(info)
    found.append(_readable(core, report, constant, extra))
    return found


def _counters(
    core: Any, readable: Sequence[LedgerOverview], labels: list[str], extra: list[str]
) -> Iterator[Any]:
    commits = core.CounterMetricFamily(
        f"{PREFIX}_commits",
        "Committed moves in the daemon's latest incarnation (reset when it restarts).",
        labels=labels,
    )
    refusals = core.CounterMetricFamily(
        f"{PREFIX}_refusals",
        "Requests the daemon refused in its latest incarnation, by event kind "
        "(<verb>_refused, begin_busy).",
        labels=[*labels, "kind"],
    )
    for item in readable:
        commits.add_metric(_ledger_labels(item) + extra, float(item.commits))
        for kind in REFUSAL_KINDS:
            refusals.add_metric(
                [*_ledger_labels(item), *extra, kind], float(item.refusals.get(kind, 0))
            )
    yield commits
    yield refusals


def _info_labels(item: LedgerOverview) -> dict[str, str]:
    origin = item.incarnation.origin
    values = {
        "digest": item.state.digest,
        "config_fingerprint": item.incarnation.config_fingerprint,
        "pp_rank": origin.pp_rank,
        "ep_rank": origin.ep_rank,
        "pid": origin.pid,
        "socket_path": origin.socket_path,
        "sglang_version": origin.sglang_version,
        "plugin_version": origin.plugin_version,
    }
    return {name: _label_value(value) for name, value in values.items()}


def _readable(core: Any, report: MetricsReport, constant: list[str], extra: list[str]) -> Any:
    gauge = core.GaugeMetricFamily(
        f"{PREFIX}_ledger_readable",
        "1 when the ledger was read at this collection, 0 when it could not be (the exporter "
        "logs why).",
        labels=["ledger", *constant],
    )
    for item in report.ledgers:
        gauge.add_metric([_label_value(item.path), *extra], float(isinstance(item, LedgerOverview)))
    return gauge


# --- rendering ------------------------------------------------------------------------------


def _prometheus_core() -> Any:
    try:
        import prometheus_client.metrics_core as core
    except ImportError as exc:
        raise LedgerError(
            f"layout-ledger metrics needs the prometheus_client library ({EXTRA_HINT})"
        ) from exc
    return core


class _Collector:
    """A ``prometheus_client`` collector whose every ``collect`` re-reads the ledgers."""

    def __init__(self, collect: Callable[[], MetricsReport]) -> None:
        self._collect = collect

    def collect(self) -> list[Any]:
        report = self._collect()
        for item in report.unreadable:
            logger.warning("cannot read ledger %s: %s", item.path, item.problem)
        return families(report)


def exposition(report: MetricsReport) -> bytes:
    """The Prometheus text exposition format of ``report`` (``prometheus_client``'s own)."""
    _prometheus_core()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: report))
    return bytes(generate_latest(registry))


def samples_json(report: MetricsReport) -> list[JsonObject]:
    """Every sample as ``{name, labels, value}`` (NaN as null), for ``--json``."""
    shown: list[JsonObject] = []
    for family in families(report):
        for sample in family.samples:
            value = None if math.isnan(sample.value) else sample.value
            shown.append({"name": sample.name, "labels": dict(sample.labels), "value": value})
    return shown


def write_textfile(output: Path, data: bytes) -> None:
    """``data`` into ``output`` atomically: a reader (node_exporter) sees the old file or the
    new one, never half of one; the temporary file's name does not end in ``.prom``."""
    write_atomically(output, data, temporary_suffix=".tmp")


@dataclass
class MetricsServer:
    """``prometheus_client``'s HTTP server for ``/metrics``, running on its own thread."""

    server: Any
    thread: Any

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def serve_metrics(
    host: str,
    port: int,
    specs: Sequence[str | os.PathLike[str]],
    labels: Mapping[str, str] | None = None,
) -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` (port 0: any free one), re-reading on each scrape."""
    _prometheus_core()
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: collect_metrics(specs, labels)))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise LedgerError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    return MetricsServer(server, thread)
