"""A daemon's restore: the layout it loads its weights into, agreed with its engine's daemons.

Before its weights load, a daemon with ``--enable-eplb`` opens its ledger (it then holds the
ledger's writer lock until it ends) and reads what the ledger offers
(``Ledger.restore_offer``: the newest committed version of the same geometry, its rows
verified, whatever checkpoint it was loaded from). The daemons of one engine all-gather their
``RestoreFinding`` over their process group, every one of them, also one whose ledger cannot be
opened (so none is left in the collective alone), and each applies
``core.restore_verdict.decide`` to the same list: all restore the newest version any of them
committed, with its map from the daemon that holds it, or all load sglang's initial layout, one
warning naming why. ``RestorePlan`` is what the daemon does with the verdict: the map to load,
what it records (``RestoredFrom``; a ``CheckpointChange`` when its ledger's latest incarnation
loaded another checkpoint), and what its ledger knows of the experts' bytes in the checkpoint it
loads now (``store.baseline``: a clean earlier load of the same checkpoint, never a load that
went wrong), which the slots loaded into that map are checked against
(``check_restored_content``). Nothing here imports sglang: the caller passes the group
(sglang's ``GroupCoordinator`` or anything with ``rank_in_group`` and ``all_gather_object``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from layout_ledger.core.content import ExpertContents
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map, layout_digest
from layout_ledger.core.record import LayoutRecord
from layout_ledger.core.restore_verdict import (
    LoadInitial,
    OfferKind,
    Restore,
    RestoreFinding,
    Verdict,
    decide,
)
from layout_ledger.core.rules import committed_content_problems
from layout_ledger.core.state import CheckpointChange, RestoredFrom
from layout_ledger.store.baseline import Baseline
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.restore_offer import RestoreOffer
from layout_ledger.store.retention import Retention
from sglang_integration.settings import RESTORE, ContentCheck, RestoreMode

logger = logging.getLogger(__name__)


class DaemonGroup(Protocol):
    """The daemons' process group, as sglang's ``GroupCoordinator`` offers it."""

    @property
    def rank_in_group(self) -> int: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True)
class RestorePlan:
    """What one daemon loads and records: ``physical_to_logical_map`` (the restored map, or
    sglang's initial one) and ``restored_from`` (None: version 0); ``known``, the experts' bytes
    its own ledger's baseline recorded for the checkpoint it loads (empty without one);
    ``checkpoint_change``: the checkpoint differs from the one its latest incarnation loaded."""

    physical_to_logical_map: Map
    restored_from: RestoredFrom | None
    verdict: Verdict
    known: ExpertContents = field(default_factory=ExpertContents)
    checkpoint_change: CheckpointChange | None = None
    baseline_incarnation: int | None = None  # whose clean load ``known`` comes from


@dataclass
class OpenedLedger:
    """A daemon's ledger opened before its load, or why it could not be (``problem``)."""

    path: str
    ledger: Ledger | None
    problem: str | None = None


def open_before_load(path: str, retention: Retention) -> OpenedLedger:
    """Open the ledger for writing before the load (its one writer from now on); a failure is
    kept, not raised: the daemon still takes part in the agreement, then stops."""
    try:
        return OpenedLedger(path, Ledger.open(path, retention))
    except LedgerError as exc:
        return OpenedLedger(path, None, str(exc))


def find(
    opened: OpenedLedger,
    *,
    rank: int,
    mode: RestoreMode,
    geometry: Geometry,
    checkpoint_digest: str,
    initial_map: Map,
) -> tuple[RestoreFinding, RestoreOffer | None]:
    """This daemon's finding (and its ledger's offer, kept here: its fingerprints stay local)."""

    def found(kind: OfferKind, reason: str = "", **offered: Any) -> RestoreFinding:
        return RestoreFinding(
            rank=rank,
            ledger=opened.path,
            kind=kind,
            checkpoint_digest=checkpoint_digest,
            geometry=geometry,
            initial_digest=layout_digest(initial_map),
            reason=reason,
            **offered,
        )

    if mode is RestoreMode.INITIAL:
        return found(OfferKind.INITIAL, f"{RESTORE.env}=initial"), None
    if opened.ledger is None:
        return found(OfferKind.UNREADABLE, opened.problem or "cannot be opened"), None
    try:
        offer = opened.ledger.restore_offer(geometry, checkpoint_digest)
    except LedgerError as exc:
        return found(OfferKind.UNREADABLE, f"its rows do not verify: {exc}"), None
    except Exception as exc:  # whatever fails, this daemon still takes part in the gather
        logger.exception("reading the restore offer of %s failed", opened.path)
        return found(OfferKind.UNREADABLE, f"reading it failed: {type(exc).__name__}: {exc}"), None
    if not isinstance(offer, RestoreOffer):
        return found(OfferKind.NOTHING, offer.reason), None
    return (
        found(
            OfferKind.OFFER,
            incarnation=offer.incarnation,
            version=offer.version,
            digest=offer.digest,
            physical_to_logical_map=offer.physical_to_logical_map,
        ),
        offer,
    )


def agree(group: DaemonGroup | None, finding: RestoreFinding) -> Verdict:
    """All-gather every daemon's finding over ``group`` (None: a daemon alone) and decide."""
    findings = [finding] if group is None else list(group.all_gather_object(finding))
    return decide(findings)


def plan(
    finding: RestoreFinding,
    offer: RestoreOffer | None,
    verdict: Verdict,
    initial_map: Map,
    *,
    baseline: Baseline | None = None,
    identity: str | None = None,
) -> RestorePlan:
    """What this daemon loads and records for ``verdict``; logs it (the fallback's warning).

    ``baseline``: what a clean earlier load of the checkpoint it loads (``identity``) recorded
    (None: no such load in its ledger). Its own ledger's offer names the checkpoint its latest
    incarnation loaded: another one than ``identity`` (older code recorded the structure digest
    of the finding, which counts as the same) is a ``CheckpointChange``."""
    known = ExpertContents()
    if baseline is not None:
        for layer in baseline.recorded.layers:
            known.learn_slots(layer, baseline.physical_to_logical_map[layer], baseline.recorded)
    if isinstance(verdict, LoadInitial):
        log = logger.warning if verdict.warn else logger.info
        log(
            "expert layout ledger %s: loading sglang's initial layout at version 0: %s",
            finding.ledger,
            verdict.reason,
        )
        return RestorePlan(initial_map, None, verdict, known)
    restored = verdict.restored_from(finding)
    logger.info(
        "expert layout ledger %s: loading the weights into the %s",
        finding.ledger,
        restored.describe().removeprefix("restored ") + " (restored)",
    )
    change = None
    baseline_incarnation = None if baseline is None else baseline.incarnation
    previous = None if offer is None else offer.checkpoint_digest
    if (
        offer is not None
        and identity is not None
        and previous is not None
        and previous not in (identity, finding.checkpoint_digest)
    ):
        change = CheckpointChange(previous, offer.incarnation, identity, baseline_incarnation)
        logger.warning(
            "expert layout ledger %s: %s", finding.ledger, change.describe().replace("; ", ": ", 1)
        )
    return RestorePlan(
        verdict.physical_to_logical_map, restored, verdict, known, change, baseline_incarnation
    )


def restore_before_load(
    opened: OpenedLedger,
    group: DaemonGroup | None,
    *,
    geometry: Geometry,
    checkpoint_digest: str,
    initial_map: Map,
    structure_digest: str | None = None,
) -> RestorePlan:
    """The whole agreement of one daemon: its finding, the all-gather, the verdict, the plan.
    Every daemon of the group must call it, whatever its ledger's state.

    ``checkpoint_digest`` identifies the weights it loads (``checkpoint_identity``; recorded,
    and what its baseline is chosen by); the daemons agree on ``structure_digest`` (the same on
    every host holding a copy; None: ``checkpoint_digest``)."""
    structure = checkpoint_digest if structure_digest is None else structure_digest
    finding, offer = find(
        opened,
        rank=0 if group is None else int(group.rank_in_group),
        mode=RESTORE.read(),
        geometry=geometry,
        checkpoint_digest=structure,
        initial_map=initial_map,
    )
    verdict = agree(group, finding)
    baseline = None
    if isinstance(verdict, Restore) and opened.ledger is not None:
        try:
            baseline = opened.ledger.restore_baseline(geometry, {checkpoint_digest, structure})
        except LedgerError as exc:  # no baseline: the load is judged as a first load
            logger.warning("the restore baseline of %s cannot be read: %s", opened.path, exc)
    return plan(finding, offer, verdict, initial_map, baseline=baseline, identity=checkpoint_digest)


def check_restored_content(record: LayoutRecord, restore: RestorePlan, mode: ContentCheck) -> None:
    """Right after a restored load: each local slot must hold what the baseline (a clean earlier
    load of the same checkpoint) recorded for the expert the restored map names there (where it
    recorded that expert); a slot that does not is named, and with ``enforce`` the daemon is
    dirty from its start, as after a damaged load. Called in the start's transaction."""
    if restore.restored_from is None or record.content is None or record.dirty is not None:
        return
    problems = committed_content_problems(
        restore.physical_to_logical_map, record.content, restore.known
    )
    if not problems:
        return
    problem = (
        f"the weights loaded into the {restore.restored_from.describe()} do not hold what "
        f"incarnation {restore.baseline_incarnation}'s clean load of the same checkpoint recorded "
        f"for those experts: " + "; ".join(problems.values())
    )
    if mode is ContentCheck.ENFORCE:
        record.mark_content_dirty(
            sorted(problems),
            problem + "; the checkpoint's files are the ones that load read (same identity), so "
            "this load went wrong: restart the daemon",
        )
        logger.error(
            "expert layout is dirty from the start, fetch_state and begin are refused: %s", problem
        )
    else:
        logger.warning("%s (content check warn: serving anyway)", problem)
