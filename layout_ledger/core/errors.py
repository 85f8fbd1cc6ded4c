"""Every error the ledger raises: one root, a subclass per cause, messages that say what to do.

The daemon-side service maps these to protocol replies: ``MoveBusy`` to ``busy``,
``RequestRefused`` to ``refused`` (or ``layout_refused`` for a fetch), anything else to
``error``. The CLI maps them to a one-line message and an exit code.
"""

from __future__ import annotations


class LedgerError(Exception):
    """Root of every error raised by layout_ledger."""


# --- the file and its schema ---------------------------------------------------------------


class LedgerFileError(LedgerError):
    """The ledger file cannot be used: missing, a symlink, owned by another user, not SQLite."""


class LedgerLocked(LedgerError):
    """Another process already owns this ledger for writing.

    ``ledger_path`` and ``holder`` (what the holder wrote into its ``.lock`` note) let each
    caller say what its own reader can do: a second daemon, or a person at the CLI."""

    def __init__(self, message: str, ledger_path: str = "", holder: str = "") -> None:
        super().__init__(message)
        self.ledger_path, self.holder = ledger_path, holder


class SchemaTooNew(LedgerError):
    """The file's schema is newer than this code knows."""


class LedgerInconsistent(LedgerError):
    """The ledger fails ``verify``; a command that would delete evidence refused to run."""


class SchemaOutdated(LedgerError):
    """A read-only opener found an older schema that only a writer may upgrade."""


class SchemaDowngradeRefused(LedgerError):
    """A downgrade would leave rows the older code cannot read; the message says what to do."""


class LedgerStorageError(LedgerError):
    """SQLite failed while reading or writing the ledger (disk full, I/O error, corruption)."""


class DamagedRow(LedgerStorageError):
    """A row the code cannot interpret; the message names its table, row and column."""

    def __init__(self, table: str, row_id: int, column: str, problem: str) -> None:
        self.table, self.row_id, self.column = table, row_id, column
        super().__init__(f"{table} row {row_id}, column {column}: {problem}")


# --- requests the state machine refuses ----------------------------------------------------


class RequestRefused(LedgerError):
    """A permanent refusal: the same request will never succeed against this record."""


class InvalidRequest(RequestRefused):
    """A field is missing, of the wrong type, out of range, duplicated or too large."""


class EngineNotAttached(RequestRefused):
    """The engine named in the request has no live attachment to this daemon."""


class EngineAlreadyAttached(RequestRefused):
    """An engine with this engine_id is already attached."""


class LayoutDirty(RequestRefused):
    """The weights' layout is unknown (an engine left mid-move, or slot content is not what the
    record says) until a repair or a daemon restart."""


class StaleBaseVersion(RequestRefused):
    """A begin named a base version that is not the current one."""


class MoveAlreadyPending(RequestRefused):
    """The engine already has a move pending."""


class NoPendingMove(RequestRefused):
    """A commit or abort arrived without a pending move of this engine."""


class MovesDisabled(RequestRefused):
    """A non-following engine fetched the weights; moves are off until the daemon restarts."""


class LayoutMismatch(RequestRefused):
    """A fetch named a layout other than the daemon's current one."""


class MoveBusy(LedgerError):
    """Try again later: another engine is attached or another engine's move is pending."""


class Cordoned(MoveBusy):
    """A begin while an operator cordons the daemon: busy, it may succeed after the uncordon."""


class NothingToRepair(RequestRefused):
    """A repair arrived at a daemon whose layout is known (it is not dirty)."""


class NotRepairable(RequestRefused):
    """The daemon is dirty for a cause a repair cannot clear (its content disagrees with itself)."""


class NoContentRecord(RequestRefused):
    """The daemon records no slot fingerprints, so it cannot check content."""


class ContentMismatch(RequestRefused):
    """A repair names content the daemon's own fingerprints do not show."""


class NotStandby(RequestRefused):
    """A lease asked for by an engine not attached as a standby (an active engine always holds
    its lease)."""


class ReloadRefused(RequestRefused):
    """An ``expert_layout_reload`` that breaks a rule (docs/protocol.md "reload"); the daemon's
    layout is unchanged."""


class HealRefused(RequestRefused):
    """A heal that cannot run now (not dirty, heal off, a move pending, an engine that may
    route with the slots); the message says what to do."""


class HealFailed(LedgerError):
    """A heal ran and the daemon stays dirty (its ``heal_failed`` event names why)."""
