"""Event kinds, and the event every change of a record appends (one row of ``events``).

The record builds each ``Event``, its journal appends it, and a replay turns it back into the
transition that wrote it. The kinds are part of the file format and of the forensic views
(``ledger_events``), so they never change in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

START = "start"  # a daemon incarnation began (its first version recorded: 0, or the restored one)
# Right after a start: the incarnation loaded its weights into an earlier incarnation's newest
# committed version (``state.RestoredFrom``) and starts at that version's number and digest.
RESTORE = "restore"
# Right after a restore (same transaction): the restored version's weights come from another
# checkpoint than the one this ledger's latest incarnation loaded (its reason names both
# identities); the slots are judged against that checkpoint's clean baseline, or, without one,
# by a first load's checks, and the loaded fingerprints become its new baseline. A version
# keeps its number and digest across it (they name the map, never the weights).
CHECKPOINT_CHANGED = "checkpoint_changed"
END = "end"  # the incarnation ended (clean shutdown, or found unended at the next start)
ATTACH = "attach"
DETACH = "detach"
BEGIN = "begin"
COMMIT = "commit"
ABORT = "abort"
DIRTY = "dirty"  # an engine detached while its move was pending
# Slot content that is not what the record says (a load that left a replica unfilled, content
# that moved without a commit): the layout is unknown, as after DIRTY.
CONTENT_DIRTY = "content_dirty"
# An engine recorded the layout the weights of a dirty daemon's pending layers hold (a new
# version, verified against the daemon's own fingerprints), which clears the dirty mark.
REPAIR = "repair"
# An attached engine, alone on the daemon, had it reload some local slots from its checkpoint
# into a new map (``expert_layout_reload``): the version jumps from ``base_version`` to
# ``new_version``; its intent is the ``begin`` before it (so a kill mid-reload leaves a move
# pending). The reason carries the slots, bytes read and seconds.
RELOAD = "reload"
# A dirty daemon reloaded the dirty layers' local slots from its checkpoint into its committed
# layout and every reloaded slot holds what the record names: clean again, at the same version
# and digest. HEAL_FAILED: it tried, the reason says why it is still dirty.
HEAL = "heal"
HEAL_FAILED = "heal_failed"
NON_FOLLOWING_FETCH = "non_following_fetch"
PRUNE = "prune"
# An operator cordoned the daemon (every begin answered busy) or lifted the cordon; a daemon
# restart clears it (a new incarnation starts uncordoned).
CORDON = "cordon"
UNCORDON = "uncordon"
# A standby took its lease (it serves from now on: the one-mover rule counts it) or ended it
# (its release; a detach ends it too, without a RELEASE event).
LEASE = "lease"
RELEASE = "release"
BEGIN_BUSY = "begin_busy"
LEASE_BUSY = "lease_busy"  # a lease asked for while a move was pending
# A refused request appends "<verb>_refused" (one of REFUSABLE_VERBS) and nothing else; a begin
# or lease that is only busy appends BEGIN_BUSY or LEASE_BUSY.
REFUSED_SUFFIX = "_refused"
REFUSABLE_VERBS = (
    "attach",
    "begin",
    "commit",
    "abort",
    "fetch",
    "repair",
    "cordon",
    "lease",
    "release",
    "reload",
    "heal",
)
BUSY_KINDS = {"begin": BEGIN_BUSY, "lease": LEASE_BUSY}

# An attach event's reason names the engine's role when it is not the default (``active``,
# NULL: what every attach before roles recorded): ``ledger_attachments.role`` reads it.
STANDBY_ATTACH_REASON = "role: standby"

ALL_KINDS: tuple[str, ...] = (
    START,
    END,
    RESTORE,
    CHECKPOINT_CHANGED,
    ATTACH,
    DETACH,
    BEGIN,
    COMMIT,
    ABORT,
    DIRTY,
    CONTENT_DIRTY,
    REPAIR,
    RELOAD,
    HEAL,
    HEAL_FAILED,
    NON_FOLLOWING_FETCH,
    PRUNE,
    CORDON,
    UNCORDON,
    LEASE,
    RELEASE,
    BEGIN_BUSY,
    LEASE_BUSY,
    *(verb + REFUSED_SUFFIX for verb in REFUSABLE_VERBS),
)

MAX_TEXT = 1024  # events store at most this many characters of an engine id or a reason


def refused_kind(verb: str) -> str:
    """The kind of the event a refused ``verb`` appends (``attach_refused``, ...)."""
    if verb not in REFUSABLE_VERBS:
        raise ValueError(f"unknown verb {verb!r}; expected one of {REFUSABLE_VERBS}")
    return verb + REFUSED_SUFFIX


def busy_kind(verb: str) -> str:
    """The kind of the event a busy ``verb`` (begin or lease) appends."""
    if verb not in BUSY_KINDS:
        raise ValueError(f"{verb!r} is never busy; expected one of {tuple(BUSY_KINDS)}")
    return BUSY_KINDS[verb]


def is_refusal(kind: str) -> bool:
    """A refused request's kind, or a busy begin's or lease's: the events identical repeats
    count on."""
    return kind.endswith(REFUSED_SUFFIX) or kind in (BEGIN_BUSY, LEASE_BUSY)


def clip(text: str | None) -> str | None:
    """``text`` cut to ``MAX_TEXT`` characters (ending ``...`` when cut)."""
    if text is None or len(text) <= MAX_TEXT:
        return text
    return text[: MAX_TEXT - 3] + "..."


@dataclass(frozen=True)
class Event:
    """One row of the ``events`` table (``event_id`` and ``incarnation_id`` added on write)."""

    at: str
    kind: str
    engine_id: str | None = None
    layers: tuple[int, ...] | None = None
    base_version: int | None = None
    new_version: int | None = None
    digest_after: str | None = None
    reason: str | None = None

    def layers_json(self) -> str | None:
        return None if self.layers is None else json.dumps(list(self.layers))
