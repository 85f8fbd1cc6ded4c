"""The daemon side of the protocol (docs/protocol.md): request dicts in, reply dicts out.

``LayoutService`` is one table from request type to the record's transition (``TRANSITIONS``)
and one mapping from what a transition raises to a status: ``MoveBusy`` -> ``busy``,
``RequestRefused`` -> ``refused`` (``layout_refused`` for a fetch), any other ``LedgerError``
(the ledger could not record the change, so it was not applied) -> ``error``. The record checks
every rule and writes a refusal's one event; a daemon without a record answers attach, query and
content check with ``no_record`` and refuses the rest. No sockets, no sglang: the daemon's hooks
feed it requests and call ``detach`` when an attach connection reaches EOF.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import HealFailed, LedgerError, MoveBusy, RequestRefused
from layout_ledger.core.record import EOF_DETACH, LayoutRecord
from layout_ledger.core.reloads import ReloadFailed
from layout_ledger.core.rules import NO_CONTENT_RECORD, lease_holders
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.healing import Healing

logger = logging.getLogger(__name__)

NO_RECORD_REASON = (
    "this daemon keeps no expert layout record (it was started without --enable-eplb); engines "
    "start with their own initial layout and must not move the shared experts"
)

Reply = dict[str, Any]
Request = dict[str, Any]


class ContentSource(Protocol):
    """A daemon's own slots: their fingerprints now, on the tensors' device (commits, content
    checks and repairs compare them with the record)."""

    def fingerprints(self, layers: Sequence[int] | None = None) -> LocalFingerprints:
        """Every layer with routed-expert tensors when ``layers`` is None."""


def _storage_failure(exc: LedgerError) -> str:
    return (
        f"the daemon could not record this request in its expert layout ledger, so it was not "
        f"applied: {exc}; check the ledger's disk, then retry"
    )


# --- the expert_layout_* requests: one transition each ---------------------------------------


def _attach(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    engine_id = request.get("engine_id")
    with record.lock:  # the reply shows the state this attach left
        role = record.attach(engine_id, request.get(msg.ROLE_FIELD))
        state = record.state()
    logger.info("engine %r attached as %s at layout version %d", engine_id, role, state.version)
    return msg.attach_reply(msg.LayoutView.of(state), role)


def _lease(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    engine_id = request.get("engine_id")
    with record.lock:  # the reply names the version the lease was granted at
        granted = record.lease(engine_id)
        version, digest = record.version, record.digest
    if granted:
        logger.info("standby %r took its lease at layout version %d", engine_id, version)
    return msg.lease_reply(version, digest)


def _release(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    engine_id = request.get("engine_id")
    if record.release(engine_id):
        logger.info("standby %r released its lease", engine_id)
    return msg.ok_reply()


def _query(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    return msg.layout_reply(msg.LayoutView.of(record.state()))


def _begin(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    record.begin(request.get("engine_id"), request.get("base_version"), request.get("layers"))
    return msg.ok_reply()


def _commit(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    engine_id = request.get("engine_id")
    fingerprints_of = None if content is None else content.fingerprints
    version, digest = record.commit(engine_id, request.get("rows"), fingerprints_of)
    logger.info("engine %r committed layout version %d", engine_id, version)
    if record.dirty is not None and record.dirty.content is not None:
        logger.error("expert layout is now dirty: %s", record.dirty.reason)
    return msg.Committed(version, digest).to_wire()


def _abort(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    record.abort(request.get("engine_id"))
    return msg.ok_reply()


def _content_check(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    if content is None or record.content is None:
        return msg.refusal_reply(msg.NO_RECORD, NO_CONTENT_RECORD)
    was_dirty = record.dirty is not None
    found = record.content_check(content.fingerprints)
    if found.dirty and not was_dirty:
        logger.error("expert layout is now dirty: %s", found.dirty_reason)
    return msg.content_reply(msg.ContentView.of(found))


def _repair(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    engine_id = request.get("engine_id")
    fingerprints_of = None if content is None else content.fingerprints
    version, digest = record.repair(
        engine_id,
        request.get("rows"),
        request.get("fingerprints"),
        fingerprints_of,
        expected_fingerprints=request.get(msg.EXPECTED_FINGERPRINTS),
    )
    logger.warning(
        "engine %r repaired the expert layout: the weights of the unfinished move's layers were "
        "recorded as version %d (checked against this daemon's own fingerprints); clean again",
        engine_id,
        version,
    )
    return msg.Committed(version, digest).to_wire()


def _cordon(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    cordon = record.cordon_moves(request.get("reason"))
    logger.warning(
        "cordoned by the operator since %s (%s): every begin is answered busy until "
        "uncordon or a restart",
        cordon.since,
        cordon.reason,
    )
    return msg.cordon_reply(msg.CordonView.of(cordon))


def _uncordon(record: LayoutRecord, request: Request, content: ContentSource | None) -> Reply:
    lifted = record.uncordon()
    if lifted is not None:
        logger.warning("the operator lifted the cordon of %s (%s)", lifted.since, lifted.reason)
    return msg.cordon_reply(msg.CordonView.of(None))


Transition = Callable[[LayoutRecord, Request, "ContentSource | None"], Reply]

TRANSITIONS: dict[str, Transition] = {
    msg.ATTACH: _attach,
    msg.QUERY: _query,
    msg.BEGIN: _begin,
    msg.COMMIT: _commit,
    msg.ABORT: _abort,
    msg.CONTENT_CHECK: _content_check,
    msg.REPAIR: _repair,
    msg.CORDON: _cordon,
    msg.UNCORDON: _uncordon,
    msg.LEASE: _lease,
    msg.RELEASE: _release,
}
# Without a record, these answer no_record; the others (begin, commit, abort, repair, lease,
# release) are refused. (A daemon without a record moves no expert, so a cordon has nothing to
# stop.)
_NO_RECORD_STATUS = {
    msg.ATTACH: msg.NO_RECORD,
    msg.QUERY: msg.NO_RECORD,
    msg.CONTENT_CHECK: msg.NO_RECORD,
    msg.CORDON: msg.NO_RECORD,
    msg.UNCORDON: msg.NO_RECORD,
}


class LayoutService:
    """Answers the expert layout requests for one daemon (``record`` is None without a record).

    ``healing``: the daemon's reloads from its checkpoint (``expert_layout_reload``,
    ``expert_layout_heal`` and the heal it starts by itself); None: it cannot reload.
    """

    def __init__(
        self,
        record: LayoutRecord | None,
        content: ContentSource | None = None,
        healing: Healing | None = None,
    ) -> None:
        self.record = record
        self.content = content
        self.healing = (
            healing
            if healing is not None
            else Healing.unavailable_because("this daemon has no checkpoint reloader")
        )
        self._own: dict[str, Callable[[LayoutRecord, Request], Reply]] = {
            msg.RELOAD: self._reload,
            msg.HEAL: self._heal,
        }

    def handle(self, request: Request) -> Reply:
        """Answer one request whose ``type`` is in ``protocol.LAYOUT_REQUEST_TYPES``."""
        kind = request.get("type")
        transition = TRANSITIONS.get(kind) if isinstance(kind, str) else None
        own = self._own.get(kind) if isinstance(kind, str) else None
        if transition is None and own is None:
            return msg.refusal_reply(msg.ERROR, f"not an expert layout request: {kind!r}")
        if self.record is None:
            return msg.refusal_reply(
                _NO_RECORD_STATUS.get(str(kind), msg.REFUSED), NO_RECORD_REASON
            )
        try:
            if own is not None:
                return own(self.record, request)
            if transition is None:  # one of the two above; for the type checker
                raise LedgerError(f"no transition for {kind!r}")
            reply = transition(self.record, request, self.content)
            if kind in (msg.COMMIT, msg.CONTENT_CHECK):
                self.heal_if_safe()  # a commit or check that found content it does not expect
            return reply
        except (ReloadFailed, HealFailed) as exc:
            return msg.refusal_reply(
                msg.ERROR if isinstance(exc, ReloadFailed) else msg.REFUSED, str(exc)
            )
        except MoveBusy as exc:
            return msg.refusal_reply(msg.BUSY, str(exc))
        except RequestRefused as exc:
            return msg.refusal_reply(msg.REFUSED, str(exc))
        except LedgerError as exc:
            return msg.refusal_reply(msg.ERROR, _storage_failure(exc))

    # --- fetch_state and presence --------------------------------------------------------

    def check_fetch(self, request: Request) -> Reply | None:
        """The ``fetch_state`` layout check: None to serve, else the ``layout_refused`` reply."""
        record = self.record
        if record is None:
            return None
        field = request.get(msg.FETCH_LAYOUT_FIELD)
        try:
            verdict = record.fetch(field)
        except RequestRefused as exc:
            logger.warning("refused a weight fetch: %s", exc)
            return msg.refusal_reply(msg.LAYOUT_REFUSED, str(exc))
        except LedgerError as exc:
            # Serving would be unrecorded; refusing is the safe side.
            return msg.refusal_reply(msg.LAYOUT_REFUSED, _storage_failure(exc))
        if not verdict.following:
            logger.warning(
                "served weights to an engine that does not follow the expert layout (%s); no "
                "engine may move experts until this daemon restarts",
                verdict.reason,
            )
        return None

    def detach(self, engine_id: str, reason: str = EOF_DETACH) -> None:
        """An engine's attach connection closed, however the engine exited."""
        record = self.record
        if record is None:
            return
        mark = record.detach(engine_id, reason)
        if mark is None:
            logger.info("engine %r detached", engine_id)
        else:
            logger.error("expert layout is now dirty: %s", mark.reason)
        self.heal_if_safe()

    # --- reloads from the checkpoint -------------------------------------------------------

    def _reload(self, record: LayoutRecord, request: Request) -> Reply:
        engine_id = request.get("engine_id")
        healing = self.healing
        try:
            version, _, report = record.reload(
                engine_id,
                base_version=request.get("base_version"),
                version=request.get("version"),
                digest=request.get("digest"),
                physical_to_logical_map=request.get("physical_to_logical_map"),
                reloader=healing.reloader,
                cannot_reload=healing.cannot_reload,
            )
        finally:
            # A reload that failed, or whose engine left during it, leaves the daemon dirty; a
            # heal it started meanwhile was refused while the reload ran.
            if record.dirty is not None:
                self.heal_if_safe()
        logger.warning(
            "engine %r had this daemon reload its slots from the checkpoint into version %d (%s)",
            engine_id,
            version,
            "no local slot changed" if report is None else report.describe(),
        )
        return msg.layout_reply(msg.LayoutView.of(record.state()))

    def _heal(self, record: LayoutRecord, request: Request) -> Reply:
        report = record.heal(self.healing.reloader, self.healing.cannot_reload)
        logger.warning(
            "healed from the checkpoint as asked: %s; clean again at version %d",
            report.describe(),
            record.version,
        )
        return msg.layout_reply(msg.LayoutView.of(record.state()))

    def heal_if_safe(self) -> bool:
        """With heal ``auto``: heal a dirty daemon now (on its own thread, so the caller, an
        attach watcher or a request, does not wait) when no live engine can be routing with the
        slots it rewrites: no engine holds a lease, and, for a content mark, no non-following
        fetch was served. Otherwise log that it waits for ``layout-ledger heal``. Returns
        whether a heal started."""
        record = self.record
        healing = self.healing
        if record is None or not healing.auto:
            return False
        with record.lock:
            dirty = record.dirty
            if (
                dirty is None
                or record.pending is not None
                or record.reloading is not None
                or healing.cannot_reload is not None
            ):
                return False
            holders = lease_holders(record)
            if holders or (dirty.content is not None and record.non_following_fetch):
                why = (
                    f"engines {', '.join(holders)} may be routing with its slots"
                    if holders
                    else "an engine that does not follow the layout fetched its weights"
                )
                logger.warning(
                    "dirty, not healing by itself: %s; heal it with `layout-ledger heal SOCKET` "
                    "once they are gone, or restart it",
                    why,
                )
                return False
        healing.start(self._auto_heal)
        return True

    def _auto_heal(self) -> None:
        record = self.record
        if record is None:
            return
        try:
            report = record.heal(self.healing.reloader, self.healing.cannot_reload)
        except HealFailed as exc:
            logger.error("%s", exc)
        except RequestRefused as exc:
            logger.info("no heal: %s", exc)
        except LedgerError as exc:
            logger.error("the heal could not be recorded, the daemon stays dirty: %s", exc)
        else:
            logger.warning(
                "healed itself from the checkpoint: %s; clean again at version %d",
                report.describe(),
                record.version,
            )
