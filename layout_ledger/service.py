"""The daemon side of PROTOCOL.md: request dicts in, reply dicts out.

``LayoutService`` knows nothing about sockets or sglang; ``sglang_integration`` feeds it the
requests that arrive on the daemon's control socket, keeps an attach connection open when
``attach`` answers ``ok``, and calls ``detach`` when that connection reaches EOF.

Policy that lives here and nowhere else:
- which status a refusal gets (``busy`` / ``refused`` / ``no_record`` / ``layout_refused`` /
  ``error``), and that every non-``ok`` reply carries a ``reason``;
- that a refused or busy request appends exactly one ``*_refused`` / ``begin_busy`` event and
  changes nothing else (the record's rules already guarantee the "nothing else");
- that a daemon without a record answers attach and query with ``no_record`` and refuses
  begin, commit and abort.
"""

from __future__ import annotations

import logging
from typing import Any

from layout_ledger import protocol as msg
from layout_ledger.errors import LedgerError, MoveBusy, RequestRefused
from layout_ledger.record import LayoutRecord

logger = logging.getLogger(__name__)

NO_RECORD_REASON = (
    "this daemon keeps no expert layout record (it was started without --enable-eplb); engines "
    "start with their own initial layout and must not move the shared experts"
)

Reply = dict[str, Any]


def _reply(status: str, reason: str | None = None, **fields: Any) -> Reply:
    reply: Reply = {"status": status, **fields}
    if reason is not None:
        reply["reason"] = reason
    return reply


def _storage_failure(exc: LedgerError) -> Reply:
    return _reply(
        msg.ERROR,
        f"the daemon could not record this request in its expert layout ledger, so it was not "
        f"applied: {exc}; check the ledger's disk, then retry",
    )


class LayoutService:
    """Answers the expert layout requests for one daemon (``record`` is None without a record)."""

    def __init__(self, record: LayoutRecord | None) -> None:
        self.record = record

    # --- the five expert_layout_* requests ------------------------------------------------

    def handle(self, request: dict[str, Any]) -> Reply:
        """Answer one request whose ``type`` is in ``protocol.LAYOUT_REQUEST_TYPES``."""
        kind = request.get("type")
        handlers = {
            msg.ATTACH: self._attach,
            msg.QUERY: self._query,
            msg.BEGIN: self._begin,
            msg.COMMIT: self._commit,
            msg.ABORT: self._abort,
        }
        handler = handlers.get(kind) if isinstance(kind, str) else None
        if handler is None:
            return _reply(msg.ERROR, f"not an expert layout request: {kind!r}")
        return handler(request)

    def _attach(self, request: dict[str, Any]) -> Reply:
        record = self.record
        if record is None:
            return _reply(msg.NO_RECORD, NO_RECORD_REASON)
        engine_id = request.get("engine_id")
        try:
            state = record.attach(engine_id)
        except RequestRefused as exc:
            return self._refused("attach", engine_id, exc)
        except LedgerError as exc:
            return _storage_failure(exc)
        logger.info("engine %r attached at layout version %d", engine_id, state.version)
        return msg.layout_reply(state.view())

    def _query(self, request: dict[str, Any]) -> Reply:
        if self.record is None:
            return _reply(msg.NO_RECORD, NO_RECORD_REASON)
        return msg.layout_reply(self.record.snapshot().view())

    def _begin(self, request: dict[str, Any]) -> Reply:
        record = self.record
        engine_id = request.get("engine_id")
        if record is None:
            return _reply(msg.REFUSED, NO_RECORD_REASON)
        try:
            record.begin(engine_id, request.get("base_version"), request.get("layers"))
        except MoveBusy as exc:
            self._note(record, "begin", engine_id, str(exc), busy=True)
            return _reply(msg.BUSY, str(exc))
        except RequestRefused as exc:
            return self._refused("begin", engine_id, exc)
        except LedgerError as exc:
            return _storage_failure(exc)
        return _reply(msg.OK)

    def _commit(self, request: dict[str, Any]) -> Reply:
        record = self.record
        engine_id = request.get("engine_id")
        if record is None:
            return _reply(msg.REFUSED, NO_RECORD_REASON)
        try:
            version, digest = record.commit(engine_id, request.get("rows"))
        except RequestRefused as exc:
            return self._refused("commit", engine_id, exc)
        except LedgerError as exc:
            return _storage_failure(exc)
        logger.info("engine %r committed layout version %d", engine_id, version)
        return _reply(msg.OK, version=version, digest=digest)

    def _abort(self, request: dict[str, Any]) -> Reply:
        record = self.record
        engine_id = request.get("engine_id")
        if record is None:
            return _reply(msg.REFUSED, NO_RECORD_REASON)
        try:
            record.abort(engine_id)
        except RequestRefused as exc:
            return self._refused("abort", engine_id, exc)
        except LedgerError as exc:
            return _storage_failure(exc)
        return _reply(msg.OK)

    # --- fetch_state and presence --------------------------------------------------------

    def check_fetch(self, request: dict[str, Any]) -> Reply | None:
        """The ``fetch_state`` layout check: None to serve, else the ``layout_refused`` reply."""
        record = self.record
        if record is None:
            return None
        field = request.get(msg.FETCH_LAYOUT_FIELD)
        engine_id = field.get("engine_id") if isinstance(field, dict) else None
        try:
            verdict = record.fetch(field)
        except RequestRefused as exc:
            self._note(record, "fetch", engine_id, str(exc))
            logger.warning("refused a weight fetch: %s", exc)
            return _reply(msg.LAYOUT_REFUSED, str(exc))
        except LedgerError as exc:
            # Serving would be unrecorded; refusing is the safe side.
            return _reply(msg.LAYOUT_REFUSED, _storage_failure(exc)["reason"])
        if not verdict.following:
            logger.warning(
                "served weights to an engine that does not follow the expert layout (%s); no "
                "engine may move experts until this daemon restarts",
                verdict.reason,
            )
        return None

    def detach(self, engine_id: str, reason: str = "attach connection closed (EOF)") -> None:
        """An engine's attach connection closed, however the engine exited."""
        record = self.record
        if record is None:
            return
        mark = record.detach(engine_id, reason)
        if mark is None:
            logger.info("engine %r detached", engine_id)
        else:
            logger.error("expert layout is now dirty: %s", mark.reason)

    # --- refusals -------------------------------------------------------------------------

    def _refused(self, verb: str, engine_id: Any, exc: RequestRefused) -> Reply:
        record = self.record
        if record is not None:
            self._note(record, verb, engine_id, str(exc))
        return _reply(msg.REFUSED, str(exc))

    @staticmethod
    def _note(
        record: LayoutRecord, verb: str, engine_id: Any, reason: str, *, busy: bool = False
    ) -> None:
        try:
            record.record_refusal(verb, engine_id, reason, busy=busy)
        except LedgerError as exc:
            logger.error("could not record a refused %s in the ledger: %s", verb, exc)
