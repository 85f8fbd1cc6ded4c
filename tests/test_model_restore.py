"""Model-backed daemons restarted: sglang's loader puts the checkpoint into the restored layout.

One group of two model-backed daemons (sglang's own ``WeightCacheDaemon`` building a tiny
Qwen3-MoE from its checkpoint and loading it with sglang's loader, the ranks in one gloo group:
``sglang_integration.testing.daemons``) commits a move, stops, and starts again on the same
ledgers: inside ``_initialize_eplb_expert_location_metadata`` both daemons agree over sglang's
world group and install the restored map before the loader runs, so every slot holds the
checkpoint expert the restored map names (judged byte for byte against the checkpoint), both
start at the committed version with its digest, and each slot was checked against its ledger.
A start with ``--expert-layout-restore initial`` loads sglang's initial layout at version 0.
Then the checkpoint's files are replaced by another checkpoint of the same geometry (``checkpoint
write --seed 8`` where the group loaded ``--seed 7``: fine-tuned weights deployed in place): the
restarted group keeps the placement and starts clean at the restored version, with a
``checkpoint_changed`` event, every slot right against the new weights, and a restart on the same
files comes up the same (issue 40). The module starts the group five times, one after the other.
"""

from __future__ import annotations

import sqlite3
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
    # Each restart on the new checkpoint's files (seed 8): each rank's layout, its events, how
    # many of its slots hold the new checkpoint's expert its map names.
    changed: list[list[dict[str, Any]]]
    changed_events: list[list[list[tuple[str, str]]]]
    changed_judged: list[int]


def _deploy_other_weights(checkpoint: Path, seed: int) -> None:
    """Another checkpoint of the same geometry (``checkpoint write --seed``) replaces the files
    in place, each by a rename (a new file, as a deploy writes it): the config and the index
    are the same bytes, every weight differs."""
    fresh = write_checkpoint(
        checkpoint.parent / f"seed{seed}",
        CheckpointSpec(model="qwen3_moe", dtype="bf16", seed=seed),
    )
    for name in ("config.json", "model.safetensors.index.json"):
        assert (fresh / name).read_bytes() == (checkpoint / name).read_bytes()
    for shard in sorted(fresh.glob("*.safetensors")):
        shard.replace(checkpoint / shard.name)


def _events(run: Path, rank: int) -> list[tuple[str, str]]:
    """(kind, reason) of the latest incarnation's events, in order."""
    with sqlite3.connect(f"file:{run / f'rank{rank}.sqlite'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT kind, coalesce(reason, '') FROM events WHERE incarnation_id = "
            "(SELECT max(incarnation_id) FROM incarnations) ORDER BY event_id"
        ).fetchall()
    return [(str(kind), str(reason)) for kind, reason in rows]


def _identities(run: Path, rank: int) -> list[str]:
    with sqlite3.connect(f"file:{run / f'rank{rank}.sqlite'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT checkpoint_digest FROM incarnations ORDER BY incarnation_id"
        ).fetchall()
    return [str(identity) for (identity,) in rows]


def _judged(group: ModelDaemonGroup, checkpoint: Path, layouts: list[dict[str, Any]]) -> int:
    """Slots of both ranks holding, byte for byte, the checkpoint expert their map names."""
    experts = CheckpointExperts(checkpoint)
    judged = 0
    for rank in range(RANKS):
        routed = attach_routed_weights(group.socket(rank))
        held = experts.judge_routed(
            routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
        )
        judged += count_matching(held, layouts[rank]["physical_to_logical_map"], rank * LOCAL)
    return judged


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
        root / "checkpoint", CheckpointSpec(model="qwen3_moe", dtype="bf16", seed=7)
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
        judged = _judged(second, checkpoint, restored)
        logs = [second.log(rank) for rank in range(RANKS)]
    finally:
        assert second.stop() == [0, 0]

    third = _start(checkpoint, run, "--expert-layout-restore", "initial")
    try:
        initial = _layouts(third)
        _move_by_hand(third)
    finally:
        assert third.stop() == [0, 0]

    _deploy_other_weights(checkpoint, seed=8)
    changed, changed_events, changed_judged = [], [], []
    for _ in range(2):  # the restart on the new weights, then a plain restart on them
        again = _start(checkpoint, run)
        try:
            layouts = _layouts(again)
            changed.append(layouts)
            changed_events.append([_events(run, rank) for rank in range(RANKS)])
            changed_judged.append(_judged(again, checkpoint, layouts))
        finally:
            assert again.stop() == [0, 0]
    yield Starts(
        checkpoint,
        run,
        restored,
        judged,
        initial,
        logs,
        changed,
        changed_events,
        changed_judged,
    )


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


def test_a_restart_on_new_weights_of_the_same_geometry_keeps_the_placement_and_starts_clean(
    starts: Starts,
) -> None:
    """Seed 7 committed version 1 (incarnation 3); restarted on seed 8, the group restores
    version 1 with its digest, loads seed 8 into it and is clean: every slot holds seed 8's
    expert the map names, and a ``checkpoint_changed`` event names both identities."""
    digest = layout_digest(MOVED)
    layouts, events = starts.changed[0], starts.changed_events[0]
    for rank in range(RANKS):
        layout = layouts[rank]
        assert (layout["version"], layout["digest"], layout["dirty"]) == (1, digest, False)
        assert layout["restored_from"] == {"incarnation": 3, "version": 1, "digest": digest}
        old, new = _identities(starts.run, rank)[2:4]
        assert old != new
        assert [kind for kind, _ in events[rank]] == ["start", "restore", "checkpoint_changed"]
        assert events[rank][2][1] == (
            f"the checkpoint changed: identity {old} (incarnation 3) -> {new}; the restored "
            f"layout keeps its version and digest, its load becomes that checkpoint's baseline"
        )
    assert starts.changed_judged[0] == NUM_LAYERS * SLOTS


def test_every_restart_on_the_same_new_weights_gives_the_same_clean_verdict(
    starts: Starts,
) -> None:
    """The next restart on seed 8 is judged against the seed-8 load before it: clean, every
    slot right, no checkpoint change."""
    digest = layout_digest(MOVED)
    for rank in range(RANKS):
        layout = starts.changed[1][rank]
        assert layout["dirty"] == starts.changed[0][rank]["dirty"]  # the same verdict
        assert (layout["version"], layout["digest"], layout["dirty"]) == (1, digest, False)
        assert [kind for kind, _ in starts.changed_events[1][rank]] == ["start", "restore"]
        assert len(set(_identities(starts.run, rank)[3:5])) == 1
    assert starts.changed_judged[1] == NUM_LAYERS * SLOTS
