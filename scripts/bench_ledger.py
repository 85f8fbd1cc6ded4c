#!/usr/bin/env python3
"""Ledger benchmark at DeepSeek-V3 scale (scripts/deepseek_geometry.py: the map a DeepSeek-V3
daemon keeps, 61 layers x 288 physical slots, 256 logical experts; an all-layer chunk moves the
58 layers 3-60 that hold routed experts).

Prints, measured side by side in one run:
  (a) durable commit of one all-layer chunk: ledger vs in-memory record vs an atomic rewrite
      of the whole map as one JSON file (write, fsync, rename, fsync dir), each through the same
      record rules (validation, digest), so the difference is the persistence alone;
  (b) reconstruction of the current map after 10 and after 10,000 committed versions;
  (c) bytes on disk per committed layer row;
  (d) file size after a simulated week of rebalancing every minute (10,080 all-layer commits)
      with the default retention;
  (e) begin+commit latency for 60 s with no reader, then with a reader in another process that
      holds one read snapshot the whole time (an `sqlite3` session left in a transaction);
  (f) file + WAL growth from 20,000 identical refused begins.

  .venv/bin/python scripts/bench_ledger.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deepseek_geometry import DEEPSEEK_V3, DEEPSEEK_V3_MOE_LAYERS
from layout_ledger.core import events as ev
from layout_ledger.core.layout import row_json, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.retention import Retention
from layout_ledger.store.rows import current_version, incarnation, map_at
from layout_ledger.wire.protocol import pending_to_wire
from sglang_integration.settings import DEFAULT_KEEP_VERSIONS, DEFAULT_PRUNE_EVERY

GEOMETRY = DEEPSEEK_V3
# An all-layer chunk: every layer with routed experts (the dense layers 0-2 never move).
ALL_LAYERS = list(DEEPSEEK_V3_MOE_LAYERS)


def _initial() -> list[list[int]]:
    return trivial_map(
        GEOMETRY.num_layers, GEOMETRY.num_physical_slots, GEOMETRY.num_logical_experts
    )


# What a daemon prunes by itself with the default settings.
DAEMON_RETENTION = Retention(keep_versions=DEFAULT_KEEP_VERSIONS, prune_every=DEFAULT_PRUNE_EVERY)


class JsonFileJournal:
    """The baseline: every change rewrites the whole state as one JSON file, atomically
    (write, fsync, rename, fsync the directory). It keeps no history.

    ``reuse_row_json=False`` serializes the map with ``json.dumps`` (the C encoder) on every
    change, as a JSON-file design would. ``reuse_row_json=True`` favours the baseline: it
    builds the file from the per-row JSON text the record already computed for the digest, so
    all it pays beyond the in-memory record is the write and its two fsyncs.
    """

    def __init__(self, path: Path, reuse_row_json: bool) -> None:
        self.path = path
        self.reuse_row_json = reuse_row_json
        self.record: LayoutRecord | None = None
        # The json.dumps variant keeps the map as lists, as a JSON-file design would; the
        # benchmark hands it each commit's request rows (the record hands a journal only the
        # rows' JSON text).
        self.map: list[list[int]] | None = None
        self.request_rows: dict[int, list[int]] = {}

    def append(
        self,
        events: Sequence[ev.Event],
        rows: Mapping[int, str] | None = None,
        fingerprints: object = None,
    ) -> None:
        record = self.record
        if record is None:
            raise RuntimeError("bind the journal to its record first")
        last = events[-1]
        version = last.new_version if rows else record.version
        digest = last.digest_after if rows else record.digest
        pending = None if record.pending is None else pending_to_wire(record.pending)
        row_jsons = record.row_jsons()
        for layer, text in (rows or {}).items():
            row_jsons[layer] = text
        if self.reuse_row_json:
            data = (
                f'{{"version":{version},"digest":"{digest}","pending":{json.dumps(pending)},'
                f'"physical_to_logical_map":[{",".join(row_jsons)}]}}'
            ).encode()
        else:
            if self.map is None:
                self.map = [json.loads(text) for text in record.row_jsons()]
            for layer, row in (self.request_rows if rows else {}).items():
                self.map[layer] = row
            state = {
                "version": version,
                "digest": digest,
                "pending": pending,
                "physical_to_logical_map": self.map,
            }
            data = json.dumps(state, separators=(",", ":")).encode()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(tmp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def json_file_record(path: Path, reuse_row_json: bool, initial: list[list[int]]) -> LayoutRecord:
    journal = JsonFileJournal(path, reuse_row_json)
    record = LayoutRecord(journal, 1, GEOMETRY, initial)
    journal.record = record
    return record


def random_rows(rng: random.Random, layers: list[int]) -> dict[int, list[int]]:
    return {
        layer: [
            rng.randrange(GEOMETRY.num_logical_experts) for _ in range(GEOMETRY.num_physical_slots)
        ]
        for layer in layers
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def bench_commit(workdir: Path, commits: int) -> dict[str, list[float]]:
    rng = random.Random(1)
    chunks = [random_rows(rng, ALL_LAYERS) for _ in range(commits)]
    initial = _initial()
    ledger = Ledger.open(workdir / "commit.sqlite", DAEMON_RETENTION)
    records = {
        "ledger (SQLite, WAL, synchronous=FULL)": ledger.start_incarnation(GEOMETRY, initial),
        "in-memory record (no persistence)": LayoutRecord.in_memory(GEOMETRY, initial),
        "atomic JSON rewrite, json.dumps of the map": json_file_record(
            workdir / "dumps.json", False, initial
        ),
        "atomic JSON rewrite, reusing the row JSON (favoured)": json_file_record(
            workdir / "rows.json", True, initial
        ),
    }
    timings: dict[str, list[float]] = {name: [] for name in [*records, FLOOR, PICKLE]}
    for record in records.values():
        record.attach("engine")
    floor = _floor_connection(workdir / "floor.sqlite")
    # Interleave them all so machine noise hits them alike.
    for rows in chunks:
        for name, record in records.items():
            if isinstance(record.journal, JsonFileJournal):
                record.journal.request_rows = rows
            record.begin("engine", record.version, ALL_LAYERS)
            started = time.perf_counter()
            record.commit("engine", rows)
            timings[name].append(time.perf_counter() - started)
        blob = ",".join(row_json(rows[layer]) for layer in ALL_LAYERS).encode()
        started = time.perf_counter()
        floor.execute("BEGIN IMMEDIATE")
        floor.execute("INSERT INTO floor (data) VALUES (?)", (blob,))
        floor.execute("COMMIT")
        timings[FLOOR].append(time.perf_counter() - started)
        request = pickle.dumps(
            {"type": "expert_layout_commit", "engine_id": "engine", "rows": rows},
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        started = time.perf_counter()
        pickle.loads(request)
        timings[PICKLE].append(time.perf_counter() - started)
    floor.close()
    ledger.close()
    return timings


FLOOR = "physical floor: one WAL FULL transaction, the row bytes as one BLOB"
PICKLE = "pickle.loads of the commit request"


def _floor_connection(path: Path) -> sqlite3.Connection:
    """The physical floor of a durable all-layer commit: SQLite, WAL, synchronous=FULL, the same
    row bytes written as one BLOB in one transaction (no index, no history, no validation)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE floor (id INTEGER PRIMARY KEY, data BLOB NOT NULL)")
    return conn


def bench_reconstruction(workdir: Path, versions: int, repeats: int) -> dict[str, float]:
    path = workdir / f"history-{versions}.sqlite"
    ledger = Ledger.open(path, Retention(keep_versions=10**9, prune_every=10**9))
    record = ledger.start_incarnation(GEOMETRY, _initial())
    record.attach("engine")
    rng = random.Random(versions)
    for _ in range(versions):
        layer = rng.choice(ALL_LAYERS)
        record.begin("engine", record.version, [layer])
        record.commit("engine", random_rows(rng, [layer]))
    ledger.close()
    samples: dict[str, list[float]] = {"reconstruction": [], "primary key": []}
    with LedgerReader(path) as handle:
        for _ in range(repeats):
            with handle.connect() as conn:
                inc = incarnation(conn)
                _version, _ = current_version(conn, inc.incarnation_id)
                started = time.perf_counter()
                map_at(conn, inc)
                samples["reconstruction"].append(time.perf_counter() - started)
                ids = _current_row_ids(conn, inc.incarnation_id)
                marks = ",".join("?" * len(ids))
                started = time.perf_counter()
                rows = conn.exec_driver_sql(
                    f"SELECT slots FROM layout_rows WHERE row_id IN ({marks})", tuple(ids)
                ).all()
                [json.loads(slots) for (slots,) in rows]
                samples["primary key"].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def _current_row_ids(conn: Any, incarnation_id: int) -> list[int]:
    """The row ids of the current map's rows (the baseline reads exactly these by key)."""
    return [
        int(row_id)
        for (row_id,) in conn.exec_driver_sql(
            "SELECT (SELECT row_id FROM layout_rows r WHERE r.incarnation_id = ? "
            "AND r.layer = l.layer ORDER BY version DESC LIMIT 1) "
            "FROM (SELECT DISTINCT layer FROM layout_rows WHERE incarnation_id = ?) l",
            (incarnation_id, incarnation_id),
        )
    ]


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def bench_row_bytes(workdir: Path, commits: int) -> float:
    path = workdir / "rows.sqlite"
    ledger = Ledger.open(path, Retention(keep_versions=10**9, prune_every=10**9))
    record = ledger.start_incarnation(GEOMETRY, _initial())
    record.attach("engine")
    ledger.checkpoint(truncate=True)
    before = file_bytes(path)
    rng = random.Random(3)
    for _ in range(commits):
        record.begin("engine", record.version, ALL_LAYERS)
        record.commit("engine", random_rows(rng, ALL_LAYERS))
    ledger.checkpoint(truncate=True)
    after = file_bytes(path)
    ledger.close()
    return (after - before) / (commits * len(ALL_LAYERS))


def bench_week(workdir: Path, commits: int) -> tuple[int, int]:
    path = workdir / "week.sqlite"
    ledger = Ledger.open(path, DAEMON_RETENTION)
    record = ledger.start_incarnation(GEOMETRY, _initial())
    record.attach("engine")
    rng = random.Random(4)
    pool = [random_rows(rng, ALL_LAYERS) for _ in range(16)]
    peak = 0
    for n in range(commits):
        record.begin("engine", record.version, ALL_LAYERS)
        record.commit("engine", pool[n % len(pool)])
        if n % 500 == 0:
            peak = max(peak, file_bytes(path))
    ledger.close()
    return file_bytes(path), max(peak, file_bytes(path))


# A forensic reader in another process: opens the ledger read-only, begins a read transaction,
# reads, and holds that snapshot until it is killed (what `sqlite3 LEDGER` + `BEGIN; SELECT ...`
# left open does).
_HOLD_SNAPSHOT = """
import sqlite3, sys, time
conn = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, isolation_level=None)
conn.execute("BEGIN")
conn.execute("SELECT count(*) FROM events").fetchone()
print("holding", flush=True)
time.sleep(3600)
"""


def bench_reader_snapshot(workdir: Path, seconds: float, reader: bool) -> list[float]:
    """begin+commit of all-layer chunks for ``seconds``, with or without a reader that holds
    one snapshot the whole time; returns each round's latency."""
    import subprocess
    import sys

    path = workdir / f"snapshot-{reader}.sqlite"
    ledger = Ledger.open(path, Retention(keep_versions=10**9, prune_every=10**9))
    record = ledger.start_incarnation(GEOMETRY, _initial())
    record.attach("engine")
    rng = random.Random(5)
    pool = [random_rows(rng, ALL_LAYERS) for _ in range(16)]
    holder = None
    if reader:
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD_SNAPSHOT, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    rounds: list[float] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            record.begin("engine", record.version, ALL_LAYERS)
            record.commit("engine", pool[len(rounds) % len(pool)])
            rounds.append(time.perf_counter() - started)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        ledger.close()
    return rounds


def bench_refusal_flood(workdir: Path, refusals: int) -> tuple[int, float]:
    """``refusals`` identical refused begins (an engine that is not attached); returns the growth
    of file + WAL in bytes and the refusals per second."""
    from layout_ledger.core.errors import RequestRefused

    path = workdir / "flood.sqlite"
    ledger = Ledger.open(path, DAEMON_RETENTION)
    record = ledger.start_incarnation(GEOMETRY, _initial())
    record.attach("engine")
    ledger.checkpoint(truncate=True)
    before = file_bytes(path)
    started = time.perf_counter()
    for _ in range(refusals):
        with contextlib.suppress(RequestRefused):
            record.begin("intruder-" + "x" * 200, 0, ALL_LAYERS)
    elapsed = time.perf_counter() - started
    if ledger.maintenance is not None:
        ledger.maintenance.wait_idle(60)
    grown = file_bytes(path) - before
    ledger.close()
    return grown, refusals / elapsed


def print_reader_snapshot(seconds: float, alone: list[float], pinned: list[float]) -> None:
    print(
        f"(e) begin+commit of all-layer chunks for {seconds:.0f} s, without and with a reader "
        f"holding one snapshot the whole time"
    )
    print(f"    {'':34s} {'rounds':>7s} {'median':>10s} {'p99':>10s} {'max':>10s}")
    for name, values in (("no reader", alone), ("a reader holds a snapshot", pinned)):
        print(
            f"    {name:34s} {len(values):7d} {ms(statistics.median(values)):>10s} "
            f"{ms(pct(values, 0.99)):>10s} {ms(max(values)):>10s}"
        )
    ratio = pct(pinned, 0.99) / pct(alone, 0.99)
    print(f"    max with the reader:  {ms(max(pinned))}   (target < 50 ms)")
    print(f"    p99 with / without:   {ratio:.2f}   (target <= 2.00)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--dir", type=Path, help="where to put the files (default: a temp dir)")
    args = parser.parse_args()
    commits, long_history, week = (30, 1000, 1000) if args.quick else (300, 10_000, 10_080)
    pinned_seconds, refusals = (10.0, 2000) if args.quick else (60.0, 20_000)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = Path(tmp)
        timings = bench_commit(workdir, commits)
        short = bench_reconstruction(workdir, 10, repeats=50)
        long = bench_reconstruction(workdir, long_history, repeats=50)
        row_bytes = bench_row_bytes(workdir, 50)
        week_final, week_peak = bench_week(workdir, week)
        alone = bench_reader_snapshot(workdir, pinned_seconds, reader=False)
        pinned = bench_reader_snapshot(workdir, pinned_seconds, reader=True)
        flood_bytes, flood_rate = bench_refusal_flood(workdir, refusals)

    ledger_name, memory_name, json_name, favoured_name = list(timings)[:4]
    print(
        f"Ledger benchmark, {GEOMETRY.num_layers} layers x {GEOMETRY.num_physical_slots} slots, "
        f"{GEOMETRY.num_logical_experts} experts, {os.cpu_count()} CPUs"
    )
    print()
    print(f"(a) durable commit of one all-layer chunk, {commits} commits each, interleaved")
    print(f"    {'':58s} {'median':>10s} {'p99':>10s}")
    for name, values in timings.items():
        print(f"    {name:58s} {ms(statistics.median(values)):>10s} {ms(pct(values, 0.99)):>10s}")
    ledger_median = statistics.median(timings[ledger_name])
    vs_json = ledger_median / statistics.median(timings[json_name])
    vs_favoured = ledger_median / statistics.median(timings[favoured_name])
    vs_memory = ledger_median / statistics.median(timings[memory_name])
    print(f"    ledger / JSON rewrite median:  {vs_json:.2f}   (target <= 1.00)")
    print(f"    ledger / favoured JSON median: {vs_favoured:.2f}")
    print(f"    ledger / in-memory median:     {vs_memory:.2f}")
    ledger_p99 = ms(pct(timings[ledger_name], 0.99))
    print(f"    ledger p99:                    {ledger_p99}   (target < 10 ms)")
    vs_floor = ledger_median / statistics.median(timings[FLOOR])
    print(f"    ledger / physical floor:       {vs_floor:.2f}   (target <= 2.00)")
    cpu = statistics.median(timings[memory_name]) / statistics.median(timings[PICKLE])
    print(f"    record's CPU work / pickle.loads of the request: {cpu:.2f}   (target <= 3.00)")
    print()
    print("(b) reconstruction of the current map as lists of ints (median of 50)")
    print(f"    after 10 versions:      {ms(short['reconstruction'])}")
    print(f"    after {long_history:,} versions:  {ms(long['reconstruction'])}")
    print(f"    ratio:                  {long['reconstruction'] / short['reconstruction']:.2f}")
    pk = long["primary key"]
    print(f"    reading the same {GEOMETRY.num_layers} rows by primary key: {ms(pk)}")
    ratio = long["reconstruction"] / pk
    label = f"reconstruction / primary-key read after {long_history:,}"
    print(f"    {label}: {ratio:.2f}   (target <= 1.5)")
    print()
    print(
        f"(c) bytes on disk per committed layer row ({GEOMETRY.num_physical_slots} slots): "
        f"{row_bytes:.0f}"
    )
    print()
    print(
        f"(d) {week:,} all-layer commits (a week at one a minute), default retention "
        f"(keep {DEFAULT_KEEP_VERSIONS} versions, prune every {DEFAULT_PRUNE_EVERY})"
    )
    print(
        f"    final file + WAL: {week_final / 2**20:.1f} MiB; peak: {week_peak / 2**20:.1f} MiB"
        "   (target < 256 MiB)"
    )
    print()
    print_reader_snapshot(pinned_seconds, alone, pinned)
    print()
    print(
        f"(f) {refusals:,} identical refused begins ({flood_rate:,.0f}/s): file + WAL grew "
        f"{flood_bytes / 2**20:.2f} MiB   (target < 8 MiB for 20,000)"
    )


if __name__ == "__main__":
    main()
