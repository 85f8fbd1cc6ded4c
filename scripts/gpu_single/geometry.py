"""The routed-expert tensors the one-GPU check allocates: shapes, dtypes, bytes, which slots.

Two shapes for stage 1 (CUDA IPC) and one for stage 2 (fingerprints):

- ``small``: the CPU demo's model (8 MoE layers, 12 physical slots, 8 logical experts), every
  slot on this GPU, two bf16 tensors per expert; engine A replays the demo's own commits on it
  (``moves.demo_case1_moves``), so its counts are the demo's.
- ``deepseek-v3-layer``: one MoE layer of DeepSeek-V3 as one GPU of EP 8 holds it: the whole map
  has 288 physical slots (256 routed experts + 32 redundant), this GPU holds the 36 local slots
  of EP rank 0, each expert as sglang's fp8 block-quantized fused-MoE tensors
  (``w13_weight`` [2*2048, 7168] and ``w2_weight`` [7168, 2048] in float8_e4m3fn, their
  ``*_weight_scale_inv`` in float32 per 128x128 block): 44.05 MB per slot, 1.59 GB per layer.
- ``deepseek-v3-all-layers``: the same per-GPU slots for all 58 MoE layers (61 layers, the
  first 3 dense): 91.97 GB.

``scale`` divides the hidden and intermediate sizes (1 = the real model); the CPU path uses a
reduced scale so that it runs in seconds, and the table names the scale it ran at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from layout_ledger.core.layout import Geometry, Map, trivial_map

# DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3).
DSV3_HIDDEN = 7168
DSV3_MOE_INTERMEDIATE = 2048
DSV3_ROUTED_EXPERTS = 256
DSV3_MOE_LAYERS = 58  # num_hidden_layers 61, first_k_dense_replace 3
DSV3_BLOCK = 128  # weight_block_size [128, 128]
# One GPU of EP 8 with 32 redundant experts: 288 physical slots, 36 per GPU.
DSV3_EP_SIZE = 8
DSV3_REDUNDANT = 32

_ITEM_SIZE = {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4}


class GeometryError(ValueError):
    """A shape that the check cannot lay out (bytes per slot not a multiple of 4, ...)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of every expert: its shape per slot and its torch dtype's name."""

    name: str
    slot_shape: tuple[int, ...]
    dtype: str

    @property
    def slot_bytes(self) -> int:
        return math.prod(self.slot_shape) * _ITEM_SIZE[self.dtype]


@dataclass(frozen=True)
class ExpertGeometry:
    """The experts one GPU holds: ``num_local_slots`` slots from ``first_local_slot`` of a map
    with ``num_physical_slots`` slots per layer (the map the daemon records is the whole one)."""

    name: str
    num_layers: int
    num_physical_slots: int
    num_logical_experts: int
    first_local_slot: int
    num_local_slots: int
    tensors: tuple[TensorSpec, ...]
    description: str

    def __post_init__(self) -> None:
        if self.first_local_slot + self.num_local_slots > self.num_physical_slots:
            raise GeometryError(f"{self.name}: the local slots run past the map's slots")
        for spec in self.tensors:
            if spec.slot_bytes % 4 != 0:
                raise GeometryError(f"{self.name}: {spec.name} is not a whole number of words")

    @property
    def local_slots(self) -> range:
        return range(self.first_local_slot, self.first_local_slot + self.num_local_slots)

    @property
    def slot_bytes(self) -> int:
        return sum(spec.slot_bytes for spec in self.tensors)

    @property
    def layer_bytes(self) -> int:
        return self.slot_bytes * self.num_local_slots

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    @property
    def total_local_slots(self) -> int:
        return self.num_layers * self.num_local_slots

    def layout_geometry(self) -> Geometry:
        """The daemon's geometry (the whole map)."""
        return Geometry(
            num_layers=self.num_layers,
            num_physical_slots=self.num_physical_slots,
            num_logical_experts=self.num_logical_experts,
        )

    def initial_map(self) -> Map:
        """sglang's trivial layout (slot i holds expert i mod E), as the daemons start with."""
        return trivial_map(self.num_layers, self.num_physical_slots, self.num_logical_experts)

    def local_rows(self, the_map: Map) -> list[list[int]]:
        """Per layer, the experts ``the_map`` names in this GPU's slots."""
        first, count = self.first_local_slot, self.num_local_slots
        return [list(row[first : first + count]) for row in the_map]


def small_geometry() -> ExpertGeometry:
    return ExpertGeometry(
        name="small",
        num_layers=8,
        num_physical_slots=12,
        num_logical_experts=8,
        first_local_slot=0,
        num_local_slots=12,
        tensors=(
            TensorSpec("w13_weight", (256, 256), "bfloat16"),
            TensorSpec("w2_weight", (256, 128), "bfloat16"),
        ),
        description="the CPU demo's model: 8 layers x 12 slots (8 experts + 4 redundant), "
        "all on this device, bf16 w13 [256, 256] and w2 [256, 128]",
    )


def deepseek_v3_tensors(scale: int = 1) -> tuple[TensorSpec, ...]:
    """sglang's fp8 fused-MoE tensors of one DeepSeek-V3 expert (sizes divided by ``scale``)."""
    hidden = DSV3_HIDDEN // scale
    intermediate = DSV3_MOE_INTERMEDIATE // scale

    def blocks(size: int) -> int:
        return -(-size // DSV3_BLOCK)

    return (
        TensorSpec("w13_weight", (2 * intermediate, hidden), "float8_e4m3fn"),
        TensorSpec("w2_weight", (hidden, intermediate), "float8_e4m3fn"),
        TensorSpec("w13_weight_scale_inv", (blocks(2 * intermediate), blocks(hidden)), "float32"),
        TensorSpec("w2_weight_scale_inv", (blocks(hidden), blocks(intermediate)), "float32"),
    )


def deepseek_v3_geometry(num_layers: int, scale: int = 1, name: str = "") -> ExpertGeometry:
    """``num_layers`` MoE layers of DeepSeek-V3 as EP rank 0 of EP 8 holds them."""
    physical = DSV3_ROUTED_EXPERTS + DSV3_REDUNDANT
    local = physical // DSV3_EP_SIZE
    scaled = "" if scale == 1 else f", sizes / {scale} (reduced)"
    return ExpertGeometry(
        name=name or ("deepseek-v3-layer" if num_layers == 1 else "deepseek-v3-all-layers"),
        num_layers=num_layers,
        num_physical_slots=physical,
        num_logical_experts=DSV3_ROUTED_EXPERTS,
        first_local_slot=0,
        num_local_slots=local,
        tensors=deepseek_v3_tensors(scale),
        description=f"DeepSeek-V3, {num_layers} MoE layer(s) x the {local} local slots of EP "
        f"rank 0 of {DSV3_EP_SIZE} ({physical} physical slots: {DSV3_ROUTED_EXPERTS} experts + "
        f"{DSV3_REDUNDANT} redundant), fp8 w13/w2 + fp32 block scales{scaled}",
    )


def human_bytes(count: float) -> str:
    """Decimal units, as bandwidths are quoted (GB = 1e9 bytes)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"
