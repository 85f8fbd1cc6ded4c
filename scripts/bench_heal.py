#!/usr/bin/env python3
"""Benchmark: a dirty daemon's heal beside a full daemon restart of the same checkpoint.

    .venv/bin/python scripts/bench_heal.py [--model qwen3_moe|deepseek_v3] [--heals N]
        [--layers K]

Prints, from one run, side by side:

(a) one group of model-backed daemons (2 EP ranks, sglang's own ``WeightCacheDaemon`` loading
    the tiny checkpoint with sglang's loader; every ``get_tensor`` of the checkpoint counted in
    each daemon, ``bench_restore.counting_daemon``): ``--heals`` rounds of an engine SIGKILLed
    mid-move with ``--layers`` pending layers (their slots half-written and zero-filled on rank
    0), each daemon healing itself: the heal's own seconds and bytes read (its ``heal`` event:
    the reader's count, index included), and the wall time from the kill to both daemons clean;
    per pending layer;
(b) the same group stopped and started again on the same ledgers (the restart a heal replaces):
    seconds from the stop to every daemon serving, and the checkpoint bytes each daemon's load
    read; the ratios of (b) to (a);
(c) DeepSeek-V3 on paper from its config (61 layers, 256 experts of 3 x 7168 x 2048 FP8 weights
    with 128 x 128 block scales, EP 16 and 32 redundant experts: 18 local slots; a restart reads
    the whole checkpoint): the bytes a heal reads per pending layer beside a restart's.

Host memory: the reloader holds one layer's local experts at a time (it reads, loads and drops
each layer before the next), so the most it holds is the bytes of (a)'s one-layer heal minus the
index, printed as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

RANKS, REDUNDANT = 2, 4
# DeepSeek-V3 (its config.json): routed experts of hidden 7168 x moe_intermediate 2048, three
# projections each, FP8 (1 byte) with one float32 scale per 128 x 128 block; 58 MoE layers.
DSV3_HIDDEN, DSV3_MOE_INTER, DSV3_BLOCK, DSV3_MOE_LAYERS = 7168, 2048, 128, 58
DSV3_CHECKPOINT_BYTES = 689 * 10**9  # the released FP8 checkpoint's safetensors, about 690 GB
DSV3_INDEX_BYTES = 9 * 10**6  # its model.safetensors.index.json, about 9 MB
DSV3_EP, DSV3_SLOTS = 16, 288


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", choices=("qwen3_moe", "deepseek_v3"), default="qwen3_moe")
    parser.add_argument("--heals", type=int, default=5, help="heal rounds of (a)")
    parser.add_argument("--layers", type=int, default=1, help="pending layers of each round")
    return parser.parse_args(argv)


def _events(ledger: str, kind: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT reason FROM events WHERE kind = ? ORDER BY event_id", (kind,)
        ).fetchall()
    return [str(reason) for (reason,) in rows]


def _layout(socket_path: str) -> dict[str, Any]:
    from sglang_integration.testing.daemon_control import request

    layout: dict[str, Any] = request(socket_path, {"type": "expert_layout_query"})["layout"]
    return layout


def _spoil(socket_path: str, layers: list[int]) -> None:
    """What a move killed halfway leaves: the first local slot of each pending layer
    half-written from the second, the third zero-filled."""
    from sglang_integration.testing.routed_weights import attach_routed_weights

    routed = attach_routed_weights(socket_path).routed_experts_weights_of_layer
    for layer in layers:
        for tensor in routed[layer]:
            half = tensor.shape[1] // 2
            tensor[0][:half].copy_(tensor[1][:half])
            tensor[2].zero_()


_HEAL_REASON = re.compile(r"(\d+) layers \[.*\], (\d+) slots, ([\d,]+) bytes read, ([\d.]+) s")


def heal_round(group: Any, layers: list[int]) -> tuple[float, list[tuple[int, int, float]]]:
    """One engine killed mid-move; returns the wall seconds from the kill to every daemon
    clean, and each daemon's heal (slots, bytes read, seconds) from its ``heal`` event."""
    from sglang_integration.testing.daemon_control import EngineStandIn

    before = [len(_events(group.ledger(rank), "heal")) for rank in range(RANKS)]
    engines = [EngineStandIn.start(group.socket(rank), "bench-a") for rank in range(RANKS)]
    version = _layout(group.socket(0))["version"]
    for engine in engines:
        if not engine.begin(version, layers).ok:
            raise RuntimeError("the benchmark's begin was refused")
    _spoil(group.socket(0), layers)
    started = time.monotonic()
    for engine in engines:
        engine.kill()
    while any(_layout(group.socket(rank))["dirty"] for rank in range(RANKS)) or any(
        len(_events(group.ledger(rank), "heal")) == before[rank] for rank in range(RANKS)
    ):
        if time.monotonic() - started > 120:
            raise RuntimeError("the daemons did not heal within 120 s")
        time.sleep(0.01)
    wall = time.monotonic() - started
    heals = []
    for rank in range(RANKS):
        match = _HEAL_REASON.match(_events(group.ledger(rank), "heal")[-1])
        if match is None:
            raise RuntimeError("a heal event without its figures")
        heals.append((int(match[2]), int(match[3].replace(",", "")), float(match[4])))
    return wall, heals


def _reads(group: Any) -> list[dict[str, Any]]:
    return [
        json.loads(Path(group.spec.path(rank, ".reads.json")).read_text()) for rank in range(RANKS)
    ]


def deepseek_on_paper() -> dict[str, float]:
    """A heal's bytes per pending layer at EP 16 with 32 redundant experts, beside a restart's."""
    weights = 3 * DSV3_HIDDEN * DSV3_MOE_INTER
    scales = 3 * (DSV3_HIDDEN // DSV3_BLOCK) * (DSV3_MOE_INTER // DSV3_BLOCK) * 4
    local = DSV3_SLOTS // DSV3_EP
    per_layer = local * (weights + scales)
    heal = per_layer + DSV3_INDEX_BYTES
    return {
        "expert_bytes": weights + scales,
        "local_slots": local,
        "per_layer": per_layer,
        "heal": heal,
        "restart": DSV3_CHECKPOINT_BYTES,
        "ratio": DSV3_CHECKPOINT_BYTES / heal,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    from bench_restore import counting_daemon
    from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
    from sglang_integration.testing.daemon_control import process_context
    from sglang_integration.testing.daemons import launch, spec_with_flags
    from sglang_integration.testing.model_daemon import flags_of

    dtype = "fp8_block" if args.model == "deepseek_v3" else "bf16"
    scratch = Path(tempfile.mkdtemp(prefix="bench-heal-"))
    process_context()
    checkpoint = write_checkpoint(scratch / "checkpoint", CheckpointSpec(args.model, dtype, 3))
    spec = spec_with_flags(
        scratch / "run",
        checkpoint,
        flags_of([]),
        ep_size=RANKS,
        num_redundant_experts=REDUNDANT,
        model=args.model,
    )
    group = launch(spec, target=counting_daemon)
    moe_layers = sorted(
        int(layer) for layer in json.loads(Path(spec.path(0, ".routed.json")).read_text())["layers"]
    )
    layers = moe_layers[: args.layers]
    walls, heals = [], []
    try:
        for _ in range(args.heals):
            wall, healed = heal_round(group, layers)
            walls.append(wall)
            heals.extend(healed)
        stopped = time.monotonic()
        if group.stop() != [0] * RANKS:
            raise RuntimeError("the group did not stop cleanly")
        load_reads = _reads(group)
        group = launch(spec, target=counting_daemon)
        restart = time.monotonic() - stopped
    finally:
        group.stop()
    restart_reads = _reads(group)

    per_layer = len(layers)
    heal_seconds = statistics.median(seconds for _, _, seconds in heals)
    heal_bytes = statistics.median(read for _, read, _ in heals)
    wall = statistics.median(walls)
    restart_bytes = max(read["tensor_bytes"] for read in restart_reads)
    index_bytes = (checkpoint / "model.safetensors.index.json").stat().st_size
    print(
        f"(a) heal, {args.model} {dtype}, {RANKS} EP ranks, {len(layers)} pending layer(s) "
        f"{layers}, {args.heals} rounds (CPU, 2 shared cores)"
    )
    print(
        f"  heal inside the daemon: {1000 * heal_seconds:.1f} ms median "
        f"({1000 * heal_seconds / per_layer:.1f} ms per pending layer); kill -> both daemons "
        f"clean: {1000 * wall:.0f} ms median"
    )
    print(
        f"  bytes read per daemon: {heal_bytes:,.0f} ({(heal_bytes - index_bytes) / per_layer:,.0f}"
        f" per pending layer + the index's {index_bytes:,}); slots per daemon: {heals[0][0]}"
    )
    print(
        f"  host memory held at once: one layer's local experts, "
        f"{(heal_bytes - index_bytes) / per_layer:,.0f} bytes"
    )
    print("(b) a full restart of the same group on the same ledgers")
    print(
        f"  stop -> every daemon serving: {restart:.2f} s; checkpoint bytes read per daemon "
        f"(its load): {restart_bytes:,} (first start: "
        f"{max(read['tensor_bytes'] for read in load_reads):,})"
    )
    print(
        f"  ratios: restart / heal time {restart / heal_seconds:,.0f}x (in-daemon), "
        f"{restart / wall:,.1f}x (kill -> clean); restart / heal bytes "
        f"{restart_bytes / heal_bytes:,.1f}x"
    )
    paper = deepseek_on_paper()
    print("(c) DeepSeek-V3 on paper (config.json; EP 16, 32 redundant experts)")
    print(
        f"  one expert {paper['expert_bytes']:,.0f} B (FP8 + block scales), "
        f"{paper['local_slots']:.0f} local slots: {paper['per_layer'] / 1e9:.2f} GB per pending "
        f"layer + index {DSV3_INDEX_BYTES / 1e6:.0f} MB = {paper['heal'] / 1e9:.2f} GB; restart "
        f"reads {paper['restart'] / 1e9:.0f} GB: {paper['ratio']:,.0f}x fewer bytes (target >= "
        f"500x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
