"""Deterministic skewed expert loads, in the shape sglang's EPLB code reads them.

On a GPU, ``EPLBManager.rebalance`` reads the load from the expert distribution recorder:
``dump_record(output_mode="object")["logical_count"]``, an int tensor of shape
``(buffer_steps, num_layers, num_logical_experts)`` that is all-reduced, so every rank holds the
same counts, and computes the same new layout with ``ExpertLocationMetadata.init_by_eplb``
(``UPSTREAM_LINES``). On a CPU nothing routes tokens, so :class:`SyntheticLoadRecorder` stands
in for that recorder: it returns :func:`skewed_logical_count` for the next step of a seeded
sequence, the same on every rank without any collective.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from sglang_integration.upstream_lines import UpstreamLine

_MANAGER = "srt/eplb/eplb_manager.py"
# What of sglang's expert distribution recorder SyntheticLoadRecorder stands in for
# (tests/test_upstream_lines.py checks the lines).
UPSTREAM_LINES = (
    UpstreamLine(
        "srt/eplb/expert_distribution.py",
        982,
        "def dump(self, output_mode: _OutputMode):",
        "the recorder's all-reduced counts: the same on every rank",
    ),
    UpstreamLine(
        _MANAGER,
        63,
        "if not get_global_expert_distribution_recorder().recording:",
        "EPLBManager reads recording...",
    ),
    UpstreamLine(
        _MANAGER, 64, "get_global_expert_distribution_recorder().start_record()", "start_record"
    ),
    UpstreamLine(
        _MANAGER,
        123,
        "dump_record_output = get_global_expert_distribution_recorder().dump_record(",
        "... and dump_record(output_mode='object') at each rebalance",
    ),
    UpstreamLine(_MANAGER, 126, 'logical_count = dump_record_output["logical_count"]', "the load"),
    UpstreamLine(
        _MANAGER,
        191,
        "return ExpertLocationMetadata.init_by_eplb(",
        "the new layout computed from it",
    ),
    UpstreamLine(
        _MANAGER,
        226,
        "if average_utilization_rate_over_window is None:",
        "no utilization rate reads as: rebalance",
    ),
)


def skewed_logical_count(
    num_layers: int,
    num_logical_experts: int,
    *,
    seed: int,
    step: int = 0,
    tokens_per_layer: int = 100_000,
    skew: float = 1.2,
) -> torch.Tensor:
    """Zipf-like token counts per (layer, logical expert), shape ``(1, layers, experts)``, int32.

    In each layer the counts fall off as ``1 / rank**skew``, and which experts are hot is a
    permutation drawn from ``(seed, step, layer)``: the same arguments give the same tensor in
    every process, and consecutive steps move the hot experts, so every rebalance has work to do.
    """
    if num_layers < 1 or num_logical_experts < 1:
        raise ValueError("num_layers and num_logical_experts must be at least 1")
    if skew <= 0:
        raise ValueError(f"skew must be positive, got {skew}")
    weights = [1.0 / (rank + 1) ** skew for rank in range(num_logical_experts)]
    total = sum(weights)
    counts = torch.zeros((1, num_layers, num_logical_experts), dtype=torch.int32)
    for layer in range(num_layers):
        order = list(range(num_logical_experts))
        random.Random(f"{seed}:{step}:{layer}").shuffle(order)
        for popularity, expert in enumerate(order):
            counts[0, layer, expert] = int(tokens_per_layer * weights[popularity] / total) + 1
    return counts


class SyntheticLoadRecorder:
    """Stands in for sglang's expert distribution recorder where no tokens are routed (CPU).

    Implements only what ``EPLBManager`` calls on the global recorder: ``recording``,
    ``start_record`` and ``dump_record(output_mode="object")`` (``UPSTREAM_LINES``). Install it
    with sglang's own ``set_global_expert_distribution_recorder``. Each dump returns the next
    step's load; ``average_utilization_rate_over_window`` is ``None``, which sglang reads as
    "rebalance".
    """

    def __init__(
        self,
        num_layers: int,
        num_logical_experts: int,
        *,
        seed: int,
        first_step: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.num_logical_experts = num_logical_experts
        self.seed = seed
        self.next_step = first_step
        self._recording = False

    @property
    def recording(self) -> bool:
        return self._recording

    def start_record(self) -> None:
        self._recording = True

    def dump_record(self, output_mode: str = "file") -> dict[str, Any]:
        if output_mode != "object":
            raise NotImplementedError("SyntheticLoadRecorder only dumps to an object")
        logical_count = skewed_logical_count(
            self.num_layers,
            self.num_logical_experts,
            seed=self.seed,
            step=self.next_step,
        )
        self.next_step += 1
        return {
            "rank": None,
            "logical_count": logical_count,
            "average_utilization_rate_over_window": None,
        }
