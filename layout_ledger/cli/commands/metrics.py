"""``layout-ledger metrics``: the ledgers' state as Prometheus series (docs/cli.md lists them).

Collecting reads each ledger read-only (``history.overview``), never blocking its daemon; the
exporter (``--serve``) keeps each ledger's replay between scrapes (``OverviewCache``), so a
scrape costs the events appended since the last one, not the history. Only the rendering needs
``prometheus_client`` (the ``metrics`` extra), imported when asked for; ``write_textfile``
writes for node_exporter's textfile collector, ``serve_metrics`` serves ``/metrics`` through a
bounded server (``cli.metrics_server``). Labels stay bounded: one series per ledger (and per
refusal kind or begin cause), no value that changes with each commit or restart (the digest is
a value, ``digest_prefix``; the pid is not exported).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layout_ledger.cli import exit_codes
from layout_ledger.cli.atomic_files import write_atomically
from layout_ledger.cli.json_shape import JsonObject
from layout_ledger.cli.metric_labels import LEDGER_LABELS, PREFIX, label_name_problem
from layout_ledger.cli.metrics_server import MetricsHTTPServer, SharedCollection
from layout_ledger.cli.output import emit, print_error, print_warning
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.cli.terminal import printable
from layout_ledger.core import events as ev
from layout_ledger.core.errors import LedgerError, LedgerFileError
from layout_ledger.core.rules import lease_holders
from layout_ledger.core.state import ROLE_ACTIVE, ROLE_STANDBY
from layout_ledger.history.overview import (
    BEGIN_CAUSE_NAMES,
    BUSY_BEGIN_CAUSES,
    REFUSAL_KINDS,
    LedgerOverview,
    OverviewCache,
    UnreadableLedger,
    read_overviews,
    require_one_readable,
)

logger = logging.getLogger(__name__)

# The [metrics] extra's one package, installed into the environment that runs layout-ledger.
EXTRA_HINT = "python -m pip install prometheus-client: the [metrics] extra"
# node_exporter's textfile collector reads only the files of its directory named *.prom.
TEXTFILE_SUFFIX = ".prom"


def run(args: argparse.Namespace) -> int:
    labels = dict(args.label or ())
    check_constant_labels(labels)
    if args.serve is not None:
        return _serve_metrics(args, labels)
    collected = collect_metrics(args.paths, labels)
    require_one_readable(collected.ledgers)
    text = exposition(collected)
    if args.output is not None:
        if not args.output.endswith(TEXTFILE_SUFFIX):
            print_warning(
                "metrics",
                f"{args.output} does not end in {TEXTFILE_SUFFIX}: node_exporter's textfile "
                f"collector reads only *{TEXTFILE_SUFFIX} files, so it will not read this one",
            )
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
            exposed = "" if _loopback(host) else " (every host that reaches this port can scrape)"
            sys.stdout.write(
                f"serving {server.url}{exposed}: {len(args.paths)} ledger path(s), read "
                f"read-only, each scrape reading what changed; SIGTERM or Ctrl-C stops\n"
            )
            sys.stdout.flush()
            stop.wait()
        finally:
            server.close()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return exit_codes.OK


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def check_constant_labels(labels: Mapping[str, str]) -> None:
    """``--label`` names: Prometheus label names, none of the series' own (the parser already
    refused these with exit 2; this guards callers of the library)."""
    for name in labels:
        problem = label_name_problem(name)
        if problem is not None:
            raise LedgerError(f"--label {problem}")


@dataclass(frozen=True)
class FileSizes:
    """A ledger file's bytes on disk and its ``-wal``'s (0 when there is none)."""

    file_bytes: int
    wal_bytes: int


@dataclass(frozen=True)
class MetricsReport:
    """What one collection read: each ledger's overview (or why it could not), and when."""

    ledgers: tuple[LedgerOverview | UnreadableLedger, ...]
    labels: Mapping[str, str]
    collected_at: float  # UNIX seconds
    sizes: Mapping[str, FileSizes] = field(default_factory=dict)
    collect_seconds: float = 0.0

    @property
    def unreadable(self) -> tuple[UnreadableLedger, ...]:
        return tuple(item for item in self.ledgers if isinstance(item, UnreadableLedger))


def collect_metrics(
    specs: Sequence[str | os.PathLike[str]],
    labels: Mapping[str, str] | None = None,
    now: Callable[[], float] | None = None,
    cache: OverviewCache | None = None,
) -> MetricsReport:
    """Read the ledgers the PATH ``specs`` name (a spec naming none is itself unreadable).

    Each ledger is named by its real path (the ``ledger`` label), however the PATH spelled it.
    With ``cache`` each ledger is read on from what the cache kept (``OverviewCache``)."""
    started = time.perf_counter()
    read: list[LedgerOverview | UnreadableLedger] = []
    sizes: dict[str, FileSizes] = {}
    for spec in specs:
        try:
            paths = [Path(os.path.realpath(path)) for path in expand_ledger_paths([spec])]
        except LedgerFileError as exc:
            read.append(UnreadableLedger(os.fspath(spec), str(exc)))
            continue
        if cache is None:
            read.extend(read_overviews(paths))
        else:
            read.extend(_read_cached(cache, paths))
        for path in paths:
            sizes[os.fspath(path)] = _sizes(path)
    if cache is not None:
        cache.forget_except([item.path for item in read])
    clock = now or (lambda: datetime.datetime.now(datetime.timezone.utc).timestamp())
    return MetricsReport(
        tuple(read), dict(labels or {}), clock(), sizes, time.perf_counter() - started
    )


def _read_cached(
    cache: OverviewCache, paths: Sequence[Path]
) -> list[LedgerOverview | UnreadableLedger]:
    """``read_overviews``, through the cache."""
    found: list[LedgerOverview | UnreadableLedger] = []
    for path in paths:
        try:
            found.append(cache.read(path))
        except Exception:
            # The same wording as an uncached read: read it once more without the cache.
            found.extend(read_overviews([path]))
    return found


def _sizes(path: Path) -> FileSizes:
    def size(file: Path) -> int:
        try:
            return os.stat(file).st_size
        except OSError:
            return 0

    return FileSizes(size(path), size(path.with_name(path.name + "-wal")))


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


def digest_prefix(digest: str) -> float:
    """The digest's first 12 hex digits as a number (48 bits: exact in a float): equal values
    are equal layouts across ranks, with no label per digest."""
    try:
        return float(int(digest[:12], 16))
    except ValueError:
        return math.nan


def attached_engine_counts(item: LedgerOverview) -> Mapping[str | None, int]:
    """Attached engines by role (``active``, ``standby``; both always present, so a series
    that drops to 0 is still exported). ``_attached_family`` adds the ``role`` label."""
    state = item.state
    standbys = sum(1 for engine in state.attached if engine in state.standbys)
    return {ROLE_ACTIVE: len(state.attached) - standbys, ROLE_STANDBY: standbys}


def _gauges(item: LedgerOverview, now: float, sizes: FileSizes | None) -> dict[str, float]:
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
        "daemon_up": math.nan if alive is None else float(alive),
        "last_commit_timestamp_seconds": _seconds(item.last_commit_at),
        "incarnation": float(item.incarnation.incarnation_id),
        "digest_prefix": digest_prefix(state.digest),
        "non_following_fetch": float(state.non_following_fetch),
        "cordoned": float(state.cordon is not None),
        "standby_leases": float(len(state.leases)),
        "lease_holders": float(len(lease_holders(state))),
        "versions_held": float(state.version - item.reconstructible_from + 1),
        "ledger_file_bytes": float(0 if sizes is None else sizes.file_bytes),
        "ledger_wal_bytes": float(0 if sizes is None else sizes.wal_bytes),
    }


# name -> help text, for the gauges above (name without the prefix).
_GAUGE_HELP = {
    "version": "The current expert layout version of the daemon's latest incarnation.",
    "dirty": "1 while the layout is unknown (an engine left mid-move): restart the daemon.",
    "move_pending": "1 while an engine's two-phase move is pending (begun, not committed).",
    "move_pending_seconds": "How long the pending move has been pending, 0 when none is.",
    "daemon_up": "1 while the daemon owning the ledger runs (its writer lock is held), 0 when "
    "it does not; NaN when this host cannot tell (a free lock on a network filesystem).",
    "last_commit_timestamp_seconds": "When the current version was recorded (UNIX seconds).",
    "incarnation": "The id of the daemon's latest incarnation (one per daemon start).",
    "digest_prefix": "The first 12 hex digits of the layout's digest, as a number: ranks with "
    "equal values hold equal layouts.",
    "non_following_fetch": "1 once an engine that does not follow the layout fetched the "
    "weights: no engine may move experts until the daemon restarts.",
    "cordoned": "1 while an operator's cordon answers every begin busy (layout-ledger cordon).",
    "standby_leases": "Attached standby engines that hold a lease now (they serve: the one-mover "
    "rule counts them).",
    "lease_holders": "Attached engines that hold an active lease (every active engine, and each "
    "standby while it serves): a move may begin only while at most one does.",
    "versions_held": "Versions whose whole map the ledger still holds (retention prunes older).",
    "ledger_file_bytes": "The ledger file's size on disk.",
    "ledger_wal_bytes": "The size of the ledger's -wal file (0 when there is none).",
}


def families(report: MetricsReport) -> list[Any]:
    """The report as ``prometheus_client`` metric families (needs the ``metrics`` extra)."""
    core = _prometheus_core()
    constant = list(report.labels)
    extra = [_label_value(value) for value in report.labels.values()]
    labels = [*LEDGER_LABELS, *constant]
    readable = [item for item in report.ledgers if isinstance(item, LedgerOverview)]
    counted = [item for item in readable if item.retired is None]
    found: list[Any] = []
    for name, help_text in _GAUGE_HELP.items():
        gauge = core.GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
        for item in counted:
            values = _gauges(item, report.collected_at, report.sizes.get(item.path))
            gauge.add_metric(_ledger_labels(item) + extra, values[name])
        found.append(gauge)
    found.append(_attached_family(core, counted, labels, extra))
    found.extend(_counters(core, counted, labels, extra))
    info = core.InfoMetricFamily(
        PREFIX, "Where the daemon runs and what it runs, as labels.", labels=labels
    )
    for item in counted:
        info.add_metric(_ledger_labels(item) + extra, _info_labels(item))
    found.append(info)
    found.extend(_per_path(core, report, constant, extra))
    found.extend(_exporter(core, report, constant, extra))
    return found


def _attached_family(
    core: Any, counted: Sequence[LedgerOverview], labels: list[str], extra: list[str]
) -> Any:
    by_role = [(item, attached_engine_counts(item)) for item in counted]
    with_role = any(role is not None for _, roles in by_role for role in roles)
    gauge = core.GaugeMetricFamily(
        f"{PREFIX}_attached_engines",
        "Engines attached to the daemon (open attach connections)"
        + (", by role." if with_role else "."),
        labels=[*labels, "role"] if with_role else labels,
    )
    for item, roles in by_role:
        for role, count in roles.items():
            role_label = [_label_value(role)] if with_role else []
            gauge.add_metric([*_ledger_labels(item), *extra, *role_label], float(count))
    return gauge


def _counters(
    core: Any, counted: Sequence[LedgerOverview], labels: list[str], extra: list[str]
) -> Iterator[Any]:
    commits = core.CounterMetricFamily(
        f"{PREFIX}_commits",
        "Committed moves in the daemon's latest incarnation (reset when it restarts).",
        labels=labels,
    )
    refusals = core.CounterMetricFamily(
        f"{PREFIX}_refusals",
        "Requests the daemon refused in its latest incarnation, by event kind (<verb>_refused); "
        "a begin answered busy is no refusal (busy_begins_total).",
        labels=[*labels, "kind"],
    )
    begins = core.CounterMetricFamily(
        f"{PREFIX}_begin_refusals",
        "Begins the daemon refused in its latest incarnation, by cause.",
        labels=[*labels, "reason"],
    )
    busy = core.CounterMetricFamily(
        f"{PREFIX}_busy_begins",
        "Begins the daemon answered busy in its latest incarnation (the engine tries again "
        "later; no refusal), by cause: busy_other_engine, busy_other_move, "
        "busy_standby_without_lease, cordoned.",
        labels=[*labels, "reason"],
    )
    for item in counted:
        commits.add_metric(_ledger_labels(item) + extra, float(item.commits))
        for kind in REFUSAL_KINDS:
            if kind in ev.BUSY_KINDS.values():  # busy is no refusal (a busy lease neither)
                continue
            refusals.add_metric(
                [*_ledger_labels(item), *extra, kind], float(item.refusals.get(kind, 0))
            )
        for cause in BEGIN_CAUSE_NAMES:
            family = busy if cause in BUSY_BEGIN_CAUSES else begins
            family.add_metric(
                [*_ledger_labels(item), *extra, cause], float(item.begin_causes.get(cause, 0))
            )
    yield commits
    yield refusals
    yield begins
    yield busy


def _info_labels(item: LedgerOverview) -> dict[str, str]:
    origin = item.incarnation.origin
    values = {
        "config_fingerprint": item.incarnation.config_fingerprint,
        "pp_rank": origin.pp_rank,
        "ep_rank": origin.ep_rank,
        "socket_path": origin.socket_path,
        "sglang_version": origin.sglang_version,
        "plugin_version": origin.plugin_version,
    }
    return {name: _label_value(value) for name, value in values.items()}


def _per_path(core: Any, report: MetricsReport, constant: list[str], extra: list[str]) -> Any:
    readable = core.GaugeMetricFamily(
        f"{PREFIX}_ledger_readable",
        "1 when the ledger was read at this collection, 0 when it could not be (the exporter "
        "logs why).",
        labels=["ledger", *constant],
    )
    retired = core.GaugeMetricFamily(
        f"{PREFIX}_ledger_retired",
        "1 for a retired ledger (layout-ledger retire): no other series is exported for it.",
        labels=["ledger", *constant],
    )
    for item in report.ledgers:
        is_read = isinstance(item, LedgerOverview)
        readable.add_metric([_label_value(item.path), *extra], float(is_read))
        if isinstance(item, LedgerOverview):
            retired.add_metric([_label_value(item.path), *extra], float(item.retired is not None))
    return [readable, retired]


def _exporter(core: Any, report: MetricsReport, constant: list[str], extra: list[str]) -> Any:
    collected = core.GaugeMetricFamily(
        f"{PREFIX}_exporter_collected_timestamp_seconds",
        "When these series were collected (UNIX seconds): a textfile's age is time() minus it.",
        labels=constant,
    )
    collected.add_metric(extra, report.collected_at)
    took = core.GaugeMetricFamily(
        f"{PREFIX}_exporter_collect_seconds",
        "How long the collection of these series took.",
        labels=constant,
    )
    took.add_metric(extra, report.collect_seconds)
    return [collected, took]


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
    """A ``prometheus_client`` collector of one report."""

    def __init__(self, report: MetricsReport) -> None:
        self._report = report

    def collect(self) -> list[Any]:
        return families(self._report)


def exposition(report: MetricsReport) -> bytes:
    """The Prometheus text exposition format of ``report`` (``prometheus_client``'s own)."""
    _prometheus_core()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(report))
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


class MetricsServer:
    """The exporter: a bounded HTTP server whose scrapes share one collection, each reading
    the ledgers on from what the last one read."""

    def __init__(
        self,
        specs: Sequence[str | os.PathLike[str]],
        labels: Mapping[str, str],
        host: str,
        port: int,
        **bounds: Any,
    ) -> None:
        self._specs = list(specs)
        self._labels = dict(labels)
        self.cache = OverviewCache()
        self.shared = SharedCollection(self._collect)
        self.shared.get()  # the first collection replays each history once, before serving
        try:
            self.http = MetricsHTTPServer(host, port, self.shared.get, **bounds)
        except OSError as exc:
            raise LedgerError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc

    def _collect(self) -> bytes:
        report = collect_metrics(self._specs, self._labels, cache=self.cache)
        for item in report.unreadable:
            logger.warning("cannot read ledger %s: %s", item.path, item.problem)
        return exposition(report)

    @property
    def url(self) -> str:
        return self.http.url

    def close(self) -> None:
        self.http.close()


def serve_metrics(
    host: str,
    port: int,
    specs: Sequence[str | os.PathLike[str]],
    labels: Mapping[str, str] | None = None,
    **bounds: Any,
) -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` (port 0: any free one); ``bounds``: the server's
    ``max_connections``, ``deadline`` and ``workers``."""
    _prometheus_core()
    return MetricsServer(specs, labels or {}, host, port, **bounds)
