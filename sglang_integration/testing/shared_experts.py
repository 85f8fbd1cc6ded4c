"""Routed-expert weights in shared memory: the CPU stand-in for a daemon's CUDA-IPC-mapped experts.

With the weight cache, an engine's routed-expert tensors are the daemon's tensors, mapped
zero-copy, so an in-place move by one engine changes the bytes under the daemon and under every
other engine on it. On a CPU the same holds for a file under ``/dev/shm`` mapped by several
processes with ``torch.from_file(shared=True)`` (``MAP_SHARED``): this module keeps, per EP rank,
one such file holding that rank's slots of every MoE layer.

Every expert's tensors carry the expert: element 0 of each slot row is the logical id and the
rest is a deterministic function of (layer, logical id, tensor index), so any process can read
which expert a slot holds and whether it holds a whole one (:func:`slot_logical_ids`).

Layout of one rank's files in ``directory``:

- ``rank{R}.experts``: float32; for each tensor index ``t`` (like ``w13_weight`` and
  ``w2_weight``) a block of shape ``(num_layers, num_local_slots, widths[t])``, blocks back to back.
- ``rank{R}.json``: the :class:`ExpertTensorShape`, written last (atomically), so its presence
  means the data file is complete.

Creating a rank's files writes new files and renames them into place: processes that mapped the
old ones keep the old bytes, as engines on a daemon that restarted would (new memory).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_MANAGER = "srt/eplb/eplb_manager.py"
# What of the model sglang's EPLB code reads, which SharedExpertsModel stands in for
# (tests/test_upstream_lines.py checks the lines).
UPSTREAM_LINES = (
    UpstreamLine(
        _MANAGER,
        242,
        "list(self._get_model().routed_experts_weights_of_layer.keys())",
        "EPLBManager reads the layer ids from the model",
    ),
    UpstreamLine(
        _MANAGER,
        312,
        "model.routed_experts_weights_of_layer,",
        "update_expert_location_with_recovery hands the tensors to the updater",
    ),
)

# What slot_logical_ids reports for a slot whose bytes are not one whole expert.
HOLDS_NO_EXPERT = -1

# float32 holds every integer below 2**24 exactly; the id and the pattern stay well below.
_DTYPE = torch.float32
_PATTERN_MODULUS = 997
_SHAPE_FORMAT_VERSION = 1


class SharedExpertsError(Exception):
    """Shared-memory expert files are missing, incomplete, or do not fit the request."""


@dataclass(frozen=True)
class ExpertTensorShape:
    """The shape of the routed experts of one engine (all EP ranks together)."""

    num_layers: int
    num_logical_experts: int
    num_physical_slots: int
    ep_size: int
    widths: tuple[int, ...] = (8, 4)

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_logical_experts, self.ep_size) < 1:
            raise SharedExpertsError(f"every count must be at least 1: {self}")
        if self.num_physical_slots < self.num_logical_experts:
            raise SharedExpertsError(
                f"{self.num_physical_slots} physical slots cannot hold "
                f"{self.num_logical_experts} logical experts"
            )
        if self.num_physical_slots % self.ep_size != 0:
            raise SharedExpertsError(
                f"{self.num_physical_slots} physical slots do not divide by ep_size {self.ep_size}"
            )
        if not self.widths or min(self.widths) < 1:
            raise SharedExpertsError(f"widths must be non-empty and positive: {self.widths}")

    @property
    def num_local_slots(self) -> int:
        return self.num_physical_slots // self.ep_size

    def numel_of_rank(self) -> int:
        return sum(self.num_layers * self.num_local_slots * width for width in self.widths)


def expert_values(layer: int, logical_id: int, tensor_index: int, width: int) -> torch.Tensor:
    """The bytes of logical expert ``logical_id`` of ``layer`` in tensor ``tensor_index``."""
    positions = torch.arange(1, width, dtype=torch.int64)
    pattern = (layer * 1009 + logical_id * 131 + tensor_index * 17 + positions * 7) % (
        _PATTERN_MODULUS
    )
    values = torch.empty(width, dtype=_DTYPE)
    values[0] = float(logical_id)
    values[1:] = pattern.to(_DTYPE) + 0.5
    return values


def _data_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.experts"


def _meta_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.json"


class SharedExperts:
    """One EP rank's routed-expert tensors, mapped read-write from shared memory."""

    def __init__(self, directory: Path, rank: int, shape: ExpertTensorShape) -> None:
        if not 0 <= rank < shape.ep_size:
            raise SharedExpertsError(f"rank {rank} is outside ep_size {shape.ep_size}")
        self.directory = directory
        self.rank = rank
        self.shape = shape
        path = _data_path(directory, rank)
        expected_bytes = shape.numel_of_rank() * _DTYPE.itemsize
        # torch.from_file(shared=True) creates or grows a missing or short file; refuse first.
        if not path.is_file() or path.stat().st_size != expected_bytes:
            raise SharedExpertsError(
                f"{path} is missing or not {expected_bytes} bytes; create it with "
                "create_shared_experts first"
            )
        flat = torch.from_file(str(path), shared=True, size=shape.numel_of_rank(), dtype=_DTYPE)
        self._flat = flat
        self.tensors: list[torch.Tensor] = []
        offset = 0
        for width in shape.widths:
            numel = shape.num_layers * shape.num_local_slots * width
            block = flat[offset : offset + numel].view(
                shape.num_layers, shape.num_local_slots, width
            )
            self.tensors.append(block)
            offset += numel

    def routed_experts_weights_of_layer(self) -> dict[int, list[torch.Tensor]]:
        """Per layer, the tensors sglang's ``ExpertLocationUpdater`` moves (views, no copy)."""
        return {
            layer: [tensor[layer] for tensor in self.tensors]
            for layer in range(self.shape.num_layers)
        }

    def fill(self, physical_to_logical_map: Sequence[Sequence[int]]) -> None:
        """Write into every local slot the expert ``physical_to_logical_map`` names there."""
        _check_map_shape(physical_to_logical_map, self.shape)
        first = self.rank * self.shape.num_local_slots
        for layer, row in enumerate(physical_to_logical_map):
            for local_slot in range(self.shape.num_local_slots):
                logical_id = int(row[first + local_slot])
                for index, (tensor, width) in enumerate(
                    zip(self.tensors, self.shape.widths, strict=True)
                ):
                    tensor[layer, local_slot] = expert_values(layer, logical_id, index, width)

    def slot_logical_ids(self) -> list[list[int]]:
        """Per (layer, local slot), the logical id the bytes hold, or ``HOLDS_NO_EXPERT``."""
        held: list[list[int]] = []
        for layer in range(self.shape.num_layers):
            row: list[int] = []
            for local_slot in range(self.shape.num_local_slots):
                row.append(self._logical_id_at(layer, local_slot))
            held.append(row)
        return held

    def _logical_id_at(self, layer: int, local_slot: int) -> int:
        first = float(self.tensors[0][layer, local_slot, 0])
        logical_id = int(first)
        if logical_id != first or not 0 <= logical_id < self.shape.num_logical_experts:
            return HOLDS_NO_EXPERT
        for index, (tensor, width) in enumerate(zip(self.tensors, self.shape.widths, strict=True)):
            if not torch.equal(
                tensor[layer, local_slot],
                expert_values(layer, logical_id, index, width),
            ):
                return HOLDS_NO_EXPERT
        return logical_id

    @property
    def slot_count(self) -> int:
        """This rank's slots of every layer."""
        return self.shape.num_layers * self.shape.num_local_slots

    def count_matching_slots(self, physical_to_logical_map: Sequence[Sequence[int]]) -> int:
        """How many of this rank's slots hold the expert ``physical_to_logical_map`` names there."""
        _check_map_shape(physical_to_logical_map, self.shape)
        first = self.rank * self.shape.num_local_slots
        expected = [
            [int(x) for x in row[first : first + self.shape.num_local_slots]]
            for row in physical_to_logical_map
        ]
        return count_matching_slots(self.slot_logical_ids(), expected)


def _check_map_shape(
    physical_to_logical_map: Sequence[Sequence[int]], shape: ExpertTensorShape
) -> None:
    rows = len(physical_to_logical_map)
    if rows != shape.num_layers or any(
        len(row) != shape.num_physical_slots for row in physical_to_logical_map
    ):
        raise SharedExpertsError(
            f"map is not {shape.num_layers} x {shape.num_physical_slots} (got {rows} rows)"
        )


def count_matching_slots(
    held: Sequence[Sequence[int]], physical_to_logical_map: Sequence[Sequence[int]]
) -> int:
    """How many slots of ``held`` (as read from the bytes) equal the map's entries."""
    if len(held) != len(physical_to_logical_map) or any(
        len(a) != len(b) for a, b in zip(held, physical_to_logical_map, strict=True)
    ):
        raise SharedExpertsError("held slots and map differ in shape")
    return sum(
        int(a == int(b))
        for held_row, map_row in zip(held, physical_to_logical_map, strict=True)
        for a, b in zip(held_row, map_row, strict=True)
    )


def create_shared_experts(
    directory: str | os.PathLike[str],
    rank: int,
    shape: ExpertTensorShape,
    physical_to_logical_map: Sequence[Sequence[int]],
) -> SharedExperts:
    """Create rank ``rank``'s files holding the experts the map names, and map them.

    The files are written under temporary names and renamed into place, data file first and the
    shape file last, so a reader that finds the shape file finds complete data.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _check_map_shape(physical_to_logical_map, shape)
    if not 0 <= rank < shape.ep_size:
        raise SharedExpertsError(f"rank {rank} is outside ep_size {shape.ep_size}")
    data_path = _data_path(directory, rank)
    meta_path = _meta_path(directory, rank)
    meta_path.unlink(missing_ok=True)
    temp_data = data_path.with_name(data_path.name + f".tmp{os.getpid()}")
    with open(temp_data, "wb") as handle:
        handle.truncate(shape.numel_of_rank() * _DTYPE.itemsize)
    os.chmod(temp_data, 0o600)
    os.replace(temp_data, data_path)
    experts = SharedExperts(directory, rank, shape)
    experts.fill(physical_to_logical_map)
    meta = dict(asdict(shape), widths=list(shape.widths), format_version=_SHAPE_FORMAT_VERSION)
    temp_meta = meta_path.with_name(meta_path.name + f".tmp{os.getpid()}")
    temp_meta.write_text(json.dumps(meta, sort_keys=True))
    os.replace(temp_meta, meta_path)
    logger.info("created shared experts of rank %d in %s", rank, directory)
    return experts


def read_shape(directory: str | os.PathLike[str], rank: int = 0) -> ExpertTensorShape:
    """The shape recorded beside rank ``rank``'s data file."""
    meta_path = _meta_path(Path(directory), rank)
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise SharedExpertsError(
            f"{meta_path} does not exist; create the shared experts first"
        ) from None
    if meta.get("format_version") != _SHAPE_FORMAT_VERSION:
        raise SharedExpertsError(
            f"{meta_path} has format version {meta.get('format_version')!r}, "
            f"this code reads {_SHAPE_FORMAT_VERSION}; recreate the shared experts"
        )
    return ExpertTensorShape(
        num_layers=meta["num_layers"],
        num_logical_experts=meta["num_logical_experts"],
        num_physical_slots=meta["num_physical_slots"],
        ep_size=meta["ep_size"],
        widths=tuple(meta["widths"]),
    )


def attach_shared_experts(directory: str | os.PathLike[str], rank: int) -> SharedExperts:
    """Map rank ``rank``'s existing files read-write (another process's view of the same bytes)."""
    return SharedExperts(Path(directory), rank, read_shape(directory, rank))


def read_physical_to_logical_map(directory: str | os.PathLike[str]) -> list[list[int]]:
    """The whole map the bytes hold (every rank's slots side by side), read from shared memory."""
    shape = read_shape(directory)
    per_rank = [
        attach_shared_experts(directory, rank).slot_logical_ids() for rank in range(shape.ep_size)
    ]
    return [
        [logical_id for rank_rows in per_rank for logical_id in rank_rows[layer]]
        for layer in range(shape.num_layers)
    ]


def remove_shared_experts(directory: str | os.PathLike[str], ep_size: int) -> None:
    """Delete every rank's files (mappings that are still open keep their bytes until unmapped)."""
    directory = Path(directory)
    for rank in range(ep_size):
        _meta_path(directory, rank).unlink(missing_ok=True)
        _data_path(directory, rank).unlink(missing_ok=True)


class SharedExpertsModel(nn.Module):
    """The part of an MoE model that sglang's EPLB code reads: ``routed_experts_weights_of_layer``.

    ``EPLBManager`` reads the layer ids from it and ``update_expert_location_with_recovery``
    hands it to the updater (``UPSTREAM_LINES``).
    """

    def __init__(self, experts: SharedExperts) -> None:
        super().__init__()
        self.experts = experts
        self._routed = experts.routed_experts_weights_of_layer()

    @property
    def routed_experts_weights_of_layer(self) -> dict[int, list[torch.Tensor]]:
        return self._routed
