"""Model-backed daemons restarted: sglang's loader puts the checkpoint into the restored layout.

One group of two model-backed daemons (sglang's own ``WeightCacheDaemon`` building a tiny
Qwen3-MoE from its checkpoint and loading it with sglang's loader, the ranks in one gloo group:
``sglang_integration.testing.daemons``) commits a move, stops, and starts again on the same
ledgers: inside ``_initialize_eplb_expert_location_metadata`` both daemons agree over sglang's
world group and install the restored map before the loader runs, so every slot holds the
checkpoint expert the restored map names (judged byte for byte against the checkpoint), both
start at the committed version with its digest, and each slot was checked against its ledger.
A start with ``--expert-layout-restore initial`` loads sglang's initial layout at version 0.
The module starts the group three times, one after the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.checkpoint_experts import CheckpointExperts, count_matching
from sglang_integration.testing.daemon_control import EngineStandIn, request
from sglang_integration.testing.daemons import ModelDaemonGroup, start_model_daemons
from sglang_integration.testing.routed_weights import attach_routed_weights

pytestmark = pytest.mark.timeout(600)

NUM_EXPERTS, NUM_REDUNDANT, NUM_LAYERS, RANKS = 8, 4, 3, 2
SLOTS = NUM_EXPERTS + NUM_REDUNDANT
LOCAL = SLOTS // RANKS
INITIAL = trivial_map(NUM_LAYERS, SLOTS, NUM_EXPERTS)
# The move: layer 1's first two slots (rank 0's) exchange their experts.
MOVED = [list(row) for row in INITIAL]
MOVED[1][0], MOVED[1][1] = INITIAL[1][1], INITIAL[1][0]


@dataclass
class Starts:
    checkpoint: Path
    run: Path
    restored: list[dict[str, Any]]  # each rank's layout after the restart
    judged: int  # slots holding the expert the restored map names, both ranks
    initial: list[dict[str, Any]]  # each rank's layout after a start with `initial`
    logs: list[str]  # the restarted daemons' logs
    changed: list[dict[str, Any]]  # each rank's layout after a restart on changed weights


def _change_one_expert(checkpoint: Path, layer: int, expert: int) -> None:
    """Expert ``expert`` of ``layer`` gets other weights of the same shape, in the same shard:
    the config and the index stay as they were (so does the checkpoint's identity)."""
    from safetensors.torch import load_file, save_file

    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if any(name.startswith(prefix) for name in tensors):
            for name in tensors:
                if name.startswith(prefix):
                    tensors[name] = tensors[name].flip(0).contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})


def _layouts(group: ModelDaemonGroup) -> list[dict[str, Any]]:
    return [request(group.socket(r), {"type": "expert_layout_query"})["layout"] for r in range(2)]


def _move_by_hand(group: ModelDaemonGroup) -> None:
    """What an engine's move does: begin on both daemons, the bytes moved in place on rank 0,
    commit the new row on both (each daemon fingerprints the moved layer at its commit)."""
    engines = [EngineStandIn.start(group.socket(rank), "engine-a") for rank in range(RANKS)]
    try:
        for engine in engines:
            assert engine.begin(0, [1]).ok
        routed = attach_routed_weights(group.socket(0))
        for tensor in routed.routed_experts_weights_of_layer[1]:
            first = tensor[0].clone()
            tensor[0].copy_(tensor[1])
            tensor[1].copy_(first)
        for engine in engines:
            assert engine.commit({1: MOVED[1]}).ok
    finally:
        for engine in engines:
            engine.exit()


def _start(checkpoint: Path, run: Path, *flags: str) -> ModelDaemonGroup:
    return start_model_daemons(
        run,
        checkpoint,
        ep_size=RANKS,
        num_redundant_experts=NUM_REDUNDANT,
        model="qwen3_moe",
        daemon_args=list(flags),
    )


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Starts]:
    root = tmp_path_factory.mktemp("restore")
    checkpoint = write_checkpoint(
        root / "checkpoint", CheckpointSpec(model="qwen3_moe", dtype="bf16", seed=5)
    )
    run = root / "run"
    first = _start(checkpoint, run)
    try:
        assert [layout["version"] for layout in _layouts(first)] == [0, 0]
        _move_by_hand(first)
        assert [layout["version"] for layout in _layouts(first)] == [1, 1]
    finally:
        assert first.stop() == [0, 0]

    second = _start(checkpoint, run)
    try:
        restored = _layouts(second)
        experts = CheckpointExperts(checkpoint)
        judged = 0
        for rank in range(RANKS):
            routed = attach_routed_weights(second.socket(rank))
            held = experts.judge_routed(
                routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
            )
            judged += count_matching(held, restored[rank]["physical_to_logical_map"], rank * LOCAL)
        logs = [second.log(rank) for rank in range(RANKS)]
    finally:
        assert second.stop() == [0, 0]

    third = _start(checkpoint, run, "--expert-layout-restore", "initial")
    try:
        initial = _layouts(third)
        _move_by_hand(third)
    finally:
        assert third.stop() == [0, 0]

    _change_one_expert(checkpoint, layer=2, expert=3)
    fourth = _start(checkpoint, run)
    try:
        changed = _layouts(fourth)
    finally:
        fourth.stop()
    yield Starts(checkpoint, run, restored, judged, initial, logs, changed)


def test_both_daemons_restart_at_the_committed_version_with_its_digest(starts: Starts) -> None:
    digest = layout_digest(MOVED)
    for layout in starts.restored:
        assert (layout["version"], layout["digest"], layout["dirty"]) == (1, digest, False)
        assert layout["physical_to_logical_map"] == MOVED
        assert layout["restored_from"] == {"incarnation": 1, "version": 1, "digest": digest}


def test_sglangs_loader_put_every_checkpoint_expert_where_the_restored_map_names_it(
    starts: Starts,
) -> None:
    assert starts.judged == NUM_LAYERS * SLOTS
    for log in starts.logs:
        assert "loading the weights into the version 1 of incarnation 1 (restored)" in log


def test_a_start_with_restore_initial_loads_the_initial_layout_at_version_0(
    starts: Starts,
) -> None:
    for layout in starts.initial:
        assert (layout["version"], layout["restored_from"]) == (0, None)
        assert layout["physical_to_logical_map"] == INITIAL


def test_verify_is_clean_over_the_restored_incarnation(starts: Starts) -> None:
    for rank in range(RANKS):
        with LedgerReader(starts.run / f"rank{rank}.sqlite") as reader:
            report = collect_verify(reader)
        assert report.first_inconsistency is None


def test_a_slot_whose_bytes_are_not_what_the_ledger_recorded_makes_the_restored_daemon_dirty(
    starts: Starts,
) -> None:
    # layer 2's expert 3 changed in the checkpoint under the same config and index: its slots
    # (3 on rank 0, 11 on rank 1, sglang's trivial layout) are named and both daemons are dirty
    for rank, slot in ((0, 3), (1, 11)):
        layout = starts.changed[rank]
        assert (layout["version"], layout["dirty"]) == (1, True)
        assert layout["restored_from"]["version"] == 1
        reason = layout["dirty_reason"]
        assert reason.startswith("the weights loaded into the restored version 1 of incarnation 3")
        assert f"layer 2: slot {slot} holds unknown content, not expert 3" in reason
