"""The demo's model shape and how many rebalances each case runs."""

from __future__ import annotations

from dataclasses import dataclass

from layout_ledger.core.layout import Map, trivial_map


@dataclass(frozen=True)
class DemoConfig:
    """The model shape and how many rebalances each case runs."""

    num_layers: int = 8
    num_logical_experts: int = 8
    num_redundant_experts: int = 4  # 2 per EP rank
    ep_size: int = 2
    layers_per_chunk: int = 4  # 8 layers -> 2 chunks (2 versions) per rebalance
    case1_rebalances: int = 10
    case2_rebalances: tuple[int, int, int] = (3, 3, 3)  # alone, with the standby, after it
    case3_rebalances_before_kill: int = 2
    load_seed: int = 11

    @property
    def num_physical_slots(self) -> int:
        return self.num_logical_experts + self.num_redundant_experts

    @property
    def all_slots(self) -> int:
        return self.num_layers * self.num_physical_slots

    @property
    def chunks_per_rebalance(self) -> int:
        return -(-self.num_layers // self.layers_per_chunk)

    def initial_map(self) -> Map:
        return trivial_map(self.num_layers, self.num_physical_slots, self.num_logical_experts)

    def describe(self) -> str:
        per_rank_slots = self.num_physical_slots // self.ep_size
        per_rank_redundant = self.num_redundant_experts // self.ep_size
        return (
            f"{self.num_layers} MoE layers x {self.num_physical_slots} physical slots "
            f"({self.num_logical_experts} logical experts + {self.num_redundant_experts} "
            f"redundant), EP {self.ep_size} ({self.ep_size} gloo ranks, {per_rank_slots} slots "
            f"and {per_rank_redundant} redundant per rank), {self.layers_per_chunk} layers per "
            f"chunk ({self.chunks_per_rebalance} chunks = {self.chunks_per_rebalance} versions "
            "per rebalance)"
        )
