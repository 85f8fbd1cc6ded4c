"""Build the engine's ``ExpertLocationMetadata`` from a daemon's map, after two checks.

The metadata comes from ``ExpertLocationMetadata.init_by_mapping``, the call sglang makes for
``--init-expert-location`` with a ``physical_to_logical_map``, so an engine that adopts a
daemon's map routes exactly as one started with that map in the flag; it is copied into the
engine's own tensors in place (``copy_layers_in_place``: the fields and checks of
``ExpertLocationMetadata.update``, which sglang's own rebalance calls, each written with one
``copy_`` instead of ``update``'s ``torch.where`` over the whole tensor, which allocates and
reads it three times: 36 MB for ``logical_to_all_physical_map`` alone at DeepSeek-V3's
geometry, 30 ms a field on a CPU). The sglang lines these rely on are ``UPSTREAM_LINES``.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from layout_ledger.core.startup_verdict import ExpertLayoutStartupError
from sglang_integration.upstream_lines import UpstreamLine

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

logger = logging.getLogger(__name__)

# The lines of sglang this module relies on (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(
        "srt/eplb/expert_location.py",
        786,
        "return ExpertLocationMetadata.init_by_mapping(",
        "--init-expert-location with a map: the call metadata_from_map makes",
    ),
    UpstreamLine(
        "srt/eplb/expert_location_dispatch.py",
        45,
        "ep_dispatch_algorithm = get_exec().moe.ep_dispatch_algorithm",
        "no dispatch info without ep_dispatch_algorithm (check_dispatch_follows_metadata)",
    ),
    UpstreamLine(
        "srt/arg_groups/parallel_hook.py",
        766,
        'if (cfg.enable_eplb or (cfg.init_expert_location != "trivial")) and (',
        "which sglang sets for --enable-eplb or a non-trivial --init-expert-location",
    ),
    UpstreamLine(
        "srt/eplb/expert_location_updater.py",
        73,
        "old_expert_location_metadata.update(",
        "sglang's rebalance copies new metadata in place, as adopt_map does",
    ),
    UpstreamLine(
        "srt/eplb/expert_location.py",
        289,
        "physical_to_logical_map_cpu=physical_to_logical_map.cpu(),",
        "on a CPU device the _cpu fields are the device fields themselves (copied once)",
    ),
)

# ``ExpertLocationMetadata.update``'s fields (sglang 0.5.23, expert_location.py 312-339), each
# with its layer dimension first.
UPDATED_FIELDS = (
    "physical_to_logical_map",
    "physical_to_logical_map_cpu",
    "logical_to_all_physical_map",
    "logical_to_all_physical_map_cpu",
    "logical_to_all_physical_map_num_valid",
    "logical_to_rank_dispatch_physical_map",
)


class LayoutShapeMismatch(ExpertLayoutStartupError):
    """The daemon's map has another shape than the engine's expert layout."""


class LayoutNotFollowed(ExpertLayoutStartupError):
    """The engine would ignore the metadata when it dispatches tokens to experts."""


def check_map_shape(
    physical_to_logical_map: Sequence[Sequence[int]], initial: ExpertLocationMetadata
) -> None:
    """Raise ``LayoutShapeMismatch`` unless the map is ``initial``'s layers x physical slots (a
    different slot count: the daemon and the engine run with different
    ``--ep-num-redundant-experts``)."""
    from sglang.srt.runtime_context import get_exec

    engine_shape = tuple(initial.physical_to_logical_map_cpu.shape)
    rows = len(physical_to_logical_map)
    widths = sorted({len(row) for row in physical_to_logical_map})
    if rows == engine_shape[0] and widths == [engine_shape[1]]:
        return
    engine_redundant = get_exec().moe.ep_num_redundant_experts
    num_logical = initial.num_logical_experts
    daemon_slots = widths[0] if len(widths) == 1 else None
    daemon_redundant = (
        f"{daemon_slots - num_logical}" if daemon_slots is not None else "unknown (ragged map)"
    )
    raise LayoutShapeMismatch(
        f"the weight cache daemon's expert map has {rows} layers x "
        f"{'/'.join(str(w) for w in widths) or 0} physical slots, but this engine's layout is "
        f"{engine_shape[0]} layers x {engine_shape[1]} slots ({num_logical} logical experts). "
        f"The daemon runs with --ep-num-redundant-experts {daemon_redundant} and the engine "
        f"with --ep-num-redundant-experts {engine_redundant}: start both with the same value "
        f"(and the same model)."
    )


def check_dispatch_follows_metadata() -> None:
    """Raise ``LayoutNotFollowed`` unless sglang dispatches tokens through the metadata.

    sglang builds the dispatch info only when ``ep_dispatch_algorithm`` is set, which it does
    for ``--enable-eplb`` or a non-trivial ``--init-expert-location`` (``UPSTREAM_LINES``);
    without it the engine routes as if every expert were in its initial slot.
    """
    from sglang.srt.runtime_context import get_exec

    moe = get_exec().moe
    if moe.ep_dispatch_algorithm is not None:
        return
    raise LayoutNotFollowed(
        "the weight cache daemon's experts have moved, but this engine runs without "
        "--enable-eplb or --init-expert-location, so it would route as if every expert were "
        "in its initial slot and read the wrong experts. Start the engine with --enable-eplb "
        "(or --init-expert-location with the daemon's map)."
    )


def metadata_from_map(
    model_config: ModelConfig, physical_to_logical_map: Sequence[Sequence[int]], moe_ep_rank: int
) -> ExpertLocationMetadata:
    """``ExpertLocationMetadata.init_by_mapping`` of the map, as ``--init-expert-location`` does."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    # --init-expert-location JSON arrives as nested lists, which init_by_mapping turns into a
    # tensor with torch.tensor (default int64); give it the same tensor.
    tensor = _int64_tensor(physical_to_logical_map)
    metadata = ExpertLocationMetadata.init_by_mapping(
        model_config, physical_to_logical_map=tensor, moe_ep_rank=moe_ep_rank
    )
    if metadata is None:
        raise ExpertLayoutStartupError(
            f"sglang built no expert-location metadata for {model_config.model_path}; the model "
            "has no routed experts to lay out"
        )
    return metadata


def _int64_tensor(rows: Sequence[Sequence[int]]) -> Any:
    """``torch.tensor(rows)`` of a rectangular map of ints, through one flat buffer (4x faster
    than from nested lists at 61 x 288); a ragged map goes to ``torch.tensor``, which raises."""
    import torch

    width = len(rows[0]) if rows else 0
    if not rows or not width or any(len(row) != width for row in rows):
        return torch.tensor([list(row) for row in rows])
    flat = array("q", chain.from_iterable(rows))
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width)


def copy_layers_in_place(current: Any, other: Any, layers: Sequence[int]) -> None:
    """``current.update(other, layers)``'s effect: every field of ``layers`` copied from
    ``other`` into ``current``'s own tensors (their storage, so their addresses, unchanged).

    A field that is the very tensor of a field already written, in both (on a CPU device the
    ``_cpu`` fields are, ``UPSTREAM_LINES``), is written once."""
    import torch

    if current.ep_size != other.ep_size:
        raise ValueError(f"ep_size {current.ep_size} != {other.ep_size}")
    written: list[tuple[Any, Any]] = []
    for name in UPDATED_FIELDS:
        mine, theirs = getattr(current, name), getattr(other, name)
        if (mine is None) != (theirs is None):
            raise ValueError(f"{name} is set on one metadata only")
        if mine is None or any(mine is m and theirs is t for m, t in written):
            continue
        written.append((mine, theirs))
        if len(layers) == mine.shape[0]:
            mine.copy_(theirs)
            continue
        index = torch.tensor(list(layers), dtype=torch.long, device=mine.device)
        mine.index_copy_(0, index, theirs.to(mine.device).index_select(0, index))


def map_of(metadata: ExpertLocationMetadata) -> list[list[int]]:
    """The metadata's ``physical_to_logical_map`` as the protocol's nested lists of ints."""
    # An integer tensor's tolist() is already Python ints (the protocol's values).
    rows: list[list[int]] = metadata.physical_to_logical_map_cpu.tolist()
    return rows


def adopt_map(
    model_config: ModelConfig,
    physical_to_logical_map: Sequence[Sequence[int]],
    moe_ep_rank: int,
    current: ExpertLocationMetadata,
    *,
    current_map: Sequence[Sequence[int]] | None = None,
) -> bool:
    """Make ``current`` describe the daemon's map; return whether anything changed.

    A map equal to ``current``'s is kept as is (no check can fail then: the engine already
    routes with it). Otherwise both checks run, and the metadata built from the map is copied
    into ``current``'s tensors in place over every layer (``copy_layers_in_place``, the effect
    of ``ExpertLocationMetadata.update``, as sglang's own rebalance does), so objects that
    already hold ``current`` (the expert distribution recorder) see the adopted layout too.
    ``current_map``: ``map_of(current)`` when the caller already has it.
    """
    check_map_shape(physical_to_logical_map, current)
    mine = map_of(current) if current_map is None else current_map
    if all(list(a) == list(b) for a, b in zip(mine, physical_to_logical_map, strict=True)):
        return False
    check_dispatch_follows_metadata()
    adopted = metadata_from_map(model_config, physical_to_logical_map, moe_ep_rank)
    copy_layers_in_place(current, adopted, range(current.num_layers))
    return True
