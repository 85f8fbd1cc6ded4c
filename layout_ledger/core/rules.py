"""The protocol's rules, one pure function per request, each raising the refusal it names.

``LayoutRecord`` calls them under its lock before it writes anything, so a refused request can
never change the record; it checks the engine id a request names first, once
(``check_request_engine_id``; a replay, ``check_engine_id``). ``check_begin`` checks every
permanent refusal before its busy conditions ("a begin that would be refused is refused, never
busy", docs/protocol.md); an operator's cordon is one of them. A repair is accepted only at a
daemon dirty because an engine left mid-move, from an attached engine, when every fingerprint it
names is what the daemon's own slots show now and its rows name what the slots hold
(``check_repair``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from layout_ledger.core import errors
from layout_ledger.core.content import (
    UNKNOWN,
    ZERO,
    ExpertContents,
    LocalFingerprints,
    changed_slots,
    differing_parts,
    empty_experts,
    expected_fingerprints_from_wire,
    fingerprints_from_wire,
    replica_disagreements,
    short,
)
from layout_ledger.core.layout import (
    Geometry,
    Map,
    check_row_layers,
    is_int,
    layout_digest,
    validate_layers,
    validate_map,
    validate_rows,
    validate_rows_json,
)
from layout_ledger.core.state import (
    ROLE_ACTIVE,
    ROLES,
    Cordon,
    DirtyMark,
    PendingMove,
    Reloading,
)

MAX_ENGINE_ID = 256
# How many characters of a refused engine id its refusal's reason shows (escaped).
SHOWN_ENGINE_ID_CHARS = 64

# Why a served fetch counts as non-following (the reason its event records).
FETCH_WITHOUT_FIELD = (
    "fetch without the expert_layout field (an engine without the expert layout plugin) while "
    "no expert has moved"
)
FETCH_UNATTACHED = "fetch with a matching layout from an engine with no live attachment"


class StateView(Protocol):
    """What the rules read of a record (``LayoutRecord`` is one)."""

    @property
    def geometry(self) -> Geometry: ...
    @property
    def version(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def pending(self) -> PendingMove | None: ...
    @property
    def dirty(self) -> DirtyMark | None: ...
    @property
    def attached(self) -> Collection[str]: ...
    @property
    def non_following_fetch(self) -> bool: ...
    @property
    def cordon(self) -> Cordon | None: ...
    @property
    def standbys(self) -> Collection[str]: ...
    @property
    def leases(self) -> Collection[str]: ...
    @property
    def reloading(self) -> Reloading | None: ...


def check_engine_id(engine_id: Any) -> str:
    """An engine id is a non-empty string of at most ``MAX_ENGINE_ID`` characters.

    Every transition that names an engine applies it, a replayed one too. A request's id must
    also be printable text (``check_request_engine_id``).
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise errors.InvalidRequest(
            f"engine_id must be a non-empty string, got {type(engine_id).__name__}"
        )
    if len(engine_id) > MAX_ENGINE_ID:
        raise errors.InvalidRequest(
            f"engine_id is {len(engine_id)} characters; at most {MAX_ENGINE_ID} are allowed "
            f"(got {shown_engine_id(engine_id)})"
        )
    return engine_id


def check_request_engine_id(engine_id: Any) -> str:
    """The engine id a request may name: ``check_engine_id``'s, and printable text.

    Printable as Python's ``str.isprintable`` says: no control, format, separator (but the ASCII
    space), surrogate, private-use or unassigned character. Ids travel into the ledger, the
    daemon's log and the operator's terminal, where a newline or an escape sequence would let
    an id forge output. The record applies this to every request that names an engine (attach,
    begin, commit, abort, fetch, repair), first; a replay runs the transitions on the stored
    ids with ``check_engine_id`` only, leaving their text to ``verify`` as it leaves every
    stored text.
    """
    valid_id = check_engine_id(engine_id)
    if not valid_id.isprintable():
        raise errors.InvalidRequest(
            f"engine_id must be printable text (no control, format or line separator "
            f"characters), got {shown_engine_id(valid_id)}"
        )
    return valid_id


def shown_engine_id(engine_id: str) -> str:
    """A refused engine id as a reason shows it: its first characters, escaped to ASCII."""
    shown = ascii(engine_id[:SHOWN_ENGINE_ID_CHARS])
    if len(engine_id) > SHOWN_ENGINE_ID_CHARS:
        shown += f" (the first {SHOWN_ENGINE_ID_CHARS} of {len(engine_id)} characters)"
    return shown


def recordable_engine_id(engine_id: Any) -> str | None:
    """The engine id a refused request's event stores: the id if a request may name it, else
    None (a refused id is never stored; the refusal's reason shows it, ``shown_engine_id``)."""
    try:
        return check_request_engine_id(engine_id)
    except errors.InvalidRequest:
        return None


def check_role(role: Any) -> str:
    """An attach's ``role``: absent (None) is ``active``, as every engine before roles attached;
    else ``active`` or ``standby``."""
    if role is None:
        return ROLE_ACTIVE
    if not isinstance(role, str) or role not in ROLES:
        shown = ascii(role[:32]) if isinstance(role, str) else type(role).__name__
        raise errors.InvalidRequest(f"role must be one of {', '.join(ROLES)}, got {shown}")
    return role


def holds_lease(state: StateView, engine_id: str) -> bool:
    """An attached engine holds an active lease: every active engine always, a standby only
    between its granted lease and its release (or detach)."""
    if engine_id not in state.attached:
        return False
    return engine_id not in state.standbys or engine_id in state.leases


def lease_holders(state: StateView) -> list[str]:
    """The attached engines the one-mover rule counts (``holds_lease``), sorted."""
    return sorted(engine for engine in state.attached if holds_lease(state, engine))


def _holder_text(state: StateView, engine_id: str) -> str:
    return f"{engine_id} (standby with a lease)" if engine_id in state.standbys else engine_id


def check_attach(state: StateView, engine_id: str) -> None:
    """An engine attaches once per engine start."""
    if engine_id in state.attached:
        raise errors.EngineAlreadyAttached(
            f"engine {engine_id!r} is already attached to this daemon; every engine start needs "
            f"a new engine_id (is an older instance of this engine still exiting?)"
        )


def check_begin(
    state: StateView, engine_id: str, base_version: Any, layers: Any
) -> tuple[int, ...]:
    """Return the validated, sorted layers, or raise ``RequestRefused`` / ``MoveBusy``."""
    if state.dirty is not None:
        raise errors.LayoutDirty(f"this daemon's expert layout is unknown: {state.dirty.reason}")
    if engine_id not in state.attached:
        raise errors.EngineNotAttached(
            f"engine {engine_id!r} is not attached; send expert_layout_attach on a connection "
            f"kept open for the engine's lifetime before moving experts"
        )
    pending = state.pending
    if pending is not None and pending.engine_id == engine_id:
        raise errors.MoveAlreadyPending(
            f"engine {engine_id!r} already has a move of layers {list(pending.layers)} pending; "
            f"commit or abort it first"
        )
    if not is_int(base_version):
        raise errors.InvalidRequest(
            f"base_version must be an int, got {type(base_version).__name__}"
        )
    if base_version != state.version:
        raise errors.StaleBaseVersion(
            f"base_version {base_version} is not the current version {state.version}; the "
            f"engine's layout is out of date, restart it so it starts from the daemon's layout"
        )
    valid_layers = validate_layers(layers, state.geometry)
    if state.non_following_fetch:
        raise errors.MovesDisabled(
            "an engine that does not follow the expert layout (no live attachment, or an older "
            "engine without the expert_layout field) has fetched these weights, and the daemon "
            "cannot tell when it exits; no engine may move experts until the daemon restarts"
        )
    if state.cordon is not None:
        raise errors.Cordoned(cordoned_reason(state.cordon))
    if not holds_lease(state, engine_id):
        raise errors.MoveBusy(
            f"engine {engine_id!r} is attached as a standby and holds no lease; a standby "
            f"moves experts only while it serves (expert_layout_lease first), try again later"
        )
    others = [other for other in lease_holders(state) if other != engine_id]
    if others:
        shown = ", ".join(_holder_text(state, other) for other in others)
        raise errors.MoveBusy(
            f"other engines are attached to this daemon ({shown}); only an engine that is the "
            f"one lease holder on its daemon may move experts, try again later"
        )
    if pending is not None:
        raise errors.MoveBusy(
            f"engine {pending.engine_id!r} has a move of layers {list(pending.layers)} pending; "
            f"try again later"
        )
    return valid_layers


def check_reload(
    state: StateView,
    engine_id: str,
    *,
    base_version: Any,
    version: Any,
    digest: Any,
    physical_to_logical_map: Any,
    cannot_reload: str | None,
) -> Map:
    """``expert_layout_reload``: begin's rules (the one-mover rule included; what would be busy
    is refused, the reply has no busy), then the new version, map and digest, then whether this
    daemon can reload at all. Returns the validated map; raises ``RequestRefused``."""
    try:
        check_begin(state, engine_id, base_version, [0])
    except errors.MoveBusy as exc:
        raise errors.ReloadRefused(f"{exc} (a reload is never queued: send it again)") from exc
    if not is_int(version) or version <= base_version:
        raise errors.ReloadRefused(
            f"version must be an int above base_version {base_version}, got {version!r}"
        )
    the_map = validate_map(physical_to_logical_map, state.geometry)
    if not isinstance(digest, str) or digest != layout_digest(the_map):
        raise errors.ReloadRefused(
            "digest is not the layout digest of physical_to_logical_map (SHA-256 of its rows, "
            'docs/protocol.md "Terms"); send the digest of the map you send'
        )
    if cannot_reload is not None:
        raise errors.ReloadRefused(
            f"this daemon cannot reload from its checkpoint: {cannot_reload}"
        )
    return the_map


def check_heal(state: StateView, cannot_heal: str | None) -> tuple[int, ...]:
    """A heal (asked, or by the daemon itself): a dirty daemon, no move pending, a daemon that
    can reload. Returns the layers to reload (the unfinished move's, or the content mark's)."""
    dirty = state.dirty
    if dirty is None:
        raise errors.HealRefused(
            "this daemon's expert layout is known (it is not dirty); there is nothing to heal"
        )
    if state.reloading is not None:
        raise errors.HealRefused(
            f"{state.reloading.describe()} now; wait for its end (a heal or heal_failed event, "
            f"or the reload's reply)"
        )
    if state.pending is not None:
        raise errors.HealRefused(
            f"engine {state.pending.engine_id!r} has a move pending; abort it before a heal"
        )
    if cannot_heal is not None:
        raise errors.HealRefused(f"this daemon cannot heal: {cannot_heal}; restart it")
    if dirty.layers:
        return dirty.layers
    raise errors.HealRefused(
        f"this daemon is dirty because {dirty.reason}, naming no layer to reload; restart it"
    )


def check_lease(state: StateView, engine_id: str) -> bool:
    """A standby's lease: True to grant it now, False when it already holds one (``ok``, no
    change). Refused at a dirty daemon and for an engine not attached as a standby (an active
    engine holds its lease from its attach); ``busy`` while any move is pending, so a standby
    never starts serving while weights are in flux."""
    if state.dirty is not None:
        raise errors.LayoutDirty(f"this daemon's expert layout is unknown: {state.dirty.reason}")
    if engine_id not in state.attached:
        raise errors.EngineNotAttached(
            f"engine {engine_id!r} is not attached; attach as a standby before taking a lease"
        )
    if engine_id not in state.standbys:
        raise errors.NotStandby(
            f"engine {engine_id!r} is attached as an active engine, which holds its lease from "
            f"its attach; only a standby takes a lease"
        )
    if engine_id in state.leases:
        return False
    pending = state.pending
    if pending is not None:
        raise errors.MoveBusy(
            f"engine {pending.engine_id!r} has a move of layers {list(pending.layers)} from "
            f"version {pending.base_version} pending; a standby may serve once it commits or "
            f"aborts, try again later"
        )
    return True


def check_release(state: StateView, engine_id: str) -> bool:
    """A standby's release: True when it held a lease (the lease ends), False when there is
    none to end (``ok``, no change). Refused while the engine's own move is pending: its lease
    is what made the move possible, so it ends with the move's commit or abort."""
    if engine_id not in state.attached or engine_id not in state.leases:
        return False
    pending = state.pending
    if pending is not None and pending.engine_id == engine_id:
        raise errors.MoveAlreadyPending(
            f"engine {engine_id!r} has a move of layers {list(pending.layers)} pending; commit "
            f"or abort it before releasing its lease"
        )
    return True


def cordoned_reason(cordon: Cordon) -> str:
    """The reason a begin at a cordoned daemon is answered ``busy`` with."""
    return (
        f"this daemon is cordoned since {cordon.since} ({cordon.reason}): no move may begin "
        f"until `layout-ledger uncordon` (or a daemon restart); try again later"
    )


MAX_CORDON_REASON = 256


def check_cordon_reason(reason: Any) -> str:
    """A cordon's reason: printable text of at most ``MAX_CORDON_REASON`` characters (it reaches
    the ledger, the daemon's log and every busy begin's reason, as an engine id does)."""
    if not isinstance(reason, str) or not reason.strip():
        raise errors.InvalidRequest(
            f"a cordon's reason must be a non-empty string, got {type(reason).__name__}"
        )
    if len(reason) > MAX_CORDON_REASON or not reason.isprintable():
        raise errors.InvalidRequest(
            f"a cordon's reason must be printable text of at most {MAX_CORDON_REASON} "
            f"characters, got {shown_engine_id(reason)}"
        )
    return reason


# The cause of a refused or busy begin, from its reason (the messages above): a bounded label
# for metrics (``layout-ledger metrics``'s begin_refusals_total). The first pattern found names
# it; a reason none matches (an older daemon's wording) is "other".
BEGIN_CAUSES: tuple[tuple[str, str], ...] = (
    ("this daemon is cordoned", "cordoned"),
    ("is attached as a standby and holds no lease", "busy_standby_without_lease"),
    ("expert layout is unknown", "dirty"),
    ("engine_id ", "invalid_engine_id"),
    (" is not attached", "not_attached"),
    (" already has a move of layers", "own_move_pending"),
    ("is not the current version", "stale_base_version"),
    ("an engine that does not follow the expert layout", "non_following_fetch"),
    ("other engines are attached", "busy_other_engine"),
    ("pending; try again later", "busy_other_move"),
    ("base_version", "invalid_request"),
    ("layer", "invalid_layers"),
)
BEGIN_CAUSE_OTHER = "other"


def begin_cause(reason: str | None) -> str:
    """The cause (``BEGIN_CAUSES``) of a refused or busy begin whose reason is ``reason``."""
    text = reason or ""
    for pattern, cause in BEGIN_CAUSES:
        if pattern in text:
            return cause
    return BEGIN_CAUSE_OTHER


def _own_pending(state: StateView, engine_id: str, verb: str) -> PendingMove:
    pending = state.pending
    if pending is None or pending.engine_id != engine_id:
        owner = "" if pending is None else f" (engine {pending.engine_id!r} has the pending move)"
        raise errors.NoPendingMove(
            f"engine {engine_id!r} has no move pending{owner}; send expert_layout_begin before "
            f"expert_layout_{verb}"
        )
    return pending


def check_commit(state: StateView, engine_id: str, rows: Any) -> tuple[PendingMove, dict[int, str]]:
    """The pending move and each valid row's compact JSON text (what the ledger stores)."""
    pending = _committer(state, engine_id)
    return pending, validate_rows_json(rows, pending.layers, state.geometry)


def check_recorded_commit(state: StateView, engine_id: str, layers: Any) -> PendingMove:
    """``check_commit`` for a commit known by its layers alone (a replay of a ledger's history)."""
    pending = _committer(state, engine_id)
    check_row_layers(layers, pending.layers)
    return pending


def _committer(state: StateView, engine_id: str) -> PendingMove:
    if state.dirty is not None:
        raise errors.LayoutDirty(f"this daemon's expert layout is unknown: {state.dirty.reason}")
    pending = _own_pending(state, engine_id, "commit")
    _not_reloading(state, "commit")
    return pending


def check_abort(state: StateView, engine_id: str) -> PendingMove:
    """The engine's own pending move, which an abort ends (not while its reload runs)."""
    pending = _own_pending(state, engine_id, "abort")
    _not_reloading(state, "abort")
    return pending


def _not_reloading(state: StateView, verb: str) -> None:
    """A reload's pending move ends with the reload's own reply, never by a commit or abort."""
    reloading = state.reloading
    if reloading is not None:
        raise errors.NoPendingMove(
            f"{reloading.describe()}; its move ends with the reload's reply, not with "
            f"expert_layout_{verb}"
        )


@dataclass(frozen=True)
class FetchVerdict:
    """A fetch the daemon serves; ``following`` is False for a non-following fetch."""

    following: bool
    engine_id: str | None
    reason: str


def check_fetch(state: StateView, field: Any, engine_id: str | None) -> FetchVerdict:
    """The ``fetch_state`` layout check: serve (following or not) or raise ``RequestRefused``.

    ``engine_id``: the one ``field`` names, checked (None: it names none)."""
    if state.dirty is not None:
        raise errors.LayoutDirty(
            f"this daemon's expert layout is unknown, so its weights cannot be served: "
            f"{state.dirty.reason}"
        )
    if state.pending is not None:
        pending = state.pending
        raise errors.LayoutMismatch(
            f"engine {pending.engine_id!r} is moving layers {list(pending.layers)} from version "
            f"{pending.base_version}; the weights are in flux, retry after it commits or aborts"
        )
    if field is None:
        if state.version == 0:
            return FetchVerdict(following=False, engine_id=None, reason=FETCH_WITHOUT_FIELD)
        raise errors.LayoutMismatch(
            f"this daemon's experts have moved (layout version {state.version}) and the engine "
            f"did not send the expert_layout field, so it would route with the initial layout; "
            f"upgrade the engine (install the expert layout plugin) or restart the daemon"
        )
    if not isinstance(field, dict):
        raise errors.InvalidRequest(
            f"expert_layout must be a dict with engine_id, version and digest, got "
            f"{type(field).__name__}"
        )
    digest = field.get("digest")
    version = field.get("version")
    if not isinstance(digest, str):
        raise errors.InvalidRequest("expert_layout.digest must be the map's SHA-256 hex string")
    if digest != state.digest:
        raise errors.LayoutMismatch(
            f"the engine routes with layout version {version!r} (digest {digest[:12]}...) but "
            f"this daemon holds version {state.version} (digest {state.digest[:12]}...); restart "
            f"the engine so it starts from the daemon's layout"
        )
    if engine_id is not None and engine_id in state.attached:
        return FetchVerdict(following=True, engine_id=engine_id, reason="")
    return FetchVerdict(following=False, engine_id=engine_id, reason=FETCH_UNATTACHED)


# --- content: the load check, the dirty mark, repairs ---------------------------------------------


def check_content_mark(state: StateView) -> None:
    """A content dirty mark needs a daemon whose layout is still known."""
    if state.dirty is not None:
        raise errors.LayoutDirty(f"this daemon's expert layout is unknown: {state.dirty.reason}")


def loaded_content_problems(
    physical_to_logical_map: Sequence[Sequence[int]], local: LocalFingerprints
) -> dict[int, str]:
    """At load: slots the map gives one expert must hold the same bytes, and not zero bytes
    (an all-zero or all -0.0 slot, wherever it is the expert's only copy here): per layer, in
    words."""
    differ = replica_disagreements(physical_to_logical_map, local)
    empty = empty_experts(physical_to_logical_map, local)
    found: dict[int, str] = {}
    for layer in sorted({*differ, *empty}):
        prefix = f"layer {layer}: "
        texts = [of_layer.get(layer, "") for of_layer in (differ, empty)]
        found[layer] = prefix + "; ".join(t.removeprefix(prefix) for t in texts if t)
    return found


def committed_content_problems(
    physical_to_logical_map: Sequence[Sequence[int]],
    local: LocalFingerprints,
    known: ExpertContents,
) -> dict[int, str]:
    """After a move: each moved slot must hold the expert its new row names, as far as this
    daemon knows that expert's content (an expert it never held is learned, not checked)."""
    found: dict[int, str] = {}
    for layer in sorted(local.layers):
        texts = []
        for slot, fingerprint in local.slots(layer):
            named = int(physical_to_logical_map[layer][slot])
            held = known.identify(layer, fingerprint)
            expected = known.fingerprint_of(layer, named)
            wrong_expert = held.whole_expert and not held.is_expert(named)
            if fingerprint == ZERO or wrong_expert or (expected not in (None, fingerprint)):
                texts.append(f"slot {slot} holds {held.text}, not expert {named}")
        if texts:
            found[layer] = f"layer {layer}: " + "; ".join(texts)
    return found


def _repaired_layer_problems(
    layer: int,
    row: Sequence[int],
    local: LocalFingerprints,
    known: ExpertContents,
    carried: Mapping[int, str],
) -> list[str]:
    """What a repaired layer's slots hold that its new ``row`` does not name, in words.

    Each slot must hold whole bytes (not zero-filled, no part of a known expert mixed with
    other bytes), and exactly the fingerprint of the expert ``row`` names there: the one this
    daemon recorded for it, or, for an expert it has no fingerprint of (it never held it), the
    one the repair carries (``carried``: expert -> fingerprint, its ``expected_fingerprints``).
    """
    problems = []
    for slot, fingerprint in local.slots(layer):
        named = int(row[slot])
        held = known.identify(layer, fingerprint)
        where = f"layer {layer} slot {slot}"
        own = known.fingerprint_of(layer, named)
        brought = carried.get(named)
        if fingerprint == ZERO or (not held.whole_expert and held.text != UNKNOWN):
            problems.append(f"{where} holds {held.text}, not a whole expert")
        elif held.whole_expert and not held.is_expert(named):
            problems.append(f"{where} holds {held.text}, not expert {named}")
        elif own is not None and brought is not None and brought != own:
            problems.append(
                f"{where}: the repair's expected fingerprint of expert {named} "
                f"({short(brought)}...) is not the one this daemon recorded ({short(own)}...)"
            )
        elif own is None and brought is None:
            problems.append(
                f"{where}: this daemon has no fingerprint of expert {named} (it never held it); "
                f"a repair naming it must carry it in expected_fingerprints"
            )
        else:
            expected = own if own is not None else brought
            if expected is not None and expected != fingerprint:
                problems.append(
                    f"{where} holds {held.text}, not expert {named} "
                    f"({differing_parts(expected, fingerprint)} differ from its "
                    f"{short(expected)}...)"
                )
    return problems


@dataclass(frozen=True)
class DaemonContent:
    """What a daemon knows of its slots' content: recorded, found now, and every expert's."""

    recorded: LocalFingerprints
    current: LocalFingerprints
    known: ExpertContents


def check_repair(
    state: StateView,
    engine_id: str,
    rows: Any,
    fingerprints: Any,
    content: DaemonContent | None,
    *,
    expected_fingerprints: Any = None,
) -> tuple[PendingMove, dict[int, list[int]], LocalFingerprints]:
    """A repair: the dirty move's layers, rows and fingerprints the daemon's own content shows.

    In order: an attached engine, at a daemon dirty because an engine left mid-move (no other
    cause); a daemon that records slot fingerprints (``content``, None when it records none);
    valid rows of exactly the move's layers; for each of those layers with fingerprints, every
    fingerprint the repair names equal to the one the daemon's slot shows now; no slot outside
    them changed since the record; and rows that name the expert each slot holds, whole, by its
    fingerprint (``_repaired_layer_problems``), and keep every logical expert in a slot.
    Only the protocol's shapes: int layer keys, lists of ints and of fingerprints. Returns the
    dirty move, the validated rows and the fingerprints; raises ``RequestRefused``.
    """
    move = _repairable(state, engine_id)
    if content is None:
        raise errors.NoContentRecord(NO_CONTENT_RECORD)
    valid_rows = validate_rows(rows, move.layers, state.geometry)
    for layer in move.layers:
        _check_repaired_row(layer, rows[layer], valid_rows[layer], state.geometry)
    carried = expected_fingerprints_from_wire(
        expected_fingerprints, move.layers, state.geometry.num_logical_experts
    )
    fingerprinted = [layer for layer in move.layers if layer in content.recorded.layers]
    first, count = content.recorded.first_slot, local_slot_count(content.recorded)
    claimed = fingerprints_from_wire(fingerprints, fingerprinted, first, count)
    for layer in fingerprinted:
        for (slot, said), found in zip(
            claimed.slots(layer), content.current.layers[layer], strict=True
        ):
            if said != found:
                raise errors.ContentMismatch(
                    f"layer {layer} slot {slot}: the repair says {short(said)}... but "
                    f"this daemon's slot holds {short(found)}...; the content changed, or the "
                    f"engine read other weights"
                )
    moved = changed_slots(content.recorded, content.current, skip=move.layers)
    if moved:
        layer, indexes = next(iter(moved.items()))
        raise errors.ContentMismatch(
            f"content outside the pending layers moved without a commit (layer {layer} slots "
            f"{[first + index for index in indexes]}); a repair records only the pending layers, "
            f"restart the daemon"
        )
    problems = [
        text
        for layer in fingerprinted
        for text in _repaired_layer_problems(
            layer, valid_rows[layer], claimed, content.known, carried.get(layer, {})
        )
    ]
    if problems:
        raise errors.ContentMismatch(
            "the repair's rows do not name what the slots hold: " + "; ".join(problems[:8])
        )
    return move, valid_rows, claimed


def _check_repaired_row(layer: int, raw: Any, row: Sequence[int], geometry: Geometry) -> None:
    """A repaired row is a list (the protocol's shape) and a valid layout: every logical expert
    keeps a slot (the daemon records the whole row, other daemons' slots too)."""
    if not isinstance(raw, list):
        raise errors.InvalidRequest(
            f"row of layer {layer} must be a list of ints, got {type(raw).__name__}"
        )
    absent = sorted(set(range(geometry.num_logical_experts)) - set(row))
    if absent:
        raise errors.InvalidRequest(
            f"row of layer {layer} leaves experts {absent[:16]} without a slot; a repaired layout "
            f"keeps every logical expert in at least one slot"
        )


def check_recorded_repair(state: StateView, engine_id: str, layers: Any) -> PendingMove:
    """``check_repair`` for a repair known by its layers alone (a replay of a ledger's history)."""
    move = _repairable(state, engine_id)
    check_row_layers(layers, move.layers)
    return move


def _repairable(state: StateView, engine_id: str) -> PendingMove:
    """The move a repair may record: the one an engine left unfinished (the only repairable
    dirty mark), repaired by an attached engine."""
    if engine_id not in state.attached:
        raise errors.EngineNotAttached(
            f"engine {engine_id!r} is not attached; attach before repairing the layout"
        )
    if state.reloading is not None:
        raise errors.NotRepairable(
            f"{state.reloading.describe()}: its slots are being rewritten; repair once it ends"
        )
    dirty = state.dirty
    if dirty is None:
        raise errors.NothingToRepair(
            "this daemon's expert layout is known (it is not dirty); there is nothing to repair"
        )
    if dirty.move is None:
        raise errors.NotRepairable(
            f"this daemon is dirty because {dirty.reason}; a repair only records the layout an "
            f"engine's unfinished move left, restart the daemon"
        )
    return dirty.move


def local_slot_count(local: LocalFingerprints) -> int:
    """How many local slots ``local`` covers per layer."""
    return len(next(iter(local.layers.values()), ()))


NO_CONTENT_RECORD = (
    "this daemon records no slot fingerprints (it runs with --expert-layout-content-check off, "
    "or serves no expert tensors), so it cannot check the content of its slots"
)
