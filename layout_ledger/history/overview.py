"""One ledger's latest incarnation as the whole-engine commands see it (``fleet``, ``metrics``).

``read_overview`` reads, in one read transaction of a ``LedgerReader`` (read-only, never
blocking the daemon), the latest incarnation with its origin, its state as a restarted daemon
would derive it, the counters a monitor wants (commits, refusals by kind, the last commit's
time), and probes whether its daemon runs (``liveness``). ``read_overviews`` reads many and
turns a ledger that cannot be read into an ``UnreadableLedger`` saying why, so one bad file
never hides the others.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from layout_ledger.core import events as ev
from layout_ledger.core.errors import LedgerError, LedgerFileError
from layout_ledger.core.state import LayoutState
from layout_ledger.history.liveness import Liveness, daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.replay import read_state
from layout_ledger.store.rows import Incarnation, in_list, incarnation

# The refusal event kinds an overview counts (each ``*_refused``, and the busy begin).
REFUSAL_KINDS: tuple[str, ...] = (
    *(ev.refused_kind(verb) for verb in ev.REFUSABLE_VERBS),
    ev.BEGIN_BUSY,
)


@dataclass(frozen=True)
class LedgerOverview:
    """A ledger's latest incarnation: who wrote it, its state, counters, and liveness."""

    path: str
    incarnation: Incarnation
    state: LayoutState
    liveness: Liveness
    commits: int  # commit events in this incarnation
    refusals: Mapping[str, int]  # REFUSAL_KINDS -> how many (coalesced rows counted in full)
    last_commit_at: str  # when the current version was recorded (version 0: the start)


@dataclass(frozen=True)
class UnreadableLedger:
    """A path whose ledger cannot be read, and why (the reader's message)."""

    path: str
    problem: str


def read_overview(path: str | os.PathLike[str]) -> LedgerOverview:
    """The latest incarnation of the ledger at ``path``; raises what the reader raises."""
    with LedgerReader(Path(path)) as ledger, ledger.connect() as conn:
        inc = incarnation(conn)
        state = read_state(conn, inc.incarnation_id)
        return LedgerOverview(
            path=os.fspath(path),
            incarnation=inc,
            state=state,
            liveness=daemon_liveness(path, inc, latest=True),
            commits=_commits(conn, inc.incarnation_id),
            refusals=_refusals(conn, inc.incarnation_id),
            last_commit_at=_last_commit_at(conn, inc.incarnation_id),
        )


def read_overviews(paths: Sequence[Path]) -> list[LedgerOverview | UnreadableLedger]:
    """Each ledger's overview, or why it cannot be read; in the order given."""
    read: list[LedgerOverview | UnreadableLedger] = []
    for path in paths:
        try:
            read.append(read_overview(path))
        except LedgerError as exc:
            read.append(UnreadableLedger(os.fspath(path), str(exc)))
        except (SQLAlchemyError, json.JSONDecodeError) as exc:
            problem = (
                f"the ledger {path} looks damaged ({type(exc).__name__}: {exc}); run "
                f"`layout-ledger verify {path}`"
            )
            read.append(UnreadableLedger(os.fspath(path), problem))
    return read


def require_one_readable(read: Sequence[LedgerOverview | UnreadableLedger]) -> None:
    """With no ledger readable there is nothing to show: raise why the first one is not."""
    unreadable = [item for item in read if isinstance(item, UnreadableLedger)]
    if unreadable and len(unreadable) == len(read):
        more = f" (and {len(unreadable) - 1} more unreadable)" if len(unreadable) > 1 else ""
        raise LedgerFileError(unreadable[0].problem + more)


def _commits(conn: Connection, incarnation_id: int) -> int:
    count = conn.execute(
        text("SELECT count(*) FROM events WHERE incarnation_id = :i AND kind = :k"),
        {"i": incarnation_id, "k": ev.COMMIT},
    ).scalar()
    return int(count or 0)


def _refusals(conn: Connection, incarnation_id: int) -> dict[str, int]:
    counted = {kind: 0 for kind in REFUSAL_KINDS}
    marks, kinds = in_list("kind", REFUSAL_KINDS)
    rows = conn.execute(
        text(
            "SELECT kind, sum(count) FROM events WHERE incarnation_id = :i "
            f"AND kind IN {marks} GROUP BY kind"
        ),
        {"i": incarnation_id, **kinds},
    )
    for kind, count in rows:
        counted[str(kind)] = int(count or 0)
    return counted


def _last_commit_at(conn: Connection, incarnation_id: int) -> str:
    at = conn.execute(
        text(
            "SELECT committed_at FROM versions WHERE incarnation_id = :i "
            "ORDER BY version DESC LIMIT 1"
        ),
        {"i": incarnation_id},
    ).scalar()
    return str(at)
