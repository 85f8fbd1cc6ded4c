#!/usr/bin/env python3
"""Exporter benchmark: a scrape of 16 week-old ledgers, today's full read beside the cached one.

16 ledgers, each held open by a writer in this process (16 running daemons), each with a week
of one commit a minute (10,080 commits) at the map a DeepSeek-V3 daemon keeps (sglang 0.5.23
counts every hidden layer: 61 layers x 288 physical slots, 256 logical experts; layers 3..60
have routed experts, 0..2 are dense and never move), each commit one chunk of 4 MoE layers,
with the daemon's default retention (keep 1000 versions, prune every 100). One ledger is built
and copied 15 times (each copy's writer resumes its incarnation), so the build takes one
ledger's time.

Measured side by side in one run:
  - one scrape as `metrics` did it before issue 23 and still does without a cache (`-o`, cron):
    every ledger's whole history replayed, the exposition rendered;
  - one scrape of `metrics --serve` now, over HTTP, after every ledger committed once more (a
    scrape interval's worth): what changed is read, the rest is the cache's;
  - 8 scrapes at once: the CPU seconds they cost, each a full read (before), one shared
    collection (now).

  .venv/bin/python scripts/bench_metrics.py [--ledgers 16] [--commits 10080] [--dir DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from deepseek_geometry import DEEPSEEK_V3, DEEPSEEK_V3_MOE_LAYERS
from layout_ledger.cli.commands.metrics import collect_metrics, exposition, serve_metrics
from layout_ledger.core.layout import trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.replay import replay_incarnation
from layout_ledger.store.retention import Retention
from layout_ledger.store.rows import incarnation, row_jsons_at
from sglang_integration.settings import DEFAULT_KEEP_VERSIONS, DEFAULT_PRUNE_EVERY

GEOMETRY = DEEPSEEK_V3
MOE_LAYERS = list(DEEPSEEK_V3_MOE_LAYERS)  # DeepSeek-V3: first_k_dense_replace = 3
CHUNK = 4
ENGINE = "engine-bench"
RETENTION = Retention(keep_versions=DEFAULT_KEEP_VERSIONS, prune_every=DEFAULT_PRUNE_EVERY)
TARGET_SECONDS = 0.5


def _chunk(step: int) -> list[int]:
    start = (step * CHUNK) % len(MOE_LAYERS)
    return sorted(MOE_LAYERS[(start + k) % len(MOE_LAYERS)] for k in range(CHUNK))


def _commit(record: LayoutRecord, rng: random.Random, step: int) -> None:
    layers = _chunk(step)
    record.begin(ENGINE, record.version, layers)
    slots = GEOMETRY.num_physical_slots
    record.commit(ENGINE, {layer: [rng.randrange(256) for _ in range(slots)] for layer in layers})


def build(path: Path, commits: int) -> None:
    ledger = Ledger.open(path, RETENTION)
    initial = trivial_map(
        GEOMETRY.num_layers, GEOMETRY.num_physical_slots, GEOMETRY.num_logical_experts
    )
    record = ledger.start_incarnation(
        GEOMETRY, initial, origin=IncarnationOrigin.of_this_process(device_uuid="GPU-bench")
    )
    record.attach(ENGINE)
    rng = random.Random(0)
    for step in range(commits):
        _commit(record, rng, step)
    ledger.checkpoint(truncate=True)  # the whole history in the file, the WAL empty
    # Its daemon dies without ending the incarnation (a clean end would detach the engine):
    # the copies' writers take it on where it stands.


def _build_in_child(path: Path, commits: int) -> None:
    child = multiprocessing.get_context("fork").Process(target=_build_and_die, args=(path, commits))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building {path} failed (exit {child.exitcode})")


def _build_and_die(path: Path, commits: int) -> None:
    build(path, commits)
    os._exit(0)


def resume(path: Path) -> tuple[Ledger, LayoutRecord]:
    """A writer that takes the ledger's latest incarnation on where it stands (a daemon that
    never stopped); its record appends to the file from here."""
    ledger = Ledger.open(path)
    with ledger.transaction("resuming") as conn:
        inc = incarnation(conn)
        record = replay_incarnation(conn, inc, then=ledger.journal(inc.incarnation_id))
        # A replay knows a pruned history's map by its digest; the daemon that never stopped
        # holds the map itself (the rows of the current version are all held).
        record._row_jsons = row_jsons_at(conn, inc, record.version)
    return ledger, record


def _scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as response:
        return bytes(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledgers", type=int, default=16)
    parser.add_argument("--commits", type=int, default=10_080)
    parser.add_argument("--scrapes", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-metrics-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(
        f"Exporter benchmark: {args.ledgers} ledgers, each {args.commits:,} commits (a week at "
        f"one a minute), {GEOMETRY.num_layers} layers x {GEOMETRY.num_physical_slots} slots, "
        f"{CHUNK} MoE layers a commit, default retention; {os.cpu_count()} CPUs"
    )
    started = time.perf_counter()
    base = scratch / "base.sqlite"
    if not base.exists():
        _build_in_child(base, args.commits)
    paths = []
    for rank in range(args.ledgers):
        path = scratch / f"rank-{rank:02d}.sqlite"
        for suffix in ("", "-wal", "-shm", ".lock"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(base, path)
        if Path(f"{base}-wal").exists():
            shutil.copyfile(f"{base}-wal", f"{path}-wal")
            os.chmod(f"{path}-wal", 0o600)
        os.chmod(path, 0o600)
        paths.append(path)
    writers = [resume(path) for path in paths]
    print(f"  built and opened in {time.perf_counter() - started:.1f} s\n")
    rng = random.Random(1)
    step = [args.commits]

    def commit_everywhere() -> None:
        for _, record in writers:
            _commit(record, rng, step[0])
        step[0] += 1

    try:
        before = []
        for _ in range(3):
            commit_everywhere()
            t0 = time.perf_counter()
            exposition(collect_metrics(paths))
            before.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        server = serve_metrics("127.0.0.1", 0, paths, {})
        first = time.perf_counter() - t0
        try:
            now = []
            for _ in range(args.scrapes):
                commit_everywhere()
                t0 = time.perf_counter()
                body = _scrape(server.url)
                now.append(time.perf_counter() - t0)
            assert b"sglang_expert_layout_version" in body
            commit_everywhere()
            cpu_before = _concurrent_cpu(lambda: exposition(collect_metrics(paths)))
            commit_everywhere()
            cpu_now = _concurrent_cpu(lambda: _scrape(server.url))
        finally:
            server.close()
    finally:
        for ledger, _ in writers:
            ledger.close()
    median_before, median_now = statistics.median(before), statistics.median(now)
    print(f"{'':46}{'before (replay all)':>22}{'now (what changed)':>22}   target")
    print(
        f"  one scrape of {args.ledgers} ledgers, median{'':11}{median_before:>19.3f} s"
        f"{median_now:>20.3f} s   < {TARGET_SECONDS} s: "
        + ("met" if median_now < TARGET_SECONDS else "not met")
    )
    print(f"  the first scrape (before serving){'':13}{'':>21}{first:>20.3f} s")
    print(f"  8 concurrent scrapes, CPU seconds{'':12}{cpu_before:>19.2f} s{cpu_now:>20.2f} s")
    print(
        f"  scrape before / now: {median_before / median_now:.0f}x; "
        f"{len(now)} scrapes now, min {min(now):.3f} s, max {max(now):.3f} s"
    )
    if args.dir is None:
        shutil.rmtree(scratch)


def _concurrent_cpu(scrape: object) -> float:
    """This process's CPU seconds for 8 scrapes started at once."""
    assert callable(scrape)
    cpu = time.process_time()
    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.process_time() - cpu


if __name__ == "__main__":
    main()
