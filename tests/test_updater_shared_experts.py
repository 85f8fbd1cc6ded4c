"""sglang's real ExpertLocationUpdater moves shared-memory experts between 2 gloo processes.

Two engine ranks (real ``ServerArgs`` + ``publish`` on the CPU, a tiny Qwen3-MoE ``config.json``
without weights, sglang's real world group on gloo) move their shared-memory experts from the
daemon's initial layout to layouts that sglang's real ``ExpertLocationMetadata.init_by_eplb``
computes from skewed synthetic loads, once plainly and once with
``SGLANG_EXPERT_LOCATION_UPDATER_CANARY=1``. A third process that mapped the same memory before
the moves, and never imports sglang, must see every slot hold the expert the final map names.

The helpers at the top (``write_tiny_moe_config``, ``start_cpu_engine_rank``, ``free_port``, from
``sglang_integration.testing.cpu_engine``, and ``engine_process_context``) are also used by
tests/test_rebalance_*.py and tests/test_engine_*.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import trivial_map
from sglang_integration.testing.cpu_engine import (  # re-exported for tests/test_engine_*.py
    free_port,
    start_cpu_engine_rank,
    write_tiny_moe_config,
)
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


def engine_process_context() -> Any:
    """Engine rank processes fork from the forkserver that has imported sglang once
    (``sglang_context`` of tests/test_engine_startup_hook.py): each still publishes its own
    config, and nothing of sglang runs in the pytest process."""
    from test_engine_startup_hook import sglang_context

    return sglang_context()


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
