"""Names on the wire: request types and reply statuses of ../PROTOCOL.md, defined once.

Both sides (the daemon's service and the engine's client) import these; a typo in either
would otherwise be a silent protocol split.
"""

from __future__ import annotations

ATTACH = "expert_layout_attach"
QUERY = "expert_layout_query"
BEGIN = "expert_layout_begin"
COMMIT = "expert_layout_commit"
ABORT = "expert_layout_abort"
FETCH_STATE = "fetch_state"

LAYOUT_REQUEST_TYPES = frozenset({ATTACH, QUERY, BEGIN, COMMIT, ABORT})

OK = "ok"
BUSY = "busy"
REFUSED = "refused"
NO_RECORD = "no_record"
LAYOUT_REFUSED = "layout_refused"
ERROR = "error"

# The optional field an engine adds to ``fetch_state``.
FETCH_LAYOUT_FIELD = "expert_layout"

# sglang 0.5.23's daemon answers a request type it does not know with
# {"status": "error", "message": "Unknown request type: ..."}; an engine reads that reply to an
# attach as "older daemon, keeps no record".
UNKNOWN_REQUEST_PREFIX = "Unknown request type"
