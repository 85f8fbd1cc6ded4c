"""Ledgers the CLI tests read, built through the real ``Ledger``/``LayoutRecord``.

Times come from a fixed clock (``fixed_clock``), so the CLI's output is exact text: the n-th
timestamp the ledger asks for is 2026-01-01T00:00:00+00:00 plus n seconds. The builders make:

- ``clean``: incarnation 1 ran and ended cleanly; incarnation 2 (still running) has three
  committed moves, an abort, a busy begin and an attached engine.
- ``dirty``: an engine detached (EOF) while its move was pending; then two refusals.
- ``mid_move``: an engine's move is pending.
- ``refusals``: nothing wrong with the layout, but the daemon refused a request.
- ``standby``: an active engine moves with a standby attached; the standby takes, releases and
  takes again its lease.

``build`` runs a builder in a child process that then exits without closing anything, as a
killed daemon would: the incarnation stays unended and the writer lock is released by the
kernel, so tests can read the file and even open it for writing.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import sqlite3
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from layout_ledger.core import record as record_module
from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store import ledger as ledger_module
from layout_ledger.store.ledger import Ledger

GEOMETRY = Geometry(num_layers=4, num_physical_slots=6, num_logical_experts=4)
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def at(second: int) -> str:
    return (EPOCH + datetime.timedelta(seconds=second)).isoformat(timespec="microseconds")


@contextlib.contextmanager
def fixed_clock() -> Iterator[None]:
    """Make the ledger's timestamps 0 s, 1 s, 2 s, ... after ``EPOCH``, one per call."""
    ticks = iter(range(10**6))
    saved = (record_module.utc_now, ledger_module.utc_now)

    def clock() -> str:
        return at(next(ticks))

    record_module.utc_now = clock  # type: ignore[assignment]
    ledger_module.utc_now = clock  # type: ignore[assignment]
    try:
        yield
    finally:
        record_module.utc_now, ledger_module.utc_now = saved  # type: ignore[assignment]


def rotated(row: list[int], by: int) -> list[int]:
    return row[by:] + row[:by]


def start(ledger: Ledger, geometry: Geometry = GEOMETRY) -> LayoutRecord:
    initial = trivial_map(
        geometry.num_layers, geometry.num_physical_slots, geometry.num_logical_experts
    )
    return ledger.start_incarnation(
        geometry, initial, config_fingerprint="fp", daemon_label="test-daemon"
    )


def commit(record: LayoutRecord, engine: str, rows: dict[int, list[int]]) -> int:
    record.begin(engine, record.version, sorted(rows))
    version, _ = record.commit(engine, rows)
    return version


# The three moves of build_clean's second incarnation, layer -> row.
MOVES: tuple[dict[int, list[int]], ...] = (
    {0: [1, 0, 2, 3, 0, 1], 1: [0, 1, 3, 2, 0, 1]},
    {2: [3, 2, 1, 0, 0, 1]},
    {0: [1, 0, 2, 3, 1, 0], 3: [2, 3, 0, 1, 0, 1]},
)


def _clean(path: Path) -> None:
    ledger = Ledger.open(path)
    first = start(ledger)  # t0 start
    first.attach("engine-old")  # t1
    first.detach("engine-old")  # t2
    ledger.end_incarnation()  # t3 end clean
    record = start(ledger)  # t4 start of incarnation 2
    record.attach("engine-a")  # t5
    commit(record, "engine-a", MOVES[0])  # t6 begin, t7 commit -> v1
    commit(record, "engine-a", MOVES[1])  # t8, t9 -> v2
    record.attach("engine-b")  # t10
    record.record_refusal("begin", "engine-a", "engine-b is attached", busy=True)  # t11
    record.detach("engine-b")  # t12
    record.begin("engine-a", 2, [1])  # t13
    record.abort("engine-a")  # t14
    commit(record, "engine-a", MOVES[2])  # t15, t16 -> v3


def _dirty(path: Path) -> None:
    ledger = Ledger.open(path)
    record = start(ledger)  # t0
    record.attach("engine-a")  # t1
    commit(record, "engine-a", {1: [3, 2, 1, 0, 0, 1]})  # t2, t3 -> v1
    record.begin("engine-a", 1, [2, 3])  # t4
    record.detach("engine-a")  # t5 detach + dirty
    record.record_refusal("fetch", "engine-b", "dirty")  # t6
    record.record_refusal("begin", "engine-b", "dirty")  # t7


def _mid_move(path: Path) -> None:
    ledger = Ledger.open(path)
    record = start(ledger)  # t0
    record.attach("engine-a")  # t1
    commit(record, "engine-a", {0: [1, 0, 2, 3, 0, 1]})  # t2, t3 -> v1
    record.begin("engine-a", 1, [0, 1])  # t4


def _refusals(path: Path) -> None:
    ledger = Ledger.open(path)
    record = start(ledger)  # t0
    record.attach("engine-a")  # t1
    record.record_refusal("attach", "engine-a", "engine 'engine-a' is already attached")  # t2


def _standby(path: Path) -> None:
    ledger = Ledger.open(path)
    record = start(ledger)  # t0
    record.attach("engine-a")  # t1
    record.attach("engine-c", "standby")  # t2: attached, no lease
    commit(record, "engine-a", MOVES[0])  # t3, t4 -> v1 (the standby does not count)
    record.lease("engine-c")  # t5: it serves
    record.record_refusal("begin", "engine-a", "other engines are attached", busy=True)  # t6
    record.release("engine-c")  # t7
    commit(record, "engine-a", MOVES[1])  # t8, t9 -> v2
    record.lease("engine-c")  # t10: holds a lease now


BUILDERS: dict[str, Callable[[Path], None]] = {
    "clean": _clean,
    "dirty": _dirty,
    "mid_move": _mid_move,
    "refusals": _refusals,
    "standby": _standby,
}


def _build_and_die(kind: str, path: Path) -> None:
    try:
        with fixed_clock():
            BUILDERS[kind](path)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # A killed daemon: no end event, no detach; the kernel drops the writer lock.
    os._exit(0)


def build(kind: str, path: Path) -> Path:
    """Build ledger ``kind`` at ``path`` in a child process that then dies like a killed daemon
    (so the last incarnation stays running, and a pending move stays pending)."""
    process = multiprocessing.get_context("fork").Process(target=_build_and_die, args=(kind, path))
    process.start()
    process.join(60)
    if process.exitcode != 0:
        raise RuntimeError(f"building the {kind} ledger failed (exit {process.exitcode})")
    return path


def committing_writer(path: str, ready: Any, stop: Any, commits: Any) -> None:
    """A daemon-like writer process: commit moves until ``stop`` is set (for reading tests)."""
    ledger = Ledger.open(path)
    record = start(ledger)
    record.attach("engine-w")
    ready.set()
    step = 0
    while not stop.is_set():
        layer = step % GEOMETRY.num_layers
        row = rotated([*range(GEOMETRY.num_logical_experts), 0, 1], step % 6)
        commit(record, "engine-w", {layer: row})
        step += 1
        commits.value = step
        time.sleep(0.002)
    ledger.close()


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``layout-ledger ARGV`` in this process: (exit code, stdout, stderr)."""
    from layout_ledger.cli.app import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def map_after(moves: tuple[dict[int, list[int]], ...], count: int) -> list[list[int]]:
    """The map of build_clean's second incarnation after its first ``count`` moves."""
    the_map = trivial_map(
        GEOMETRY.num_layers, GEOMETRY.num_physical_slots, GEOMETRY.num_logical_experts
    )
    for rows in moves[:count]:
        for layer, row in rows.items():
            the_map[layer] = list(row)
    return the_map


def execute(path: Path, *statements: str, foreign_keys: bool = True) -> None:
    """Change a ledger behind the ledger's back with plain sqlite3, and close the connection at
    once (a lingering one would checkpoint the WAL whenever it is collected)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        with conn:
            for statement in statements:
                conn.execute(statement)
    finally:
        conn.close()


def query(path: Path, sql: str) -> list[Any]:
    """Rows of ``sql`` from a read-only connection, closed at once."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()
