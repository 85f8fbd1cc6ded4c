"""A standby's routing tables follow the daemon's map in place, for the layers that changed.

``ExpertLocationMetadata.update`` writes every field with ``self_field[...] = torch.where(...)``
(sglang 0.5.23, ``srt/eplb/expert_location.py`` 312-339, ``standby.UPSTREAM_LINES``), so the
tensors keep their storage and a captured CUDA graph, which reads them by address, routes with
the new map on its next replay. The new metadata comes from ``init_by_mapping``, as at startup
(``metadata.metadata_from_map``), and only the layers whose rows differ are written, by
``metadata.copy_layers_in_place`` (the one copy startup's ``adopt_map`` makes too): the same
fields and checks as ``update``, each layer copied in place with ``index_copy_`` instead of a
``torch.where`` over the whole tensor (``update`` reads every field three times, 36 MB for
``logical_to_all_physical_map`` alone at DeepSeek-V3's geometry; scripts/bench_standby.py
measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def changed_layers(current: Sequence[Sequence[int]], target: Sequence[Sequence[int]]) -> list[int]:
    """The layers whose rows differ between two maps of one shape."""
    return [layer for layer, (a, b) in enumerate(zip(current, target, strict=True)) if a != b]


def prepare_metadata(
    model_config: Any, current: Any, target: Sequence[Sequence[int]], moe_ep_rank: int
) -> Any:
    """The metadata ``init_by_mapping`` builds for ``target`` (checked against ``current``'s
    shape), to be copied in later (off the forward path: an idle standby's follow thread)."""
    from sglang_integration.engine.metadata import (
        check_dispatch_follows_metadata,
        check_map_shape,
        metadata_from_map,
    )

    check_map_shape(target, current)
    check_dispatch_follows_metadata()
    return metadata_from_map(model_config, target, moe_ep_rank)


def update_changed_layers(
    model_config: Any,
    metadata: Any,
    target: Sequence[Sequence[int]],
    moe_ep_rank: int,
    prepared: Any = None,
) -> list[int]:
    """Make ``metadata`` route with ``target``, in place; returns the layers written.

    ``prepared``: the metadata of exactly ``target`` built before (``prepare_metadata``), or
    None to build it now."""
    from sglang_integration.engine.metadata import check_map_shape, copy_layers_in_place, map_of

    check_map_shape(target, metadata)
    layers = changed_layers(map_of(metadata), [list(row) for row in target])
    if not layers:
        return layers
    adopted = prepared
    if adopted is None:
        adopted = prepare_metadata(model_config, metadata, target, moe_ep_rank)
    copy_layers_in_place(metadata, adopted, layers)
    return layers
