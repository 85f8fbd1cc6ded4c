"""The demo's model, its shape and how many rebalances each case runs."""

from __future__ import annotations

from dataclasses import dataclass

from layout_ledger.core.layout import Map, trivial_map

# The models the demo runs on (scripts/demo.py runs each in turn), with their checkpoints' dtype.
# Both BF16 checkpoints, loaded in float32 (``DemoConfig.model_dtype``, lossless): the engines'
# greedy tokens are then compared exactly. (FP8 blocks, whose matmuls need triton, compute no
# token on a CPU; the suite moves and judges them, tests/test_model_daemons.py.)
MODELS = {"qwen3_moe": "bf16", "deepseek_v3": "bf16"}
MODEL_NAMES = {
    "qwen3_moe": "Qwen3-MoE, float32 (BF16 checkpoint)",
    "deepseek_v3": "DeepSeek-V3, float32 (BF16 checkpoint)",
}


@dataclass(frozen=True)
class DemoConfig:
    """The model, its shape and how many rebalances each case runs.

    ``model`` names the architecture of the model-backed daemons (a checkpoint written for the
    run, ``MODELS``); None runs the synthetic stand-in (model-less daemons and expert bytes that
    carry their id: what the suite's reduced demo uses, for its time). ``num_layers`` counts
    the MoE layers; DeepSeek-V3's first layer is dense, before them.
    """

    model: str | None = None
    num_layers: int = 8
    num_logical_experts: int = 8
    num_redundant_experts: int = 4  # 2 per EP rank
    ep_size: int = 2
    layers_per_chunk: int = 4  # 8 layers -> 2 chunks (2 versions) per rebalance
    case1_rebalances: int = 10
    case2_rebalances: tuple[int, int, int] = (3, 3, 3)  # alone, with the standby, after it
    case3_rebalances_before_kill: int = 2
    case6_rebalances: int = 2
    case7b_rebalances: int = 1  # before the one A is killed in, between its ranks' commits
    load_seed: int = 11
    model_dtype: str = "float32"  # sglang's --dtype of the model-backed daemons and engines

    @property
    def first_moe_layer(self) -> int:
        return 1 if self.model == "deepseek_v3" else 0

    @property
    def num_hidden_layers(self) -> int:
        """The rows of a map: every layer of the model, dense ones included."""
        return self.first_moe_layer + self.num_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(range(self.first_moe_layer, self.num_hidden_layers))

    @property
    def dtype(self) -> str:
        return MODELS[self.model] if self.model is not None else "synthetic"

    @property
    def name(self) -> str:
        return MODEL_NAMES[self.model] if self.model is not None else "synthetic stand-in"

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
        """sglang's initial (trivial) layout: a row for every layer of the model."""
        return trivial_map(
            self.num_hidden_layers, self.num_physical_slots, self.num_logical_experts
        )

    def moe_rows(self, the_map: Map) -> Map:
        """The rows of the MoE layers (the slots that hold routed experts)."""
        return the_map[self.first_moe_layer :]

    def describe(self) -> str:
        per_rank_slots = self.num_physical_slots // self.ep_size
        per_rank_redundant = self.num_redundant_experts // self.ep_size
        dense = f" after {self.first_moe_layer} dense layer" if self.first_moe_layer else ""
        return (
            f"{self.name}: {self.num_layers} MoE layers{dense} x {self.num_physical_slots} "
            "physical slots "
            f"({self.num_logical_experts} logical experts + {self.num_redundant_experts} "
            f"redundant), EP {self.ep_size} ({self.ep_size} gloo ranks, {per_rank_slots} slots "
            f"and {per_rank_redundant} redundant per rank), {self.layers_per_chunk} layers per "
            f"chunk ({self.chunks_per_rebalance} chunks = {self.chunks_per_rebalance} versions "
            "per rebalance)"
        )
