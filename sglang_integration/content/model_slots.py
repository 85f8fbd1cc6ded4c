"""A model's routed-expert slots as a content source: fingerprints of one rank's local slots.

``ModelSlots`` wraps what sglang's ``ExpertLocationUpdater`` moves, a model's
``routed_experts_weights_of_layer`` (layer id -> the layer's routed-expert tensors, first
dimension the rank's local physical slots), with the rank's first physical slot. Its
``fingerprints(layers)`` computes ``sglang_integration.content.fingerprints`` on the tensors'
device and returns them as ``layout_ledger.core.content.LocalFingerprints`` (hex, the ledger's and
the wire's form). The daemon (its loaded model, or the model-less daemon's expert files) and the
engine (its loaded model, mapped from the daemon) both use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from layout_ledger.core.content import LocalFingerprints

logger = logging.getLogger(__name__)

RoutedWeights = Mapping[int, Sequence[Any]]  # layer id -> torch tensors


class ModelSlots:
    """One rank's local slots, ``first_slot`` on, of every layer with routed-expert tensors.

    ``routed`` is called on each use (sglang's models compute the mapping lazily, and the
    updater replaces nothing in it, so it stays the same tensors).
    """

    def __init__(self, routed: Callable[[], RoutedWeights], first_slot: int, num_slots: int):
        self._routed = routed
        self.first_slot = first_slot
        self.num_slots = num_slots

    def fingerprints(self, layers: Sequence[int] | None = None) -> LocalFingerprints:
        """Fingerprint ``layers`` (every layer with tensors when None; others are skipped)."""
        from sglang_integration.content.fingerprints import fingerprint_layers

        routed = self._routed()
        chosen = (
            sorted(routed) if layers is None else [layer for layer in layers if layer in routed]
        )
        found = fingerprint_layers(routed, chosen, self.num_slots)
        return LocalFingerprints(
            self.first_slot, {layer: tuple(values) for layer, values in found.items()}
        )


def model_slots(model: Any, first_slot: int, num_slots: int) -> ModelSlots | None:
    """The slots of a loaded sglang model (None: it has no ``routed_experts_weights_of_layer``)."""
    if getattr(model, "routed_experts_weights_of_layer", None) is None:
        return None
    return ModelSlots(lambda: routed_mapping(model), first_slot, num_slots)


def routed_mapping(model: Any) -> RoutedWeights:
    """``model.routed_experts_weights_of_layer`` as a mapping.

    DeepSeek-V3's model returns the dict from a property; Qwen3-MoE's keeps sglang's
    ``LazyValue`` in the attribute (``models/qwen3_moe.py``, the descriptor made in ``__init__``
    for IPC loading), which forwards attribute access and ``[]`` to its value but is no mapping:
    iterating it indexes 0, 1, 2... and fails at the first layer id past the MoE layers. Its
    ``value`` is the dict.
    """
    routed = model.routed_experts_weights_of_layer
    if isinstance(routed, Mapping):
        return routed
    value = getattr(routed, "value", None)
    if not isinstance(value, Mapping):
        raise TypeError(
            f"the model's routed_experts_weights_of_layer is a {type(routed).__name__} holding "
            f"a {type(value).__name__}, not a mapping of layer ids to tensors"
        )
    return value
