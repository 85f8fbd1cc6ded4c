"""A standby's routing tables follow the daemon's map in place, for the layers that changed.

``ExpertLocationMetadata.update`` writes every field with ``self_field[...] = torch.where(...)``
(sglang 0.5.23, ``srt/eplb/expert_location.py`` 312-339, ``standby.UPSTREAM_LINES``), so the
tensors keep their storage and a captured CUDA graph, which reads them by address, routes with
the new map on its next replay. The new metadata comes from ``init_by_mapping``, as at startup
(``metadata.metadata_from_map``), and only the layers whose rows differ are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def changed_layers(current: Sequence[Sequence[int]], target: Sequence[Sequence[int]]) -> list[int]:
    """The layers whose rows differ between two maps of one shape."""
    return [layer for layer, (a, b) in enumerate(zip(current, target, strict=True)) if a != b]


def update_changed_layers(
    model_config: Any, metadata: Any, target: Sequence[Sequence[int]], moe_ep_rank: int
) -> list[int]:
    """Make ``metadata`` route with ``target``, in place; returns the layers written."""
    from sglang_integration.engine.metadata import (
        check_dispatch_follows_metadata,
        check_map_shape,
        map_of,
        metadata_from_map,
    )

    check_map_shape(target, metadata)
    layers = changed_layers(map_of(metadata), [list(row) for row in target])
    if not layers:
        return layers
    check_dispatch_follows_metadata()
    adopted = metadata_from_map(model_config, target, moe_ep_rank)
    metadata.update(adopted, update_layer_ids=layers)
    return layers
