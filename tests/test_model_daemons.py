"""Model-backed daemons: sglang's own daemon loads a real checkpoint into the slots its map names.

Per model (a tiny Qwen3-MoE in BF16, a tiny DeepSeek-V3 in FP8 blocks), one group of two
model-backed daemons (``sglang_integration.testing.daemons``: sglang's ``WeightCacheDaemon``
builds the model class from the checkpoint's ``config.json`` and loads its safetensors shards
with sglang's loader, on two gloo ranks; the GPU stand-ins are ``testing.gpu_stand_ins``) is
started once for the module, from an initial map (``--init-expert-location``) with a second
replica of an expert on each rank. What every engine on a daemon maps (its shared routed-expert
file) is judged against the checkpoint (``testing.checkpoint_experts``):

- each checkpoint expert lies in exactly the slots the daemon's map names, and in no other;
- the daemon's record starts at version 0 with that map and one fingerprint per local slot.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.checkpoint_experts import CheckpointExperts, slots_holding
from sglang_integration.testing.daemon_control import request
from sglang_integration.testing.daemons import ModelDaemonGroup, start_model_daemons
from sglang_integration.testing.routed_weights import attach_routed_weights

pytestmark = pytest.mark.timeout(300)

NUM_EXPERTS, NUM_REDUNDANT, NUM_LAYERS = 8, 4, 3
LOCAL = (NUM_EXPERTS + NUM_REDUNDANT) // 2
# Per layer, 6 slots on each rank; rank 0 holds one expert twice, rank 1 another.
INITIAL = [
    [0, 1, 2, 3, 4, 0, 5, 6, 7, 5, 1, 2],
    [7, 6, 5, 4, 3, 3, 2, 1, 0, 2, 6, 4],
    [1, 3, 5, 7, 0, 5, 2, 4, 6, 6, 0, 1],
]
MODELS = {"qwen3_moe": "bf16", "deepseek_v3": "fp8_block"}


@dataclass
class Started:
    model: str
    checkpoint: Path
    group: ModelDaemonGroup


@pytest.fixture(scope="module", params=sorted(MODELS))
def started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Started]:
    model = str(request.param)
    root = tmp_path_factory.mktemp(model)
    checkpoint = write_checkpoint(
        root / "checkpoint", CheckpointSpec(model=model, dtype=MODELS[model], seed=7)
    )
    group = start_model_daemons(
        root / "run",
        checkpoint,
        ep_size=2,
        num_redundant_experts=NUM_REDUNDANT,
        model=model,
        daemon_args=["--init-expert-location", json.dumps({"physical_to_logical_map": INITIAL})],
    )
    try:
        yield Started(model, checkpoint, group)
    finally:
        group.stop()


def test_each_checkpoint_expert_lands_in_exactly_the_slots_the_daemons_map_names(
    started: Started,
) -> None:
    experts = CheckpointExperts(started.checkpoint)
    held: dict[tuple[int, int], set[int]] = {}
    for rank in range(2):
        routed = attach_routed_weights(started.group.socket(rank))
        assert routed.first_slot == rank * LOCAL
        judged = experts.judge_routed(
            routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
        )
        for key, slots in slots_holding(judged, routed.first_slot).items():
            held.setdefault(key, set()).update(slots)
    moe_layers = sorted({layer for layer, _ in held})
    assert moe_layers == ([0, 1, 2] if started.model == "qwen3_moe" else [1, 2])
    named = {
        (layer, expert): {slot for slot, e in enumerate(INITIAL[layer]) if e == expert}
        for layer in moe_layers
        for expert in range(NUM_EXPERTS)
    }
    assert held == named


def test_the_daemon_records_the_loaded_map_at_version_0_with_one_fingerprint_per_slot(
    started: Started,
) -> None:
    for rank in range(2):
        layout = request(started.group.socket(rank), {"type": "expert_layout_query"})["layout"]
        assert (layout["version"], layout["dirty"]) == (0, False)
        assert layout["physical_to_logical_map"] == INITIAL
        reply = request(started.group.socket(rank), {"type": "expert_layout_content_check"})
        assert reply["status"] == "ok", reply
        content = reply["content"]
        assert (content["first_slot"], content["dirty"]) == (rank * LOCAL, False)
        assert sorted(content["recorded"]) == (
            [0, 1, 2] if started.model == "qwen3_moe" else [1, 2]
        )
        assert all(len(values) == LOCAL for values in content["recorded"].values())
        assert content["current"] == content["recorded"]
