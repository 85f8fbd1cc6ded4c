"""The hooked ``EPLBManager.rebalance`` in real engines of 2 gloo ranks on shared-memory experts.

Each engine rank is a real process with real ``ServerArgs``/``publish`` on the CPU, sglang's
world group on gloo, sglang's real ``EPLBManager`` (its ``rebalance`` wrapped by this plugin's
AROUND hook through sglang's ``HookRegistry``), sglang's real ``ExpertLocationUpdater`` and
``init_by_eplb``. Two stand-ins, because nothing routes tokens or maps CUDA memory on a CPU:
``SyntheticLoadRecorder`` for the expert distribution recorder, and shared-memory files for the
daemon's CUDA-IPC tensors. The parent process, which never imports sglang, reads the bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_updater_shared_experts import (
    EP_SIZE,
    NUM_LAYERS,
    NUM_LOGICAL,
    NUM_REDUNDANT,
    SHAPE,
    engine_process_context,
    free_port,
    start_cpu_engine_rank,
    write_tiny_moe_config,
)

from layout_ledger.core.layout import trivial_map
from sglang_integration.testing.cpu_engine import (  # routed_map, run_rebalances: re-exported
    NoDiskReload,
    routed_map,
    run_rebalances,
)
from sglang_integration.testing.shared_experts import (
    count_matching_slots,
    create_shared_experts,
    read_physical_to_logical_map,
)

LAYERS_PER_CHUNK = 4  # 8 layers -> 2 chunks per rebalance
ALL_SLOTS = NUM_LAYERS * SHAPE.num_physical_slots


def build_rebalancing_engine(
    rank: int,
    port: int,
    model_dir: str,
    expert_dir: str,
    *,
    daemon_socket: str | None = None,
    **args: Any,
):  # type: ignore[no-untyped-def]
    """In an engine rank process: publish, join the world group, hook, and build EPLBManager.

    With ``daemon_socket``, the rank first runs the startup hook's body on that daemon (attach,
    agree over the world group, adopt its layout), as ``ModelRunner`` does before ``load_model``,
    and records that its weights came from the daemon.
    """
    model_config = start_cpu_engine_rank(
        rank,
        world_size=EP_SIZE,
        port=port,
        model_dir=model_dir,
        num_redundant=NUM_REDUNDANT,
        eplb_rebalance_layers_per_chunk=LAYERS_PER_CHUNK,
        **args,
    )
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_distribution import set_global_expert_distribution_recorder
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_integration.engine.rebalance import HOOK_TARGET, rebalance_around
    from sglang_integration.engine.startup import start_from_daemon_layout
    from sglang_integration.engine.weight_source import WeightSource, record_weight_source
    from sglang_integration.testing.shared_experts import SharedExpertsModel, attach_shared_experts
    from sglang_integration.testing.synthetic_load import SyntheticLoadRecorder

    HookRegistry.register(HOOK_TARGET, rebalance_around, HookType.AROUND)
    HookRegistry.apply_hooks()
    if daemon_socket is not None:
        start_from_daemon_layout(
            model_config=model_config,
            metadata=get_global_expert_location_metadata(),
            moe_ep_rank=rank,
            socket_path=daemon_socket,
        )
        # What the IPC loader hook records after the daemon served fetch_state; the fetch
        # itself maps CUDA IPC handles, so here the experts are mapped from shared memory.
        record_weight_source(WeightSource.DAEMON)
    set_global_expert_distribution_recorder(SyntheticLoadRecorder(NUM_LAYERS, NUM_LOGICAL, seed=11))
    model = SharedExpertsModel(attach_shared_experts(expert_dir, rank))
    updater = ExpertLocationUpdater()
    manager = EPLBManager(
        model_config=model_config,
        get_model=lambda: model,
        get_expert_location_updater=lambda: updater,
        get_expert_backup_client=lambda: None,
        get_weight_updater=NoDiskReload,
    )
    return manager, model


def _original_path_rank(
    rank: int, port: int, model_dir: str, expert_dir: str, case: str, results: Any
) -> None:
    import torch

    from sglang_integration.engine import rebalance
    from sglang_integration.engine.weight_source import WeightSource, record_weight_source

    mode = "off" if case == "weight_cache_off" else "client"
    manager, model = build_rebalancing_engine(
        rank, port, model_dir, expert_dir, weight_cache_mode=mode
    )
    if case == "weights_from_disk":
        # What the IPC loader hook records when the loader fell back to disk (no daemon socket).
        record_weight_source(WeightSource.DISK)
    run_rebalances(manager, 2)
    torch.distributed.barrier()
    results.put(
        {
            "rank": rank,
            "map": routed_map(),
            "matching": model.experts.count_matching_slots(routed_map()),
            "mode": rebalance.rebalance_state(manager).mode,
        }
    )


def start_engine(target: Any, tmp_path: Path, *args: Any) -> tuple[list[Any], Any, Path]:
    """Shared experts at the daemon's initial layout, then the engine's 2 rank processes."""
    model_dir = write_tiny_moe_config(tmp_path / "model", NUM_LAYERS, NUM_LOGICAL)
    expert_dir = tmp_path / "experts"
    initial = trivial_map(NUM_LAYERS, SHAPE.num_physical_slots, NUM_LOGICAL)
    for rank in range(EP_SIZE):
        create_shared_experts(expert_dir, rank, SHAPE, initial)
    context = engine_process_context()
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=target, args=(rank, port, str(model_dir), str(expert_dir), *args, results)
        )
        for rank in range(EP_SIZE)
    ]
    for process in processes:
        process.start()
    return processes, results, expert_dir


def collect(processes: list[Any], results: Any, timeout: float = 200) -> list[dict[str, Any]]:
    try:
        reports = [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(60)
            if process.exitcode is None:
                process.kill()
    assert [process.exitcode for process in processes] == [0] * len(processes)
    return sorted(reports, key=lambda report: report["rank"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["weight_cache_off", "weights_from_disk"])
def test_engine_owned_weights_rebalance_exactly_as_sglang_does(tmp_path: Path, case: str) -> None:
    from sglang_integration.engine.rebalance import Mode

    processes, results, expert_dir = start_engine(_original_path_rank, tmp_path, case)
    reports = collect(processes, results)
    final = reports[0]["map"]
    assert reports[1]["map"] == final
    for report in reports:
        assert report["matching"] == NUM_LAYERS * SHAPE.num_local_slots
    # The weight cache off never reaches the mode decision; weights from disk decide ORIGINAL.
    expected_mode = None if case == "weight_cache_off" else Mode.ORIGINAL
    assert [report["mode"] for report in reports] == [expected_mode] * EP_SIZE
    held = read_physical_to_logical_map(expert_dir)
    assert count_matching_slots(held, final) == ALL_SLOTS
    initial = trivial_map(NUM_LAYERS, SHAPE.num_physical_slots, NUM_LOGICAL)
    assert count_matching_slots(held, initial) < ALL_SLOTS // 2
