"""Opening a daemon's record once its weights are loaded: ledger, incarnation, fingerprints.

The load hook (a real daemon), the model-less daemon and the one-GPU check's stand-in all open
it the same way: the ledger file (its one writer) with the retention the settings say, a new
incarnation (at version 0 from the initial map, or, on a ledger opened before the load, in the
layout its restore plan loaded: ``start_planned_record``) with where it runs and the slots'
fingerprints, and in the same transaction the load's verdict: that replicas hold the same
bytes, and for a restore that each slot holds what a clean earlier load of the same checkpoint
recorded for its expert (a ``checkpoint_changed`` first when the checkpoint is another one).
Nothing here reads sglang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.layout import Geometry, Map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.retention import Retention
from sglang_integration import settings
from sglang_integration.content.model_slots import ModelSlots
from sglang_integration.daemon.restore import RestorePlan, check_restored_content
from sglang_integration.settings import ContentCheck

logger = logging.getLogger(__name__)


def daemon_retention() -> Retention:
    """The retention in force (``settings.KEEP_VERSIONS`` and ``settings.PRUNE_EVERY``)."""
    return Retention(
        keep_versions=settings.KEEP_VERSIONS.read(), prune_every=settings.PRUNE_EVERY.read()
    )


def open_ledger_record(
    path: str | os.PathLike[str],
    geometry: Geometry,
    initial_map: Map,
    *,
    retention: Retention,
    config_fingerprint: str,
    daemon_label: str,
    origin: IncarnationOrigin | None = None,
    content: LocalFingerprints | None = None,
    heal: str | None = None,
    mode: ContentCheck | None = None,
) -> tuple[Ledger, LayoutRecord]:
    """Open the ledger (one writer) and start a new incarnation at version 0, recording where
    it runs (``origin``) and the slots' fingerprints (when the daemon records them); with
    ``mode``, the check that replicas hold the same bytes, in the start's transaction."""
    ledger = Ledger.open(path, retention)
    try:
        record = ledger.start_incarnation(
            geometry,
            initial_map,
            config_fingerprint=config_fingerprint,
            daemon_label=daemon_label,
            origin=origin,
            content=content,
            heal=heal,
            after_start=None
            if mode is None
            else lambda started: check_loaded_content(started, mode),
        )
    except BaseException:
        ledger.close()
        raise
    return ledger, record


def start_planned_record(
    ledger: Ledger,
    geometry: Geometry,
    restore: RestorePlan,
    *,
    checkpoint_digest: str,
    config_fingerprint: str,
    daemon_label: str,
    origin: IncarnationOrigin | None,
    content: LocalFingerprints | None,
    mode: ContentCheck,
    heal: str | None = None,
) -> LayoutRecord:
    """On a ledger opened before the load: the incarnation in the layout the load used (the
    restored version, or version 0) and, in the same transaction, the load's verdict: a
    ``checkpoint_changed`` when the restored version's weights come from another checkpoint,
    then the checks of what was loaded (the replicas, and for a restore, each slot against
    what a clean earlier load of this checkpoint recorded for its expert)."""

    def verdict(record: LayoutRecord) -> None:
        if restore.checkpoint_change is not None:
            record.note_checkpoint_changed(restore.checkpoint_change.describe())
        check_loaded_content(record, mode)
        check_restored_content(record, restore, mode)

    try:
        return ledger.start_incarnation(
            geometry,
            restore.physical_to_logical_map,
            config_fingerprint=config_fingerprint,
            daemon_label=daemon_label,
            origin=origin,
            content=content,
            checkpoint_digest=checkpoint_digest,
            restored_from=restore.restored_from,
            heal=heal,
            after_start=verdict,
        )
    except BaseException:
        ledger.close()
        raise


def loaded_fingerprints(slots: ModelSlots | None, mode: ContentCheck) -> LocalFingerprints | None:
    """The local slots' fingerprints at load (None: content check off, or no tensors)."""
    if slots is None or mode is ContentCheck.OFF:
        return None
    local = slots.fingerprints()
    logger.info(
        "fingerprinted %d local slots (from slot %d) of %d layers at load",
        slots.num_slots,
        slots.first_slot,
        len(local.layers),
    )
    return local


def check_loaded_content(record: LayoutRecord, mode: ContentCheck) -> None:
    """Replicas must hold the same bytes; ``enforce`` marks the daemon dirty when they do not.
    Experts that hold the same bytes (tied) are logged once: the checks compare their bytes."""
    tied = record.known.tied()
    if tied:
        logger.warning(
            "logical experts with identical bytes (tied; the content checks compare bytes, not "
            "names, so their slots may hold either): %s",
            "; ".join(
                f"layer {layer}: " + ", ".join("/".join(map(str, group)) for group in groups)
                for layer, groups in tied.items()
            ),
        )
    problem = record.check_loaded_content(enforce=mode is ContentCheck.ENFORCE)
    if problem is None:
        return
    if mode is ContentCheck.ENFORCE:
        logger.error(
            "expert layout is dirty from the start, fetch_state and begin are refused: %s", problem
        )
    else:
        logger.warning("%s (content check warn: serving anyway)", problem)


def config_fingerprint(config_dict: dict[str, Any]) -> str:
    """SHA-256 of the daemon's CacheConfig, recorded with each incarnation."""
    text = json.dumps(config_dict, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
