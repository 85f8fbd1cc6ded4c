"""The layout a daemon loads its weights into, chosen before the load: restored, or initial.

``layout_to_load`` runs inside ``WeightCacheDaemon._initialize_eplb_expert_location_metadata``
(the placement hook calls it, after ``_init_distributed`` made the daemons' groups and before the
loader), on every daemon of an engine: it opens the ledger (the daemon's one writer from then
on), agrees with the other daemons over sglang's world group (``restore.restore_before_load``)
and keeps what it decided on the daemon (``chosen_before_load``), which the load hook starts the
incarnation from once the weights are loaded. It reads of sglang the device UUID (the ledger's
path) and the world group; the lines it relies on are in ``hooks.UPSTREAM_LINES``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map
from sglang_integration.daemon import ledger_paths
from sglang_integration.daemon.checkpoint_identity import checkpoint_digest, structure_digest
from sglang_integration.daemon.record_opening import daemon_retention
from sglang_integration.daemon.restore import (
    OpenedLedger,
    RestorePlan,
    open_before_load,
    restore_before_load,
)

logger = logging.getLogger(__name__)

# The attribute of a WeightCacheDaemon that holds what it decided before its load (``BeforeLoad``).
_BEFORE_LOAD_ATTR = "_expert_layout_before_load"


@dataclass(frozen=True)
class BeforeLoad:
    """What a daemon decided before its load: its ledger, opened then, the restore plan its
    weights were loaded by, and the identity of the checkpoint it loads."""

    opened: OpenedLedger
    plan: RestorePlan
    checkpoint_digest: str


def layout_to_load(daemon: Any, model_config: Any, initial_map: Map, geometry: Geometry) -> Map:
    """The map this daemon loads its weights into: the restored one, or sglang's initial one.

    Called inside ``WeightCacheDaemon._initialize_eplb_expert_location_metadata`` (after
    ``_init_distributed`` made the daemons' groups, before the loader), on every daemon of the
    engine, by the hook that installs the map as sglang's global metadata.
    The daemon opens its ledger now (its one writer from here on), and agrees with the others
    over sglang's world group (``restore.restore_before_load``); a daemon whose ledger cannot be
    opened takes part, then stops, as it stopped after its load before restores.
    """
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.platforms import current_platform

    try:
        path = ledger_paths.prepare_ledger_path(current_platform.get_device_uuid(daemon.gpu_id))
    except (LedgerError, OSError) as exc:
        opened = OpenedLedger(ledger_paths.ledger_template(), None, str(exc))
    else:
        opened = open_before_load(path, daemon_retention())
    load = {
        "dtype": getattr(model_config, "dtype", None),
        "quantization": daemon.quantization or getattr(model_config, "quantization", None),
        "revision": daemon.revision,
    }
    try:
        checkpoint = checkpoint_digest(daemon.model_path, **load)
        structure = structure_digest(daemon.model_path, **load)
    except OSError as exc:  # the daemons then load different checkpoints: none restores
        checkpoint = structure = f"unreadable: {exc}"
    plan = restore_before_load(
        opened,
        get_world_group(),
        geometry=geometry,
        checkpoint_digest=checkpoint,
        structure_digest=structure,
        initial_map=initial_map,
    )
    if opened.ledger is None:
        logger.error(
            "the expert layout ledger cannot be opened, the daemon stops: %s", opened.problem
        )
        raise SystemExit(2)
    setattr(daemon, _BEFORE_LOAD_ATTR, BeforeLoad(opened, plan, checkpoint))
    return plan.physical_to_logical_map


def chosen_before_load(daemon: Any) -> BeforeLoad | None:
    """What ``layout_to_load`` decided for ``daemon`` (None: it did not run)."""
    before: BeforeLoad | None = getattr(daemon, _BEFORE_LOAD_ATTR, None)
    return before
