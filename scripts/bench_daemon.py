"""Benchmark the daemon side: persistent vs in-memory moves, and detach latency after SIGKILL.

    .venv/bin/python scripts/bench_daemon.py [--rounds 200] [--kills 120] [--others 32]

Everything runs side by side in one run, over real Unix sockets, against model-less daemons
(sglang 0.5.23's real ``WeightCacheDaemon`` serve loop and request handling with the plugin,
``sglang_integration.testing.daemon``), each in its own process:

1. Round trip of one all-layer chunk at DeepSeek-V3 scale (scripts/deepseek_geometry.py: a map of
   61 layers x 288 physical slots, 256 logical experts, whose layers 3-60 hold routed experts):
   ``expert_layout_begin`` + ``expert_layout_commit`` of those 58 MoE layers' rows, each
   on its own connection as an engine sends them, against a daemon whose record is the SQLite
   ledger (every change durable before the reply) and against the same daemon code with an
   in-memory record (``MemoryJournal``). The two alternate round by round. Target: the ledger's
   median within 3x of the in-memory median.
2. Detach latency: 32 other engine processes stay attached while, again and again, one more
   engine process attaches and is killed with SIGKILL. Measured from just before ``kill()`` to
   the moment its ``detach`` event is visible (committed, durable) in the ledger, polled
   read-only every 0.5 ms. Split in two: the kernel closing the killed process's descriptors
   (its exit; seen here as the EOF of its command pipe, closed in the same step as its attach
   connection), and the daemon's share from that close to the durable row; also the daemon's
   own timestamp of the detach. Target: p99 of the whole interval under 100 ms.

Exit status: 0 when both targets are met, 1 when one is missed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from pathlib import Path

from deepseek_geometry import DEEPSEEK_V3, DEEPSEEK_V3_MOE_LAYERS
from layout_ledger.core.layout import trivial_map
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    stand_ins,
    start_daemon,
)

LAYERS, PHYSICAL, LOGICAL = (
    DEEPSEEK_V3.num_layers,
    DEEPSEEK_V3.num_physical_slots,
    DEEPSEEK_V3.num_logical_experts,
)
MOE_LAYERS = list(DEEPSEEK_V3_MOE_LAYERS)  # an all-layer chunk: every layer with routed experts
RATIO_TARGET = 3.0  # the proposal's
RATIO_GOAL = 1.3  # the per-chunk overhead issue's: printed, not the exit status
DETACH_P99_TARGET_MS = 100.0
POLL_INTERVAL = 0.0005

KILL_TO_CLOSE = "kill -> connection closed (engine exit)"
CLOSE_TO_DURABLE = "closed -> detach durable (daemon)"
KILL_TO_STAMP = "kill -> daemon's detach timestamp"
KILL_TO_DURABLE = "kill -> detach durable in ledger"
DETACH_MEASURES = (KILL_TO_CLOSE, CLOSE_TO_DURABLE, KILL_TO_STAMP, KILL_TO_DURABLE)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def alternating_maps() -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Two valid whole-model row sets that differ in every layer."""
    initial = trivial_map(LAYERS, PHYSICAL, LOGICAL)
    shifted = {layer: [(v + 1 + layer) % LOGICAL for v in initial[layer]] for layer in MOE_LAYERS}
    return shifted, {layer: initial[layer] for layer in MOE_LAYERS}


def round_trip_ms(
    daemon: DaemonProcess, engine_id: str, version: int, rows: dict[int, list[int]]
) -> float:
    layers = MOE_LAYERS
    start = time.perf_counter()
    begin = client.begin(daemon.socket_path, engine_id, version, layers)
    commit = client.commit(daemon.socket_path, engine_id, rows)
    elapsed = (time.perf_counter() - start) * 1000
    if not (begin.ok and commit.ok and commit.body["version"] == version + 1):
        raise RuntimeError(f"a move failed on {daemon.socket_path}: {begin} / {commit}")
    return elapsed


def bench_round_trips(directory: Path, rounds: int, warmup: int) -> dict[str, list[float]]:
    daemons = {
        "ledger (SQLite, durable)": start_daemon(
            directory,
            "ledger",
            num_layers=LAYERS,
            num_physical_experts=PHYSICAL,
            num_logical_experts=LOGICAL,
        ),
        "in-memory record": start_daemon(
            directory,
            "memory",
            num_layers=LAYERS,
            num_physical_experts=PHYSICAL,
            num_logical_experts=LOGICAL,
            record="memory",
        ),
    }
    maps = alternating_maps()
    times: dict[str, list[float]] = {name: [] for name in daemons}
    attachments = []
    try:
        for daemon in daemons.values():
            attachment = client.attach(daemon.socket_path, "bench-engine")
            if not attachment.reply.ok:
                raise RuntimeError(f"attach failed: {attachment.reply}")
            attachments.append(attachment)
        names = list(daemons)
        for index in range(warmup + rounds):
            order = names if index % 2 == 0 else names[::-1]
            for name in order:
                elapsed = round_trip_ms(daemons[name], "bench-engine", index, maps[index % 2])
                if index >= warmup:
                    times[name].append(elapsed)
    finally:
        for attachment in attachments:
            attachment.close()
        for daemon in daemons.values():
            daemon.stop()
    return times


def bench_detach(directory: Path, kills: int, others: int) -> dict[str, list[float]]:
    """Per kill: ms from SIGKILL to the connection's close, to the detach's timestamp and
    durable row, and from the close to the durable row (the daemon's own share)."""
    daemon = start_daemon(
        directory,
        "detach",
        num_layers=LAYERS,
        num_physical_experts=PHYSICAL,
        num_logical_experts=LOGICAL,
    )
    times: dict[str, list[float]] = {name: [] for name in DETACH_MEASURES}
    reader = sqlite3.connect(f"file:{daemon.ledger_path}?mode=ro", uri=True, isolation_level=None)
    try:
        with stand_ins(daemon.socket_path, [f"other-{n}" for n in range(others)]):
            for n in range(kills):
                victim = EngineStandIn.start(daemon.socket_path, f"victim-{n}")
                if not victim.attach_reply.ok:
                    raise RuntimeError(f"victim attach failed: {victim.attach_reply}")
                killed_at = time.time()
                os.kill(victim.pid, signal.SIGKILL)
                # The kernel closes all of the victim's descriptors in one step of its exit:
                # its command pipe's EOF here marks the moment its attach connection closed.
                if not wait([victim.commands], timeout=10):
                    raise RuntimeError(f"{victim.engine_id} did not exit within 10 s")
                closed_at = time.time()
                row = _poll_detach(reader, victim.engine_id)
                durable_at = time.time()
                stamped_at = datetime.datetime.fromisoformat(row).timestamp()
                times[KILL_TO_CLOSE].append((closed_at - killed_at) * 1000)
                times[CLOSE_TO_DURABLE].append((durable_at - closed_at) * 1000)
                times[KILL_TO_STAMP].append((stamped_at - killed_at) * 1000)
                times[KILL_TO_DURABLE].append((durable_at - killed_at) * 1000)
                victim.kill()  # reap
            layout = client.query(daemon.socket_path).layout
            if layout is None or len(layout.attached) != others:
                raise RuntimeError(f"the {others} other engines did not stay attached: {layout}")
    finally:
        reader.close()
        daemon.stop()
    return times


def _poll_detach(reader: sqlite3.Connection, engine_id: str) -> str:
    """Wait until the engine's detach event is committed; its ``at`` timestamp."""
    deadline = time.monotonic() + 10
    while True:
        row = reader.execute(
            "SELECT at FROM events WHERE kind = 'detach' AND engine_id = ?", (engine_id,)
        ).fetchone()
        if row is not None:
            return str(row[0])
        if time.monotonic() > deadline:
            raise RuntimeError(f"no detach of {engine_id} within 10 s")
        time.sleep(POLL_INTERVAL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="measured round trips per record")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--kills", type=int, default=120, help="SIGKILLed engines (>= 100)")
    parser.add_argument("--others", type=int, default=32, help="engines attached meanwhile")
    parser.add_argument(
        "--directory", help="where daemons keep sockets and ledgers (default: temp)"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-daemon-") as scratch:
        directory = Path(args.directory or scratch)
        print(
            f"expert layout daemon benchmark: sglang's WeightCacheDaemon (model-less), "
            f"{os.cpu_count()} CPUs, ledger in {directory}",
            flush=True,
        )
        times = bench_round_trips(directory, args.rounds, args.warmup)
        detach = bench_detach(directory, args.kills, args.others)

    names = list(times)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians[names[0]] / medians[names[1]]
    ratio_ok = ratio <= RATIO_TARGET
    print()
    print(
        f"begin+commit of one all-layer chunk ({len(MOE_LAYERS)} MoE layers of a {LAYERS} x "
        f"{PHYSICAL} map, {LOGICAL} logical experts), {args.rounds} rounds each, alternating"
    )
    print(f"  {'record':<26} {'median ms':>10} {'p90 ms':>8} {'p99 ms':>8}")
    for name, values in times.items():
        print(
            f"  {name:<26} {medians[name]:>10.2f} {percentile(values, 90):>8.2f} "
            f"{percentile(values, 99):>8.2f}"
        )
    print(
        f"  ratio ledger / in-memory (medians): {ratio:.2f}x   "
        f"target <= {RATIO_TARGET:.0f}x: {'met' if ratio_ok else 'MISSED'}; "
        f"goal <= {RATIO_GOAL}x: {'met' if ratio <= RATIO_GOAL else 'not met'}"
    )
    p99 = percentile(detach[KILL_TO_DURABLE], 99)
    detach_ok = p99 < DETACH_P99_TARGET_MS
    print()
    print(f"SIGKILL -> detach recorded, {args.kills} kills, {args.others} other engines attached")
    print(f"  {'interval':<42} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for label, values in detach.items():
        print(
            f"  {label:<42} {statistics.median(values):>10.2f} "
            f"{percentile(values, 99):>8.2f} {max(values):>8.2f}"
        )
    print(
        f"  p99 kill -> detach durable {p99:.2f} ms   target < {DETACH_P99_TARGET_MS:.0f} ms: "
        f"{'met' if detach_ok else 'MISSED'}"
    )
    return 0 if ratio_ok and detach_ok else 1


if __name__ == "__main__":
    sys.exit(main())
