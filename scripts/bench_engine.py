#!/usr/bin/env python3
"""Engine-side benchmark: what the plugin adds to a rebalance chunk and to an engine's start.

With 2 and 4 real engine ranks (sglang's world group on gloo, one process each) and one
model-less daemon per rank (a real ledger each), at DeepSeek-V3's map geometry (58 MoE layers,
256 routed experts, 32 redundant: 288 physical slots), prints, measured in one run:

  (a) one all-layer chunk through the plugin's rebalance hook (``rebalance._move_chunk``: begin
      on every rank and its all-gather, the device synchronize, commit of the whole map and its
      all-gather, the digest of the engine's whole map, the checks), with sglang's expert move
      itself left out; the time of a round is the slowest rank's. Beside it, sglang's own CPU
      time for ``ExpertLocationMetadata.init_by_eplb`` on the same ranks and the same loads, and
      the chunk as a fraction of the 260 ms of the cheapest peer rebalance we know of (vLLM,
      DeepSeek-V2-Lite, DP 8, H100). Target: under 2.6 ms median at EP 2 (1/100 of it).
  (b) the engine-start path the plugin adds (``engine_startup.start_from_daemon_layout``:
      attach, the wait check, the all-gather, the decision, metadata from the daemon's map) on
      daemons whose layout moved, so every rank builds its metadata from the map.

    .venv/bin/python scripts/bench_engine.py [--rounds 200] [--ep 2 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sglang_integration.testing.cpu_engine import (
    _counters_on_the_cpu,
    _publish_and_join,
    free_port,
    one_result_per_rank,
    write_tiny_moe_config,
)
from sglang_integration.testing.daemon_control import start_daemon

NUM_LAYERS, NUM_LOGICAL, NUM_REDUNDANT = 58, 256, 32
NUM_SLOTS = NUM_LOGICAL + NUM_REDUNDANT
REFERENCE_MS = 260.0


@dataclass(frozen=True)
class RankJob:
    """What one rank process is told: who it is and where its engine and daemon are."""

    rank: int
    world: int
    port: int
    model_dir: str
    sockets: list[str]
    rounds: int


def _rank(job: RankJob, out: Connection) -> None:
    """One engine rank: start through the plugin, then time chunks and sglang's init_by_eplb."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_parallel

    from sglang_integration.engine import rebalance
    from sglang_integration.engine import startup as engine_startup
    from sglang_integration.engine.weight_source import WeightSource, record_weight_source
    from sglang_integration.testing.synthetic_load import skewed_logical_count

    rank, world, sockets, rounds = job.rank, job.world, job.sockets, job.rounds
    stages = _timed_stages(rebalance)
    _counters_on_the_cpu()
    args = _publish_and_join(
        rank,
        world_size=world,
        port=job.port,
        model_dir=job.model_dir,
        num_redundant=NUM_REDUNDANT,
        weight_cache_mode="client",
        weight_cache_socket=sockets[rank],
    )
    model_config = ModelConfig.from_server_args(args)
    set_global_expert_location_metadata(
        ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=rank)
    )
    world_group = get_parallel().world_group
    world_group.barrier()
    started = time.perf_counter()
    engine_startup.start_from_daemon_layout(
        model_config=model_config,
        metadata=get_global_expert_location_metadata(),
        moe_ep_rank=rank,
        socket_path=sockets[rank],
    )
    startup = time.perf_counter() - started
    record_weight_source(WeightSource.DAEMON)
    rebalance._move_experts = lambda *unused: None  # the move itself is sglang's, left out
    state = rebalance.RebalanceState()
    rebalance._decide_mode_once(state)
    chunk = list(range(NUM_LAYERS))
    chunks, plans = [], []
    for step in range(rounds):
        world_group.barrier()
        started = time.perf_counter()
        if not rebalance._move_chunk(None, state, None, chunk):
            raise RuntimeError(f"rank {rank}: the chunk did not commit: {state.stopped_reason}")
        chunks.append(time.perf_counter() - started)
        counts = skewed_logical_count(NUM_LAYERS, NUM_LOGICAL, seed=7, step=step)
        world_group.barrier()
        started = time.perf_counter()
        ExpertLocationMetadata.init_by_eplb(model_config, counts)
        plans.append(time.perf_counter() - started)
    out.send({"rank": rank, "startup": startup, "chunks": chunks, "plans": plans, "stages": stages})


def _timed_stages(rebalance: Any) -> dict[str, list[float]]:
    """Time the parts of a chunk on this rank: wraps the rebalance module's own functions."""
    stages: dict[str, list[float]] = {}

    def timed(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                stages.setdefault(name, []).append(time.perf_counter() - started)

        return wrapper

    names = itertools.cycle(("begin request", "commit request"))
    call = rebalance._call

    def named_call(request: Any) -> Any:  # a chunk's requests alternate: begin, commit
        return timed(next(names), call)(request)

    rebalance._call = named_call
    rebalance._all_gather = timed("all-gathers (2)", rebalance._all_gather)
    rebalance.layout_digest = timed("digest of the map", rebalance.layout_digest)
    rebalance.check_commits = timed("check_commits", rebalance.check_commits)
    rebalance.decide_begin = timed("decide_begin", rebalance.decide_begin)
    return stages


def _moved_map(seed: int) -> list[list[int]]:
    """A valid layout other than the initial one (every expert keeps at least one slot)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(NUM_LAYERS):
        row = list(range(NUM_LOGICAL)) + [rng.randrange(NUM_LOGICAL) for _ in range(NUM_REDUNDANT)]
        rng.shuffle(row)
        rows.append(row)
    return rows


def _move_daemons(sockets: list[str]) -> None:
    """One engine moves every daemon's layout (so a starting engine adopts a map)."""
    from sglang_integration.engine import client

    moved = _moved_map(11)
    for socket_path in sockets:
        attachment = client.attach(socket_path, "mover")
        if not (
            client.begin(socket_path, "mover", 0, list(range(NUM_LAYERS))).ok
            and client.commit(socket_path, "mover", dict(enumerate(moved))).ok
        ):
            raise RuntimeError(f"could not move the layout of {socket_path}")
        attachment.close()


def run(ep: int, rounds: int, workdir: Path) -> dict[str, Any]:
    model_dir = write_tiny_moe_config(workdir / f"model{ep}", NUM_LAYERS, NUM_LOGICAL)
    daemons = [
        start_daemon(
            workdir / f"ep{ep}",
            f"daemon{rank}",
            num_layers=NUM_LAYERS,
            num_logical_experts=NUM_LOGICAL,
            num_physical_experts=NUM_SLOTS,
        )
        for rank in range(ep)
    ]
    sockets = [daemon.socket_path for daemon in daemons]
    try:
        _move_daemons(sockets)
        time.sleep(0.5)  # the mover's detach
        port = free_port()
        results = one_result_per_rank(
            ep, _rank, lambda rank: (RankJob(rank, ep, port, str(model_dir), sockets, rounds),)
        )
    finally:
        for daemon in daemons:
            daemon.stop()
    return {
        "chunks": [max(values) for values in zip(*(r["chunks"] for r in results), strict=False)],
        "plans": [max(values) for values in zip(*(r["plans"] for r in results), strict=False)],
        "startup": [r["startup"] for r in results],
        "stages": {  # rank 0's; the all-gathers' median is per call, and a chunk makes two
            name: statistics.median(values) * (2 if "all-gathers" in name else 1)
            for name, values in results[0]["stages"].items()
        },
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def report(measured: dict[int, dict[str, Any]], rounds: int) -> str:
    lines = [
        f"Engine side, {NUM_LAYERS} MoE layers x {NUM_SLOTS} slots ({NUM_LOGICAL} experts + "
        f"{NUM_REDUNDANT} redundant), gloo ranks on {os.cpu_count()} CPUs, {rounds} rounds",
        "",
        "(a) one all-layer chunk: what the plugin adds (the slowest rank's time per round)",
        f"    {'EP':>3s} {'median':>11s} {'p90':>11s} {'p99':>11s}   {'init_by_eplb median':>20s}"
        f"   {'of 260 ms':>9s}",
    ]
    for ep, result in measured.items():
        chunks, plans = sorted(result["chunks"]), result["plans"]
        median = statistics.median(chunks)
        lines.append(
            f"    {ep:3d} {ms(median):>11s} {ms(_pct(chunks, 0.9)):>11s} "
            f"{ms(_pct(chunks, 0.99)):>11s}   {ms(statistics.median(plans)):>20s}   "
            f"{median * 1e3 / REFERENCE_MS:9.4f}"
        )
    if 2 in measured:
        median = statistics.median(measured[2]["chunks"]) * 1e3
        verdict = "met" if median < REFERENCE_MS / 100 else "not met"
        lines.append(
            f"    EP 2 median {median:.2f} ms   target < {REFERENCE_MS / 100:.1f} ms: {verdict}"
        )
    for ep, result in measured.items():
        parts = ", ".join(f"{name} {ms(value).strip()}" for name, value in result["stages"].items())
        lines.append(f"    EP {ep}, rank 0, medians: {parts}")
    lines += [
        "",
        "(b) engine start: what the plugin adds (per rank; the daemons' layout had moved)",
    ]
    for ep, result in measured.items():
        values = result["startup"]
        lines.append(f"    EP {ep}: slowest rank {ms(max(values))}, fastest {ms(min(values))}")
    return "\n".join(lines)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    with tempfile.TemporaryDirectory() as tmp:
        measured = {ep: run(ep, args.rounds, Path(tmp)) for ep in args.ep}
    print(report(measured, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
