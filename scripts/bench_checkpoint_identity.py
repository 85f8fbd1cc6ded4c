#!/usr/bin/env python3
"""Benchmark: what the checkpoint's identity costs beside the load it identifies.

    .venv/bin/python scripts/bench_checkpoint_identity.py [--model qwen3_moe|deepseek_v3]
        [--starts N]

Prints, from one run:

(a) the demo's checkpoint (``demo_cases.DemoConfig``: 8 MoE layers of 8 experts, the model's
    dtype), loaded by a group of two model-backed daemons (sglang's own loader) ``--starts``
    times: each start's seconds (launch to every daemon serving) and, beside it, the identity
    (``checkpoint_digest`` and ``structure_digest``, what ``layout_choice`` computes before the
    load) computed in this process on the same files, interleaved with the starts; the ratio
    of their medians;
(b) a directory shaped like DeepSeek-V3's released checkpoint: 163 shards (sparse files of
    689 GB in all, nothing written) with a 9 MB ``model.safetensors.index.json`` naming every
    tensor of 61 layers x 256 experts; the identity's seconds (first computation and warm
    median), beside the load of 689 GB on paper at 2 and 5 GB/s (every daemon's loader reads
    the whole checkpoint).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

DSV3_SHARDS = 163
DSV3_BYTES = 689 * 10**9
DSV3_LAYERS, DSV3_EXPERTS = 61, 256
LOAD_RATES = (2e9, 5e9)  # bytes a second a loader reads a checkpoint at (network, local NVMe)


def _identity(path: Path) -> float:
    from sglang_integration.daemon.checkpoint_identity import checkpoint_digest, structure_digest

    started = time.perf_counter()
    checkpoint_digest(path, dtype="torch.bfloat16")
    structure_digest(path, dtype="torch.bfloat16")
    return time.perf_counter() - started


def demo_size(model: str, starts: int, workdir: Path) -> tuple[list[float], list[float]]:
    from demo_cases.config import DemoConfig
    from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
    from sglang_integration.testing.daemons import start_model_daemons

    config = DemoConfig(model=model)
    checkpoint = write_checkpoint(
        workdir / "checkpoint",
        CheckpointSpec(
            model=model,
            dtype=config.dtype,
            seed=config.load_seed,
            num_layers=config.num_hidden_layers,
            num_experts=config.num_logical_experts,
        ),
    )
    loads, identities = [], []
    for number in range(starts):
        identities.append(_identity(checkpoint))
        started = time.perf_counter()
        group = start_model_daemons(
            workdir / f"run{number}",
            checkpoint,
            ep_size=config.ep_size,
            num_redundant_experts=config.num_redundant_experts,
            model=model,
        )
        loads.append(time.perf_counter() - started)
        group.stop()
        identities.append(_identity(checkpoint))
    return loads, identities


def deepseek_shaped(workdir: Path) -> tuple[float, list[float], int]:
    directory = workdir / "deepseek-v3"
    directory.mkdir()
    shard_bytes = DSV3_BYTES // DSV3_SHARDS
    names = [f"model-{i + 1:05d}-of-{DSV3_SHARDS:06d}.safetensors" for i in range(DSV3_SHARDS)]
    weight_map: dict[str, str] = {}
    tensors = [
        f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{kind}"
        for layer in range(DSV3_LAYERS)
        for expert in range(DSV3_EXPERTS)
        for proj in ("gate_proj", "up_proj", "down_proj")
        for kind in ("weight", "weight_scale_inv")
    ]
    for index, name in enumerate(tensors):
        weight_map[name] = names[index * DSV3_SHARDS // len(tensors)]
    index_text = json.dumps({"metadata": {"total_size": DSV3_BYTES}, "weight_map": weight_map})
    (directory / "model.safetensors.index.json").write_text(index_text)
    (directory / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    for name in names:
        with (directory / name).open("wb") as handle:
            handle.truncate(shard_bytes)  # sparse: stat says its size, nothing is on disk
    first = _identity(directory)
    warm = [_identity(directory) for _ in range(9)]
    return first, warm, len(index_text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", choices=("qwen3_moe", "deepseek_v3"), default="qwen3_moe")
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args(argv)
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    with tempfile.TemporaryDirectory(prefix="bench-identity-") as workdir:
        loads, identities = demo_size(args.model, args.starts, Path(workdir))
        first, warm, index_bytes = deepseek_shaped(Path(workdir))
    load, identity = statistics.median(loads), statistics.median(identities)
    print(f"(a) the demo's checkpoint ({args.model}), {args.starts} group starts:")
    print(f"    group start (launch -> serving), median {load:.2f} s (fastest {min(loads):.2f} s)")
    print(
        f"    identity (checkpoint_digest + structure_digest), median {identity * 1e3:.2f} ms "
        f"(slowest {max(identities) * 1e3:.2f} ms): {identity / load * 100:.3f}% of the start "
        f"(target <= 1%)"
    )
    print(
        f"(b) DeepSeek-V3-shaped: {DSV3_SHARDS} shards of {DSV3_BYTES / 1e9:.0f} GB (sparse), "
        f"index {index_bytes / 1e6:.1f} MB"
    )
    print(
        f"    identity: first {first * 1e3:.1f} ms, warm median {statistics.median(warm) * 1e3:.1f}"
        f" ms"
    )
    for rate in LOAD_RATES:
        seconds = DSV3_BYTES / rate
        print(
            f"    load of {DSV3_BYTES / 1e9:.0f} GB at {rate / 1e9:.0f} GB/s: {seconds:.0f} s; the "
            f"identity is {first / seconds * 100:.4f}% of it (first computation)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
