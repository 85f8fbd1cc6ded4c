"""The map a DeepSeek-V3 daemon keeps, defined once for the benchmarks.

sglang 0.5.23 sizes the map from ``ModelConfigForExpertLocation.num_layers``, which
``get_model_config_for_expert_location`` fills with the config's ``num_hidden_layers`` (61 for
DeepSeek-V3), not with the MoE layers: 61 layers x 288 physical slots (256 routed experts and 32
redundant slots, ``--ep-num-redundant-experts 32``), 256 logical experts. Layers 0..2 are dense
(``first_k_dense_replace = 3``): their rows exist in the map but never move; layers 3..60 hold
routed experts, and only they are moved by a rebalance.
"""

from __future__ import annotations

from layout_ledger.core.layout import Geometry

DEEPSEEK_V3 = Geometry(num_layers=61, num_physical_slots=288, num_logical_experts=256)
# The layers that hold routed experts (a rebalance moves only these).
DEEPSEEK_V3_MOE_LAYERS: tuple[int, ...] = tuple(range(3, 61))
# How the benchmarks' text names it.
DEEPSEEK_V3_TEXT = (
    "61 layers x 288 physical slots, 256 logical experts; layers 3-60 hold routed experts"
)
