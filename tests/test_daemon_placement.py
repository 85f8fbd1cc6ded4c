"""Every replica filled: the daemon's metadata lists every slot of each expert, on every backend.

sglang's loader copies a checkpoint expert into the slots the daemon's
``ExpertLocationMetadata.logical_to_all_physical`` lists, on this rank only. Each check runs in a
fresh process per EP rank (forked from the warm forkserver): it publishes real ``ServerArgs``
(EP 2, ``--enable-eplb``, 4 redundant experts, an initial map with a second replica of an expert
on each rank) with the a2a backend under test, runs the daemon's own
``WeightCacheDaemon._initialize_eplb_expert_location_metadata`` (sglang's, then with the plugin's
hook applied) and reads off which local slots the loader would fill. DeepEP cannot be built on a
CPU, so with ``deepep`` this is checked at the metadata, which is what the loader reads; with
``none`` the real load is ``test_model_daemons``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sglang_integration.testing.checkpoint import CheckpointSpec, model_config
from sglang_integration.testing.cpu_engine import free_port, one_result_per_rank

pytestmark = pytest.mark.timeout(180)

NUM_EXPERTS, NUM_REDUNDANT, LOCAL = 8, 4, 6
INITIAL = [
    [0, 1, 2, 3, 4, 0, 5, 6, 7, 5, 1, 2],
    [7, 6, 5, 4, 3, 3, 2, 1, 0, 5, 6, 4],
    [1, 3, 5, 7, 0, 5, 2, 4, 6, 6, 0, 1],
]


def _filled_slots(metadata: Any, rank: int) -> list[list[int]]:
    """Per layer, the local slots sglang's loader fills: those listed for any expert."""
    first = rank * LOCAL
    filled = []
    for layer in range(len(INITIAL)):
        slots = {
            slot
            for expert in range(NUM_EXPERTS)
            for slot in metadata.logical_to_all_physical(layer, expert)
            if first <= slot < first + LOCAL
        }
        filled.append(sorted(slots))
    return filled


def _publish(model_dir: str, rank: int, **extra: Any) -> None:
    """A daemon's real ServerArgs (EP 2, EPLB, 4 redundant experts) published for ``rank``."""
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=2,
        ep_size=2,
        enable_eplb=True,
        ep_num_redundant_experts=NUM_REDUNDANT,
        skip_tokenizer_init=True,
        **extra,
    )
    publish(args, role="weight_cache_daemon", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    initialize_moe_config()


def _rank(model_dir: str, backend: str, port: int, rank: int, channel: Any) -> None:
    import os

    import sglang.srt.platforms as platforms
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment
    from sglang.srt.eplb.expert_location import (
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.platforms.cpu import CpuSRTPlatform
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.weight_cache.daemon import WeightCacheDaemon

    from sglang_integration.daemon.hooks import register_daemon_hooks

    _publish(
        model_dir,
        rank,
        moe_a2a_backend=backend,
        init_expert_location=json.dumps({"physical_to_logical_map": INITIAL}),
    )
    # The daemon's world group (its _init_distributed makes it): with deepep, sglang's default
    # static dispatch reads the rank from it, and the plugin's restore agrees over it.
    init_distributed_environment(
        backend="gloo",
        world_size=2,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
    )
    config = ModelConfig(model_path=model_dir, dtype="auto")
    daemon = WeightCacheDaemon.__new__(WeightCacheDaemon)  # sglang's method reads nothing of self
    daemon._initialize_eplb_expert_location_metadata(config)
    # What the plugin's hook reads of the daemon (WeightCacheDaemon.__init__ sets it): where its
    # ledger is (its GPU's device UUID: sglang's CPU platform's, one ledger directory per rank)
    # and its checkpoint. The ledgers are new: nothing to restore, sglang's initial layout.
    platforms._current_platform = CpuSRTPlatform()
    ledgers = Path(model_dir).parent / f"ledgers-{backend}-{rank}"
    ledgers.mkdir()
    os.environ["SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"] = f"{ledgers}/{{device_uuid}}.sqlite"
    daemon.gpu_id, daemon.model_path, daemon.quantization, daemon.revision = (
        0,
        model_dir,
        None,
        None,
    )
    sglangs = _filled_slots(get_global_expert_location_metadata(), rank)
    set_global_expert_location_metadata(None, allow_overwrite=True)
    register_daemon_hooks()
    HookRegistry.apply_hooks()
    daemon._initialize_eplb_expert_location_metadata(config)
    metadata = get_global_expert_location_metadata()
    channel.send(
        {
            "sglang": sglangs,
            "plugin": _filled_slots(metadata, rank),
            "map": metadata.physical_to_logical_map.tolist(),
        }
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("qwen3-config")
    config = model_config(CheckpointSpec("qwen3_moe"))
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("backend", ["none", "deepep"])
def test_the_daemon_lists_every_replica_so_the_loader_fills_every_local_slot(
    model_dir: str, backend: str
) -> None:
    port = free_port()
    results = one_result_per_rank(2, _rank, lambda rank: (model_dir, backend, port, rank))
    for rank, result in enumerate(results):
        every_slot = [list(range(rank * LOCAL, (rank + 1) * LOCAL)) for _ in INITIAL]
        assert result["map"] == INITIAL  # sglang's initial layout, every replica listed
        assert result["plugin"] == every_slot
        if backend == "none":
            assert result["sglang"] == every_slot  # sglang lists every replica itself here
    if backend == "deepep":
        # sglang's own: each second replica on a rank is left unfilled (layer 0: expert 0's
        # second copy in slot 5, 5's in slot 9; rank 1 holds no expert twice in layer 1).
        assert [result["sglang"] for result in results] == [
            [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]],
            [[6, 7, 8, 10, 11], [6, 7, 8, 9, 10, 11], [6, 7, 8, 10, 11]],
        ]


def test_install_daemon_metadata_places_a_given_map_for_every_replica(model_dir: str) -> None:
    """The function the restore and heal paths call: a given map, every slot listed."""
    results = one_result_per_rank(1, _given_map, lambda rank: (model_dir,))
    assert results == [True]


def _given_map(model_dir: str, channel: Any) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    from sglang_integration.daemon.placement import install_daemon_metadata

    # Dynamic dispatch: static would read the rank from a process group.
    _publish(model_dir, 1, moe_a2a_backend="deepep", ep_dispatch_algorithm="dynamic")
    config = ModelConfig(model_path=model_dir, dtype="auto")
    given = [list(reversed(row)) for row in INITIAL]
    installed = install_daemon_metadata(config, given)
    channel.send(
        installed is get_global_expert_location_metadata()
        and installed.physical_to_logical_map.tolist() == given
        and _filled_slots(installed, 1) == [list(range(LOCAL, 2 * LOCAL))] * len(INITIAL)
    )
