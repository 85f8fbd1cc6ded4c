"""A daemon's restore: the layout it loads its weights into, agreed with its engine's daemons.

Before its weights load, a daemon with ``--enable-eplb`` opens its ledger (it then holds the
ledger's writer lock until it ends) and reads what the ledger offers
(``Ledger.restore_offer``: the newest committed version of the same geometry and checkpoint,
its rows verified). The daemons of one engine all-gather their ``RestoreFinding`` over their
process group, every one of them, also one whose ledger cannot be opened (so none is left in
the collective alone), and each applies ``core.restore_verdict.decide`` to the same list: all
restore the newest version any of them committed, with its map from the daemon that holds it,
or all load sglang's initial layout, one warning naming why. ``RestorePlan`` is what the daemon
does with the verdict: the map to load, what it records (``RestoredFrom``), and what its ledger
knows of the experts' bytes, which the slots loaded into that map are checked against
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
    RestoreFinding,
    Verdict,
    decide,
)
from layout_ledger.core.rules import committed_content_problems
from layout_ledger.core.state import RestoredFrom
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
    its own ledger recorded (empty when it recorded none for this checkpoint)."""

    physical_to_logical_map: Map
    restored_from: RestoredFrom | None
    verdict: Verdict
    known: ExpertContents = field(default_factory=ExpertContents)


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
    finding: RestoreFinding, offer: RestoreOffer | None, verdict: Verdict, initial_map: Map
) -> RestorePlan:
    """What this daemon loads and records for ``verdict``; logs it (the fallback's warning)."""
    known = ExpertContents()
    if offer is not None and offer.recorded is not None:
        for layer in offer.recorded.layers:
            known.learn_slots(layer, offer.physical_to_logical_map[layer], offer.recorded)
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
    return RestorePlan(verdict.physical_to_logical_map, restored, verdict, known)


def restore_before_load(
    opened: OpenedLedger,
    group: DaemonGroup | None,
    *,
    geometry: Geometry,
    checkpoint_digest: str,
    initial_map: Map,
) -> RestorePlan:
    """The whole agreement of one daemon: its finding, the all-gather, the verdict, the plan.
    Every daemon of the group must call it, whatever its ledger's state."""
    finding, offer = find(
        opened,
        rank=0 if group is None else int(group.rank_in_group),
        mode=RESTORE.read(),
        geometry=geometry,
        checkpoint_digest=checkpoint_digest,
        initial_map=initial_map,
    )
    return plan(finding, offer, agree(group, finding), initial_map)


def check_restored_content(record: LayoutRecord, restore: RestorePlan, mode: ContentCheck) -> None:
    """Right after a restored load: each local slot must hold what the ledger recorded for the
    expert the restored map names there (where it recorded that expert); a slot that does not
    is named, and with ``enforce`` the daemon is dirty from its start, as after a damaged load."""
    if restore.restored_from is None or record.content is None or record.dirty is not None:
        return
    problems = committed_content_problems(
        restore.physical_to_logical_map, record.content, restore.known
    )
    if not problems:
        return
    problem = (
        f"the weights loaded into the {restore.restored_from.describe()} do not hold what the "
        f"ledger recorded for those experts: " + "; ".join(problems.values())
    )
    if mode is ContentCheck.ENFORCE:
        record.mark_content_dirty(
            sorted(problems),
            problem + "; restart the daemon (with --expert-layout-restore initial if the "
            "checkpoint's weights changed)",
        )
        logger.error(
            "expert layout is dirty from the start, fetch_state and begin are refused: %s", problem
        )
    else:
        logger.warning("%s (content check warn: serving anyway)", problem)
