#!/usr/bin/env python3
"""Warm standby benchmark: a standby's first forward pass after the active engine moved on.

With 2 and 4 real engine ranks (sglang's world group on gloo, one process each) started as a
standby (``SGLANG_EXPERT_LAYOUT_ROLE=standby``) through the plugin's startup, and one model-less
daemon per rank (a real ledger each), at DeepSeek-V3's map geometry as sglang 0.5.23 builds it
(``get_model_config_for_expert_location`` counts ``num_hidden_layers``: 61 layers; 256 routed
experts + 32 redundant: 288 physical slots), prints, measured in one run:

  (a) per round: the standby releases its lease on every rank, an active engine (a separate
      engine id, attached to every daemon) commits 100 versions (4 random layers each, on every
      daemon), then the standby's first forward pass goes through the plugin's gate
      (``engine.standby``: the lease on every rank, the all-gather of the grants, the daemons'
      maps read and agreed on, ``ExpertLocationMetadata`` updated in place for the layers that
      changed); the time of a round is the slowest rank's. Beside it, sglang's own
      ``ExpertLocationMetadata.init_by_mapping`` of the same map on the same ranks. Target: the
      lease path at most 50 ms median at EP 4.
  (b) the per-forward cost of a held lease (the gate's flag check around a forward that does
      nothing) beside a forward hook that does nothing.

    .venv/bin/python scripts/bench_standby.py [--rounds 20] [--ep 2 4] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import types
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

NUM_LAYERS, NUM_LOGICAL, NUM_REDUNDANT = 61, 256, 32
NUM_SLOTS = NUM_LOGICAL + NUM_REDUNDANT
VERSIONS_PER_ROUND = 100
LAYERS_PER_VERSION = 4
TARGET_MS = 50.0


@dataclass(frozen=True)
class RankJob:
    rank: int
    world: int
    port: int
    model_dir: str
    sockets: list[str]
    rounds: int
    calls: int


def _row(rng: random.Random) -> list[int]:
    row = list(range(NUM_LOGICAL)) + [rng.randrange(NUM_LOGICAL) for _ in range(NUM_REDUNDANT)]
    rng.shuffle(row)
    return row


def _move(sockets: list[str], versions: list[int], rng: random.Random) -> None:
    """The active engine commits ``VERSIONS_PER_ROUND`` versions on every daemon."""
    from sglang_integration.engine import client

    for _ in range(VERSIONS_PER_ROUND):
        layers = sorted(rng.sample(range(NUM_LAYERS), LAYERS_PER_VERSION))
        rows = {layer: _row(rng) for layer in layers}
        for index, socket_path in enumerate(sockets):
            if not client.begin(socket_path, "active-a", versions[index], layers).ok:
                raise RuntimeError(f"the active engine's begin failed on {socket_path}")
        for index, socket_path in enumerate(sockets):
            committed = client.commit(socket_path, "active-a", rows)
            if not committed.ok:
                raise RuntimeError(f"the active engine's commit failed: {committed.reason}")
            versions[index] = committed.body["version"]


def _rank(job: RankJob, out: Connection) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_parallel

    from sglang_integration.engine import client, standby
    from sglang_integration.engine import startup as engine_startup
    from sglang_integration.engine.metadata import map_of, metadata_from_map

    rank, world, sockets = job.rank, job.world, job.sockets
    os.environ["SGLANG_EXPERT_LAYOUT_ROLE"] = "standby"
    os.environ["SGLANG_EXPERT_LAYOUT_STANDBY_IDLE"] = "3600"
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
    metadata = get_global_expert_location_metadata()
    world_group = get_parallel().world_group
    engine_startup.start_from_daemon_layout(
        model_config=model_config, metadata=metadata, moe_ep_rank=rank, socket_path=sockets[rank]
    )
    gate = standby.current_gate()
    if gate is None:
        raise RuntimeError("the standby started without its gate")
    mover = None
    versions: list[int] = []
    if rank == 0:
        mover = [client.attach(path, "active-a") for path in sockets]
        versions = [attachment.reply.layout.version for attachment in mover]
    rng = random.Random(5)
    runner = types.SimpleNamespace(is_draft_worker=False, eplb_manager=None)
    first: dict[str, list[float]] = {"cold": [], "prepared": []}
    inits, changed, hits = [], [], 0
    for _ in range(job.rounds):
        for kind in ("cold", "prepared"):
            gate.release_if_idle(now=float("inf"))
            world_group.barrier()
            if rank == 0:
                _move(sockets, versions, rng)
            world_group.barrier()
            if kind == "prepared":
                # The standby idles a moment after the active engine's last commit (a failover
                # takes longer): its follow thread builds the newest map's metadata meanwhile.
                time.sleep(2 * standby.FOLLOW_INTERVAL + 1.0)
                world_group.barrier()
                layout = client.query(sockets[rank]).layout
                prepared = gate.prepared
                hits += int(
                    prepared is not None and layout is not None and prepared[0] == layout.version
                )
            before = map_of(metadata)
            profile = None
            if os.environ.get("BENCH_STANDBY_PROFILE") and rank == 0 and kind == "prepared":
                import cProfile

                profile = cProfile.Profile()
                profile.enable()
            started = time.perf_counter()
            standby.around_forward(lambda runner: None, runner)
            first[kind].append(time.perf_counter() - started)
            if profile is not None:
                import pstats

                profile.disable()
                pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
            after = map_of(metadata)
            changed.append(sum(1 for a, b in zip(before, after, strict=True) if a != b))
        world_group.barrier()
        started = time.perf_counter()
        metadata_from_map(model_config, after, rank)
        inits.append(time.perf_counter() - started)
    # (b) a held lease, per forward, beside a hook that does nothing.
    world_group.barrier()

    def plain(original: Any, runner: Any) -> Any:
        return original(runner)

    def nothing(runner: Any) -> None:
        return None

    timings = {}
    for name, hook in (("do-nothing hook", plain), ("held lease", standby.around_forward)):
        started = time.perf_counter()
        for _ in range(job.calls):
            hook(nothing, runner)
        timings[name] = (time.perf_counter() - started) / job.calls
    out.send(
        {
            "rank": rank,
            "first": first,
            "hits": hits,
            "inits": inits,
            "changed": changed,
            "hooks": timings,
            "collective": gate.acquisitions,
        }
    )


def run(ep: int, rounds: int, calls: int, workdir: Path) -> dict[str, Any]:
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
        port = free_port()
        results = one_result_per_rank(
            ep,
            _rank,
            lambda rank: (RankJob(rank, ep, port, str(model_dir), sockets, rounds, calls),),
        )
    finally:
        for daemon in daemons:
            daemon.stop()
    return {
        "first": {
            kind: [max(v) for v in zip(*(r["first"][kind] for r in results), strict=True)]
            for kind in ("cold", "prepared")
        },
        "hits": sum(r["hits"] for r in results),
        "ranks": len(results),
        "inits": [max(v) for v in zip(*(r["inits"] for r in results), strict=True)],
        "changed": results[0]["changed"],
        "hooks": {
            name: statistics.median(r["hooks"][name] for r in results)
            for name in results[0]["hooks"]
        },
        "collective": results[0]["collective"],
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def report(measured: dict[int, dict[str, Any]], rounds: int, calls: int) -> str:
    lines = [
        f"Warm standby, {NUM_LAYERS} MoE layers x {NUM_SLOTS} slots ({NUM_LOGICAL} experts + "
        f"{NUM_REDUNDANT} redundant), gloo ranks on {os.cpu_count()} CPUs, {rounds} rounds of "
        f"{VERSIONS_PER_ROUND} versions",
        "",
        "(a) the first forward pass after the active engine moved 100 versions (slowest rank):",
        "    cold: right after its last commit; prepared: 3 s later (the follow thread built the",
        "    newest map's metadata meanwhile)",
        f"    {'EP':>3s} {'':>9s} {'lease path median':>18s} {'p90':>10s}   "
        f"{'init_by_mapping median':>22s}   {'ratio':>6s}   layers changed",
    ]
    for ep, result in measured.items():
        init = statistics.median(result["inits"])
        for kind in ("cold", "prepared"):
            first = sorted(result["first"][kind])
            median = statistics.median(first)
            lines.append(
                f"    {ep:3d} {kind:>9s} {ms(median):>18s} {ms(_pct(first, 0.9)):>10s}   "
                f"{ms(init):>22s}   {median / init:6.2f}   "
                f"{statistics.median(result['changed']):.0f} of {NUM_LAYERS}"
            )
        lines.append(
            f"        prepared in time on {result['hits']} of "
            f"{result['ranks'] * len(result['first']['prepared'])} rank-rounds"
        )
    if 4 in measured:
        for kind in ("prepared", "cold"):
            median = statistics.median(measured[4]["first"][kind]) * 1e3
            verdict = "met" if median <= TARGET_MS else "not met"
            lines.append(
                f"    EP 4 {kind} median {median:.2f} ms   target <= {TARGET_MS:.0f} ms: {verdict}"
            )
    lines += ["", f"(b) per forward pass, {calls} calls (median over ranks)"]
    for ep, result in measured.items():
        hooks = result["hooks"]
        plain, held = hooks["do-nothing hook"], hooks["held lease"]
        lines.append(
            f"    EP {ep}: held lease {held * 1e9:.0f} ns, do-nothing hook {plain * 1e9:.0f} ns, "
            f"extra {(held - plain) * 1e9:.0f} ns"
        )
    return "\n".join(lines)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 20000 calls")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 20_000
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    with tempfile.TemporaryDirectory() as tmp:
        measured = {ep: run(ep, args.rounds, args.calls, Path(tmp)) for ep in args.ep}
    print(report(measured, args.rounds, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
