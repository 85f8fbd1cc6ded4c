"""The synthetic stand-in's checkpoint: a model-less daemon's reload of its expert files.

A synthetic expert's bytes are a function of its layer, its id and the tensor
(``shared_experts.expert_values``), so the model-less daemon with ``--experts`` can do what a
model-backed daemon does from its checkpoint (``daemon.checkpoint_reload``): rewrite some local
slots in place with the experts a map names, then fingerprint them. It serves
``expert_layout_reload`` and ``expert_layout_heal``; it never heals by itself (heal ``off``), so
the synthetic cases whose daemons stay dirty (the demo's cases 3 to 5) stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from layout_ledger.core.reloads import ReloadFailed, ReloadReport
from layout_ledger.wire.healing import HEAL_OFF, Healing
from sglang_integration.content.model_slots import ModelSlots


class SyntheticReloader:
    """``SlotReloader`` over rank ``rank``'s expert files in ``directory``."""

    def __init__(self, directory: str | Path, rank: int, slots: ModelSlots) -> None:
        from sglang_integration.testing.expert_files import map_expert_files

        self.shape, self.routed = map_expert_files(directory, rank)
        self.first_slot = rank * self.shape.num_local_slots
        self.slots = slots

    def __call__(
        self, physical_to_logical_map: Sequence[Sequence[int]], slots: Mapping[int, Sequence[int]]
    ) -> ReloadReport:
        from sglang_integration.testing.shared_experts import expert_values

        started = time.perf_counter()
        written = 0
        layers = tuple(sorted(slots))
        for layer in layers:
            tensors: list[Any] = self.routed[layer]
            for slot in slots[layer]:
                local = slot - self.first_slot
                if not 0 <= local < self.shape.num_local_slots:
                    raise ReloadFailed(f"slot {slot} of layer {layer} is not a local slot")
                expert = int(physical_to_logical_map[layer][slot])
                for index, tensor in enumerate(tensors):
                    values = expert_values(layer, expert, index, self.shape.widths[index])
                    tensor[local].copy_(values)
                    written += values.numel() * values.element_size()
        return ReloadReport(
            layers=layers,
            slots=sum(len(slots[layer]) for layer in layers),
            bytes_read=written,
            seconds=time.perf_counter() - started,
            fingerprints=self.slots.fingerprints(list(layers)),
        )


def synthetic_healing(directory: str | Path, rank: int, slots: ModelSlots | None) -> Healing:
    """Reloads from the synthetic checkpoint (heal ``off``), or none without fingerprints."""
    if slots is None:
        return Healing.unavailable_because("it records no slot fingerprints", HEAL_OFF)
    return Healing(HEAL_OFF, SyntheticReloader(directory, rank, slots))
