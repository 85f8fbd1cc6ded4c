"""Shared-memory experts: every slot's bytes name their expert, and every mapper sees a move."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from layout_ledger.core.layout import trivial_map
from sglang_integration.testing.shared_experts import (
    HOLDS_NO_EXPERT,
    ExpertTensorShape,
    SharedExpertsError,
    attach_shared_experts,
    count_matching_slots,
    create_shared_experts,
    read_physical_to_logical_map,
    remove_shared_experts,
)

SHAPE = ExpertTensorShape(num_layers=8, num_logical_experts=8, num_physical_slots=12, ep_size=2)


def _rotated_map(shape: ExpertTensorShape, by: int) -> list[list[int]]:
    return [
        [
            (slot + by + layer) % shape.num_logical_experts
            for slot in range(shape.num_physical_slots)
        ]
        for layer in range(shape.num_layers)
    ]


@pytest.fixture
def expert_dir(tmp_path: Path) -> Path:
    return tmp_path / "experts"


def test_each_slot_reads_back_the_expert_the_creating_map_put_there(
    expert_dir: Path,
) -> None:
    layout = _rotated_map(SHAPE, by=3)
    for rank in range(SHAPE.ep_size):
        experts = create_shared_experts(expert_dir, rank, SHAPE, layout)
        assert experts.count_matching_slots(layout) == SHAPE.num_layers * SHAPE.num_local_slots
        assert experts.slot_logical_ids()[5] == layout[5][rank * 6 : rank * 6 + 6]
    assert read_physical_to_logical_map(expert_dir) == layout
    trivial = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    held = read_physical_to_logical_map(expert_dir)
    assert count_matching_slots(held, trivial) < SHAPE.num_layers * SHAPE.num_physical_slots


def test_a_slot_holding_parts_of_two_experts_reads_as_no_expert(
    expert_dir: Path,
) -> None:
    layout = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    experts = create_shared_experts(expert_dir, 0, SHAPE, layout)
    # Move only the second tensor (w2) of layer 2 slot 1 from slot 4: a half-moved expert.
    experts.tensors[1][2, 1] = experts.tensors[1][2, 4]
    # An expert's bytes in the wrong layer are not that layer's expert either.
    experts.tensors[0][3, 0] = experts.tensors[0][4, 0]
    experts.tensors[1][3, 0] = experts.tensors[1][4, 0]
    held = experts.slot_logical_ids()
    assert held[2][1] == HOLDS_NO_EXPERT
    assert held[3][0] == HOLDS_NO_EXPERT
    assert held[2][0] == layout[2][0]
    expected_matches = SHAPE.num_layers * SHAPE.num_local_slots - 2
    assert experts.count_matching_slots(layout) == expected_matches


def _move_in_child(directory: str, rank: int, ready, go, done) -> None:  # type: ignore[no-untyped-def]
    experts = attach_shared_experts(directory, rank)
    ready.set()
    go.wait(30)
    # Swap slots 0 and 5 of layer 7 in place, as the updater would.
    for tensor in experts.tensors:
        first = tensor[7, 0].clone()
        tensor[7, 0] = tensor[7, 5]
        tensor[7, 5] = first
    done.set()


def test_an_in_place_move_by_another_process_is_seen_through_an_existing_mapping(
    expert_dir: Path,
) -> None:
    layout = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    mine = create_shared_experts(expert_dir, 1, SHAPE, layout)
    before = mine.slot_logical_ids()[7]
    context = multiprocessing.get_context("spawn")
    ready, go, done = context.Event(), context.Event(), context.Event()
    child = context.Process(target=_move_in_child, args=(str(expert_dir), 1, ready, go, done))
    child.start()
    try:
        assert ready.wait(60)
        go.set()
        assert done.wait(60)
    finally:
        child.join(60)
    assert child.exitcode == 0
    after = mine.slot_logical_ids()[7]
    assert after == [before[5], *before[1:5], before[0]]


def test_recreating_a_rank_gives_new_memory_and_old_mappings_keep_their_bytes(
    expert_dir: Path,
) -> None:
    old_layout = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    old = create_shared_experts(expert_dir, 0, SHAPE, old_layout)
    new_layout = _rotated_map(SHAPE, by=1)
    create_shared_experts(expert_dir, 0, SHAPE, new_layout)
    assert old.count_matching_slots(old_layout) == SHAPE.num_layers * SHAPE.num_local_slots
    fresh = attach_shared_experts(expert_dir, 0)
    assert fresh.count_matching_slots(new_layout) == SHAPE.num_layers * SHAPE.num_local_slots


def test_attach_refuses_missing_or_short_files(expert_dir: Path) -> None:
    with pytest.raises(SharedExpertsError, match="create the shared experts first"):
        attach_shared_experts(expert_dir, 0)
    layout = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    create_shared_experts(expert_dir, 0, SHAPE, layout)
    data = expert_dir / "rank0.experts"
    os.truncate(data, data.stat().st_size - 4)
    with pytest.raises(SharedExpertsError, match="missing or not"):
        attach_shared_experts(expert_dir, 0)
    assert data.stat().st_size % 4 == 0  # attach did not grow the file back


def test_a_map_of_the_wrong_shape_is_refused(expert_dir: Path) -> None:
    short = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots - 2, SHAPE.num_logical_experts)
    with pytest.raises(SharedExpertsError, match="8 x 12"):
        create_shared_experts(expert_dir, 0, SHAPE, short)


def test_the_slot_views_the_updater_gets_write_through_to_shared_memory(
    expert_dir: Path,
) -> None:
    layout = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    experts = create_shared_experts(expert_dir, 0, SHAPE, layout)
    weights = experts.routed_experts_weights_of_layer()
    assert sorted(weights) == list(range(SHAPE.num_layers))
    assert [tuple(t.shape) for t in weights[0]] == [(6, 8), (6, 4)]
    weights[4][0][2].copy_(weights[4][0][3])
    weights[4][1][2].copy_(weights[4][1][3])
    assert attach_shared_experts(expert_dir, 0).slot_logical_ids()[4][2] == layout[4][3]


def test_remove_deletes_every_rank_file(expert_dir: Path) -> None:
    layout = trivial_map(SHAPE.num_layers, SHAPE.num_physical_slots, SHAPE.num_logical_experts)
    for rank in range(SHAPE.ep_size):
        create_shared_experts(expert_dir, rank, SHAPE, layout)
    remove_shared_experts(expert_dir, SHAPE.ep_size)
    assert list(expert_dir.iterdir()) == []
