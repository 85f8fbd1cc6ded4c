"""Crash safety, shown: SIGKILL a real writer at random moments, at least 30 times, and reopen.

After every kill: ``PRAGMA integrity_check`` is ok; every acknowledged commit is present with
the digest it was acknowledged with; no half-written commit is visible (each version holds all
the rows its layers name, and every stored version rebuilds to its recorded digest); and the
pending/dirty state is what the last acknowledged step implies, or what the step in flight at
the kill would have made it (a kill can land after the write and before the acknowledgement).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from layout_ledger.core.layout import layout_digest
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store import rows as r
from layout_ledger.store.replay import read_state

WRITER = Path(__file__).with_name("ledger_crash_writer.py")
KILLS = 32


@dataclass(frozen=True)
class Expected:
    version: int = 0
    digest: str | None = None  # None: the initial digest (not checked by value)
    pending: tuple[int, ...] | None = None
    dirty: tuple[int, ...] | None = None


def apply(state: Expected, op: str, arg) -> Expected:
    if op == "begin":
        return replace(state, pending=tuple(arg))
    if op == "commit":
        version, digest = (arg, None) if isinstance(arg, int) else arg
        return replace(state, version=version, digest=digest, pending=None)
    if op == "abort":
        return replace(state, pending=None)
    if op == "detach":
        return replace(state, pending=None, dirty=state.pending)
    return state


def run_writer(path: Path, seed: int, kill_after: float):
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []
    reading = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reading.start()
    started = time.monotonic()
    while not any(line.startswith("inc ") for line in lines) and time.monotonic() - started < 30:
        if kill_after < 0 and time.monotonic() - started > -kill_after:
            break  # some kills land during start-up
        time.sleep(0.005)
    if kill_after > 0:
        time.sleep(kill_after)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reading.join(timeout=5)
    return lines


def check_after_kill(path: Path, lines: list[str], acked_digests: dict[tuple[int, int], str]):
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as shell:
        assert shell.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    incarnation = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("inc ")]
    if not incarnation:
        return None
    (incarnation_id,) = incarnation
    acked = Expected()
    in_flight = None
    for line in lines:
        if line.startswith("inc ") or not line.endswith("\n"):
            continue  # the incarnation line, or a line cut short by the kill
        kind, op, arg = line.rstrip("\n").split(" ", 2)
        if kind == "ack":
            acked = apply(acked, op, json.loads(arg))
            in_flight = None
            if op == "commit":
                version, digest = json.loads(arg)
                acked_digests[(incarnation_id, version)] = digest
        elif kind == "intent":
            in_flight = (op, json.loads(arg))
    allowed = [acked] + ([apply(acked, *in_flight)] if in_flight else [])

    with LedgerReader(path) as reader, reader.connect() as conn:
        state = read_state(conn, incarnation_id)
        inc = r.incarnation(conn, incarnation_id)
        versions = conn.exec_driver_sql(
            "SELECT version, digest, layers FROM versions WHERE incarnation_id = ? "
            "ORDER BY version",
            (incarnation_id,),
        ).all()
        assert [v for v, _, _ in versions] == list(range(state.version + 1)), "gap in versions"
        for version, digest, layers in versions:
            rows = (
                conn.exec_driver_sql(
                    "SELECT layer FROM layout_rows WHERE incarnation_id = ? AND version = ? "
                    "ORDER BY layer",
                    (incarnation_id, version),
                )
                .scalars()
                .all()
            )
            assert rows == json.loads(layers), f"half-written version {version}"
            assert layout_digest(r.map_at(conn, inc, version)) == digest
    for (inc_id, version), digest in acked_digests.items():
        if inc_id == incarnation_id:
            assert versions[version][1] == digest, f"acknowledged commit {version} lost"
    actual = Expected(
        version=state.version,
        digest=state.digest,
        pending=state.pending.layers if state.pending else None,
        dirty=state.dirty.move.layers if state.dirty else None,
    )
    assert any(
        (a.version, a.pending, a.dirty) == (actual.version, actual.pending, actual.dirty)
        and a.digest in (None, actual.digest)
        for a in allowed
    ), (actual, allowed)
    return incarnation_id, actual


def test_sigkilled_writers_never_lose_an_acknowledged_commit_or_show_a_half_written_one(tmp_path):
    path = tmp_path / "ledger.sqlite"
    rng = random.Random(20261129)
    acked_digests: dict[tuple[int, int], str] = {}
    outcomes = []
    for kill in range(KILLS):
        kill_after = -rng.uniform(0.05, 0.6) if kill % 8 == 7 else rng.uniform(0.0, 0.4)
        lines = run_writer(path, seed=kill, kill_after=kill_after)
        outcomes.append(check_after_kill(path, lines, acked_digests))
    started = [o for o in outcomes if o is not None]
    assert len(started) >= KILLS // 2
    assert sum(1 for _, actual in started if actual.version > 0) >= KILLS // 4
    # Every acknowledged commit of every run is still there after all the later kills.
    with LedgerReader(path) as reader, reader.connect() as conn:
        for (inc_id, version), digest in acked_digests.items():
            stored = conn.exec_driver_sql(
                "SELECT digest FROM versions WHERE incarnation_id = ? AND version = ?",
                (inc_id, version),
            ).scalar()
            assert stored == digest
        # Each killed incarnation was ended by its successor as dirty or unknown, never clean.
        ends = {i.incarnation_id: i.end_state for i in r.incarnations(conn)}
    killed = sorted(ends)[:-1]
    assert all(ends[i] in ("dirty", "unknown") for i in killed)
    for inc_id, actual in started:
        if inc_id in ends and inc_id != max(ends):
            assert (ends[inc_id] == "dirty") == (actual.dirty is not None)
