"""Every replica filled: the daemon's expert location metadata lists every slot of each expert.

sglang's daemon loads its weights with its EP rank's metadata: its
``_initialize_eplb_expert_location_metadata`` builds the initial layout with ``moe_ep_rank`` set.
With an all-to-all backend (``--moe-a2a-backend deepep``...) that rank collapses each expert's
replica list to the one nearest slot, the first on this rank (``_compute_logical_to_all_physical_
map``, ``_find_nearest_expert``), and ``FusedMoE.weight_loader`` copies a checkpoint expert only
into the slots ``logical_to_all_physical`` names, skipping other ranks' slots. So a second
replica of an expert on one rank is never filled: its slot keeps whatever the allocation held
(the proposal measured 24 and 19 such slots on two GPUs). An engine routes with the full list,
so tokens sent to that slot meet an empty expert; and the layout a restore or a heal loads into
names such slots whenever a rebalance put two replicas of an expert on one rank.

The daemon's metadata only places weights (an engine builds its own for routing), so the daemon
needs every replica listed. ``install_daemon_metadata`` builds it with ``moe_ep_rank=None``,
which skips the collapse on every backend, and installs it as sglang's global metadata, where
sglang's loader reads it; ``around_initialize_metadata`` (an AROUND hook on the daemon's method)
uses it for the initial layout. With ``--moe-a2a-backend none`` sglang already lists every
replica (the collapse is skipped there), so nothing changes for that backend.

The lines of sglang this relies on are ``UPSTREAM_LINES``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from layout_ledger.core.layout import Geometry
from sglang_integration.daemon.layout_choice import layout_to_load
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

TARGET = (
    "sglang.srt.weight_cache.daemon.WeightCacheDaemon._initialize_eplb_expert_location_metadata"
)

_DAEMON_FILE = "srt/weight_cache/daemon.py"
_LOCATION_FILE = "srt/eplb/expert_location.py"
_LAYER_FILE = "srt/layers/moe/fused_moe_triton/layer.py"
UPSTREAM_LINES = (
    UpstreamLine(
        _DAEMON_FILE,
        474,
        "def _initialize_eplb_expert_location_metadata(self, model_config) -> None:",
        "the hook's target, called by load before the model is loaded",
    ),
    UpstreamLine(
        _DAEMON_FILE, 476, "if not get_exec().moe.enable_eplb:", "no metadata without EPLB"
    ),
    UpstreamLine(
        _DAEMON_FILE,
        487,
        "moe_ep_rank=get_parallel().moe_ep_rank,",
        "sglang builds the daemon's initial layout for its EP rank",
    ),
    UpstreamLine(
        _LOCATION_FILE,
        561,
        'if moe_ep_rank is not None and get_exec().moe.moe_a2a_backend != "none":',
        "with a rank and an a2a backend, each expert's replicas collapse to one slot",
    ),
    UpstreamLine(
        _LOCATION_FILE,
        720,
        "return same_gpu_physical_expert_ids[0]",
        "the one kept is the first slot on this rank",
    ),
    UpstreamLine(
        _LOCATION_FILE,
        766,
        "def compute_initial_expert_location_metadata(",
        "sglang's initial layout (--init-expert-location or trivial), built with no rank here",
    ),
    UpstreamLine(_LOCATION_FILE, 138, "def init_by_mapping(", "the metadata of a given map"),
    UpstreamLine(
        _LOCATION_FILE,
        484,
        "def set_global_expert_location_metadata(value, allow_overwrite=False):",
        "where sglang's loader finds the metadata",
    ),
    UpstreamLine(
        _LAYER_FILE,
        1226,
        "global_expert_location_metadata.logical_to_all_physical(",
        "the loader fills only the slots the metadata lists for an expert",
    ),
    UpstreamLine(
        _LAYER_FILE,
        1251,
        "if expert_id < 0 or expert_id >= self.num_local_experts:",
        "and skips the slots of other ranks",
    ),
)


# The attribute of a WeightCacheDaemon that keeps the ModelConfig its load built (``load`` keeps
# it in a local only): a heal or reload installs its metadata again (``checkpoint_reload``).
_MODEL_CONFIG_ATTR = "_expert_layout_model_config"


def kept_model_config(daemon: Any) -> Any:
    """The ``ModelConfig`` the daemon's load built (None: the hook did not run)."""
    return getattr(daemon, _MODEL_CONFIG_ATTR, None)


def register_placement_hook() -> None:
    """Register ``around_initialize_metadata`` (applied by ``HookRegistry.apply_hooks``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, around_initialize_metadata, HookType.AROUND)


def install_daemon_metadata(
    model_config: Any, physical_to_logical_map: Sequence[Sequence[int]] | Any | None = None
) -> Any:
    """Build the daemon's ``ExpertLocationMetadata`` and install it as sglang's global one.

    ``physical_to_logical_map``: the layout to load into (a ``num_layers x num_physical_slots``
    nested list or tensor: a restored or committed map); None: sglang's own initial layout
    (``--init-expert-location``, else trivial). The metadata is
    ``ExpertLocationMetadata.init_by_mapping(model_config, map, moe_ep_rank=None)``, so every
    slot of each expert is listed and sglang's loader fills every replica; it replaces any
    installed before (``allow_overwrite=True``), so a later load of some layers goes into that
    map. Returns the metadata (None for a model without routed experts).
    """
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        compute_initial_expert_location_metadata,
        set_global_expert_location_metadata,
    )

    if physical_to_logical_map is None:
        initial = compute_initial_expert_location_metadata(model_config, moe_ep_rank=None)
        physical_to_logical_map = None if initial is None else initial.physical_to_logical_map
    metadata = (
        None
        if physical_to_logical_map is None
        else ExpertLocationMetadata.init_by_mapping(
            model_config, physical_to_logical_map, moe_ep_rank=None
        )
    )
    set_global_expert_location_metadata(metadata, allow_overwrite=True)
    return metadata


def around_initialize_metadata(
    original_fn: Callable[..., Any], daemon: Any, model_config: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``WeightCacheDaemon._initialize_eplb_expert_location_metadata``: with
    ``--enable-eplb``, the layout the daemon loads into with every replica listed
    (``install_daemon_metadata``) instead of its EP rank's: sglang's initial layout, or the one
    the restore chose with the other daemons of the engine (``layout_choice.layout_to_load``,
    which every daemon of the group reaches here); without it, sglang's method (which installs
    nothing)."""
    from sglang.srt.runtime_context import get_exec

    if not get_exec().moe.enable_eplb:
        return original_fn(daemon, model_config, *args, **kwargs)
    setattr(daemon, _MODEL_CONFIG_ATTR, model_config)  # a later reload places by it
    metadata = install_daemon_metadata(model_config)
    if metadata is None:
        return None  # no routed experts: no layout to restore
    initial_map = metadata.physical_to_logical_map.cpu().tolist()
    geometry = Geometry(
        num_layers=int(metadata.num_layers),
        num_physical_slots=int(metadata.num_physical_experts),
        num_logical_experts=int(metadata.num_logical_experts),
    )
    chosen = layout_to_load(daemon, model_config, initial_map, geometry)
    if chosen != initial_map:
        install_daemon_metadata(model_config, chosen)
    return None
