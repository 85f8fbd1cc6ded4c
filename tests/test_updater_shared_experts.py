"""sglang's real ExpertLocationUpdater moves shared-memory experts between 2 gloo processes.

Two engine ranks (real ``ServerArgs`` + ``publish`` on the CPU, a tiny Qwen3-MoE ``config.json``
without weights, sglang's real world group on gloo) move their shared-memory experts from the
daemon's initial layout to layouts that sglang's real ``ExpertLocationMetadata.init_by_eplb``
computes from skewed synthetic loads, once plainly and once with
``SGLANG_EXPERT_LOCATION_UPDATER_CANARY=1``. A third process that mapped the same memory before
the moves, and never imports sglang, must see every slot hold the expert the final map names.

The helpers at the top (``write_tiny_moe_config``, ``engine_process_context``,
``start_cpu_engine_rank``, ``free_port``) are also used by tests/test_rebalance_*.py.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.layout import trivial_map
from sglang_integration.testing.shared_experts import (
    ExpertTensorShape,
    attach_shared_experts,
    count_matching_slots,
    create_shared_experts,
)

NUM_LAYERS = 8
NUM_LOGICAL = 8
NUM_REDUNDANT = 4
EP_SIZE = 2
SHAPE = ExpertTensorShape(
    num_layers=NUM_LAYERS,
    num_logical_experts=NUM_LOGICAL,
    num_physical_slots=NUM_LOGICAL + NUM_REDUNDANT,
    ep_size=EP_SIZE,
)
SGLANG_QUIET_ENV = {
    "SGLANG_DISABLED_MODEL_ARCHS": "falcon_mamba,inkling,mamba,midashenglm",
    "GLOO_SOCKET_IFNAME": "lo",
}


def write_tiny_moe_config(directory: Path, num_layers: int, num_experts: int) -> Path:
    """A Qwen3-MoE ``config.json`` (no weights): enough for ServerArgs, ModelConfig and EPLB."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 16,
        "intermediate_size": 32,
        "moe_intermediate_size": 8,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_experts": num_experts,
        "num_experts_per_tok": 2,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def engine_process_context() -> Any:
    """Engine rank processes fork from the forkserver that has imported sglang once
    (``sglang_context`` of tests/test_engine_startup_hook.py): each still publishes its own
    config, and nothing of sglang runs in the pytest process."""
    from test_engine_startup_hook import sglang_context

    return sglang_context()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_cpu_engine_rank(
    rank: int,
    *,
    world_size: int,
    port: int,
    model_dir: str,
    num_redundant: int,
    **server_args: Any,
) -> Any:
    """In a fresh process: publish real ServerArgs for this rank, build sglang's world group on
    gloo, and install the initial (trivial) expert location metadata. Returns the ModelConfig."""
    os.environ.update(SGLANG_QUIET_ENV)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=world_size,
        ep_size=world_size,
        enable_eplb=True,
        ep_num_redundant_experts=num_redundant,
        skip_tokenizer_init=True,
        **server_args,
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    init_distributed_environment(
        backend="gloo",
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
    )
    model_config = ModelConfig.from_server_args(args)
    metadata = ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=rank)
    set_global_expert_location_metadata(metadata)
    return model_config


def _engine_rank(rank: int, port: int, model_dir: str, expert_dir: str, results: Any) -> None:
    import torch
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
    )
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    from sglang_integration.testing.shared_experts import SharedExpertsModel
    from sglang_integration.testing.synthetic_load import skewed_logical_count

    model_config = start_cpu_engine_rank(
        rank, world_size=EP_SIZE, port=port, model_dir=model_dir, num_redundant=NUM_REDUNDANT
    )
    initial = get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
    model = SharedExpertsModel(attach_shared_experts(expert_dir, rank))
    updater = ExpertLocationUpdater()
    local_slots = NUM_LAYERS * SHAPE.num_local_slots
    report: dict[str, Any] = {"rank": rank, "initial": initial, "matches": []}
    for step, canary in enumerate((False, True)):
        if canary:
            os.environ["SGLANG_EXPERT_LOCATION_UPDATER_CANARY"] = "1"
        load = skewed_logical_count(NUM_LAYERS, NUM_LOGICAL, seed=7, step=step)
        target = ExpertLocationMetadata.init_by_eplb(model_config, load)
        missing = updater.update(
            model.routed_experts_weights_of_layer,
            target,
            update_layer_ids=list(range(NUM_LAYERS)),
            nnodes=1,
            rank=rank,
        )
        routed = get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
        report["matches"].append((missing, model.experts.count_matching_slots(routed), local_slots))
    report["final"] = routed
    torch.distributed.barrier()
    results.put(report)


def _observer(expert_dir: str, ready: Any, go: Any, results: Any) -> None:
    """Maps both ranks' experts before the move; reads them after. Never imports sglang."""
    mappings = [attach_shared_experts(expert_dir, rank) for rank in range(EP_SIZE)]
    ready.set()
    go.wait(300)
    per_rank = [experts.slot_logical_ids() for experts in mappings]
    results.put(
        {"observed": [per_rank[0][layer] + per_rank[1][layer] for layer in range(NUM_LAYERS)]}
    )


@pytest.mark.timeout(240)
def test_real_updater_moves_shared_memory_experts_and_a_third_process_sees_the_new_layout(
    tmp_path: Path,
) -> None:
    model_dir = write_tiny_moe_config(tmp_path / "model", NUM_LAYERS, NUM_LOGICAL)
    expert_dir = tmp_path / "experts"
    initial = trivial_map(NUM_LAYERS, SHAPE.num_physical_slots, NUM_LOGICAL)
    for rank in range(EP_SIZE):
        create_shared_experts(expert_dir, rank, SHAPE, initial)

    context = engine_process_context()
    results = context.Queue()
    ready, go = context.Event(), context.Event()
    observer = context.Process(target=_observer, args=(str(expert_dir), ready, go, results))
    observer.start()
    assert ready.wait(60)
    port = free_port()
    ranks = [
        context.Process(
            target=_engine_rank, args=(rank, port, str(model_dir), str(expert_dir), results)
        )
        for rank in range(EP_SIZE)
    ]
    for process in ranks:
        process.start()
    try:
        reports = sorted((results.get(timeout=200) for _ in ranks), key=lambda r: r["rank"])
        go.set()
        observed = results.get(timeout=60)["observed"]
    finally:
        go.set()
        for process in [*ranks, observer]:
            process.join(60)
            if process.exitcode is None:
                process.kill()
    assert [process.exitcode for process in [*ranks, observer]] == [0, 0, 0]

    # The daemon's initial layout is sglang's trivial layout.
    assert reports[0]["initial"] == initial
    for report in reports:
        for missing, matching, local_slots in report["matches"]:
            assert missing == {}
            assert matching == local_slots
    final = reports[0]["final"]
    assert reports[1]["final"] == final
    all_slots = NUM_LAYERS * SHAPE.num_physical_slots
    assert count_matching_slots(observed, final) == all_slots
    # The moves were real: most slots now hold another expert than the initial layout's.
    assert count_matching_slots(observed, initial) < all_slots // 2
