#!/usr/bin/env python3
"""Where the hook's time goes on the pass at which a chunk moves (a development aid).

Runs ``bench_engine``'s rank (real gloo ranks, real daemons, sglang's ``EPLBManager``, the
plugin's real hook) at one layer per chunk and times, with ``time.perf_counter_ns``, each piece
the hook runs on the move pass, on the main thread; prints the medians per piece (rank 0).

    .venv/bin/python scripts/profile_move_pass.py [--ep 2] [--rounds 2] [--cprofile]

A development aid, not a benchmark: the wrappers add a few microseconds to each piece.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import bench_engine

PIECES: dict[str, list[int]] = {}
PROFILE = {"on": False, "stats": None}


def _timed(owner: Any, name: str, label: str) -> None:
    record = PIECES.setdefault(label, []).append
    bench_engine.time_calls(owner, name, record, clock=time.perf_counter_ns)


def _drive(
    steps: Iterator[None], clock: Any, pass_seconds: float, world: Any
) -> tuple[list[float], int, list[float]]:
    """bench_engine._drive, with each move pass's time (and its cProfile) kept."""
    chunks: list[float] = []
    current = 0.0
    passes = 0
    work: list[float] = []
    while True:
        spent, moves = clock.spent, clock.moves
        plugin = steps.gi_code.co_name == "rebalance_around"  # type: ignore[attr-defined]
        profile = cProfile.Profile() if PROFILE["on"] and plugin else None
        started = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            next(steps)
            ended = False
        except StopIteration:
            ended = True
        if profile is not None:
            profile.disable()
        this_pass = (time.perf_counter() - started) - (clock.spent - spent)
        current += this_pass
        passes += 1
        if not plugin:
            pass
        elif clock.moves != moves:
            PIECES.setdefault("whole move pass (minus sglang)", []).append(int(this_pass * 1e9))
            if profile is not None:
                if PROFILE["stats"] is None:
                    PROFILE["stats"] = pstats.Stats(profile)
                else:
                    PROFILE["stats"].add(profile)
            chunks.append(current)
            current = 0.0
        else:
            PIECES.setdefault("other pass", []).append(int(this_pass * 1e9))
        if ended:
            break
        time.sleep(pass_seconds)
        work.append(bench_engine._python_work())
        world.barrier()
    if chunks:
        chunks[-1] += current
    return chunks, passes, work


def _rank(job: Any, cprofile: bool, out: Connection) -> None:
    from sglang_integration.engine import rebalance, rebalance_agent

    PROFILE["on"] = cprofile
    bench_engine._drive = _drive
    for name in ("_use_commit_check", "_move_experts"):
        _timed(rebalance, name, name)
    _timed(rebalance, "CommitJob", "CommitJob()")
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    _timed(ExpertLocationMetadata, "update", "sglang's move (metadata.update)")
    _timed(rebalance_agent.RebalanceAgent, "submit", "agent.submit")
    _timed(rebalance_agent.RebalanceAgent, "result", "agent.result")

    class Relay:
        def send(self, value: Any) -> None:
            value["pieces"] = {k: statistics.median(v) / 1e3 for k, v in PIECES.items()}
            value["counts"] = {k: len(v) for k, v in PIECES.items()}
            if PROFILE["stats"] is not None:
                text = io.StringIO()
                PROFILE["stats"].stream = text
                PROFILE["stats"].sort_stats("tottime").print_stats(25)
                value["cprofile"] = text.getvalue()
            out.send(value)

    bench_engine._rank(job, Relay())  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    from sglang_integration.testing.cpu_engine import (
        free_port,
        one_result_per_rank,
        write_tiny_moe_config,
    )
    from sglang_integration.testing.daemon_control import start_daemon
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = write_tiny_moe_config(
            workdir / "model", bench_engine.NUM_LAYERS, bench_engine.NUM_LOGICAL
        )
        daemons = [
            start_daemon(
                workdir / "d",
                f"daemon{rank}",
                num_layers=bench_engine.NUM_LAYERS,
                num_logical_experts=bench_engine.NUM_LOGICAL,
                num_physical_experts=bench_engine.NUM_SLOTS,
            )
            for rank in range(args.ep)
        ]
        try:
            sockets = [d.socket_path for d in daemons]
            bench_engine._move_daemons(sockets)
            time.sleep(0.5)
            port = free_port()
            results = one_result_per_rank(
                args.ep,
                _rank,
                lambda rank: (
                    bench_engine.RankJob(
                        rank, args.ep, port, str(model_dir), sockets, args.rounds, 1, 0.005
                    ),
                    args.cprofile,
                ),
            )
        finally:
            for daemon in daemons:
                daemon.stop()
    for result in results:
        print(f"rank {result['rank']}: blocked {result['blocked']}, median us per piece:")
        for name, value in result["pieces"].items():
            print(f"    {name:34s} {value:9.1f}  (n={result['counts'][name]})")
    if "cprofile" in results[0]:
        print(results[0]["cprofile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
