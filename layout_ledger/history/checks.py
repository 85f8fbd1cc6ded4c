"""``verify``'s checks: is the file intact, and do its rows, versions and events agree?

``collect_verify`` runs them all inside one read transaction (one SQLite snapshot, consistent
while a daemon writes): SQLite's own checks, then per incarnation its version chain, its
digests and its events replayed through the daemon's own rules, and last the events' hash
chain. Each check reports its first inconsistency; the report names the first of all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import Connection, text

from layout_ledger.core import events as ev
from layout_ledger.core.content import is_fingerprint
from layout_ledger.core.errors import DamagedRow, LedgerError
from layout_ledger.core.layout import layout_digest
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store import chain
from layout_ledger.store.baseline import load_was_dirty
from layout_ledger.store.migrate import file_revision
from layout_ledger.store.replay import ReplayMismatch, StoredEvents, replay_incarnation
from layout_ledger.store.rows import (
    Incarnation,
    fingerprints_at,
    incarnation,
    incarnation_rows,
)
from layout_ledger.store.version_walk import WalkInconsistency, check_version_digests


@dataclass(frozen=True)
class CheckResult:
    check: str
    incarnation_id: int | None
    ok: bool
    detail: str

    @property
    def label(self) -> str:
        if self.incarnation_id is None:
            return self.check
        return f"incarnation {self.incarnation_id} {self.check}"


@dataclass(frozen=True)
class VerifyReport:
    # Read-only properties its ``--json`` object shows (``cli.json_shape``).
    json_properties: ClassVar[tuple[str, ...]] = ("ok", "first_inconsistency")

    path: str
    schema_revision: str | None
    checks: tuple[CheckResult, ...]

    @property
    def inconsistencies(self) -> tuple[CheckResult, ...]:
        return tuple(result for result in self.checks if not result.ok)

    @property
    def ok(self) -> bool:
        return not self.inconsistencies

    @property
    def first_inconsistency(self) -> str | None:
        bad = self.inconsistencies
        return None if not bad else f"{bad[0].label}: {bad[0].detail}"


class Inconsistent(Exception):
    """Raised inside one check to stop it at its first inconsistency."""


def _chain_check(conn: Connection) -> CheckResult:
    """Recompute the events' hash chain (``layout_ledger.store.chain.walk``); name the first
    break."""
    walked = chain.walk(conn)
    if walked.broken_at is not None:
        return CheckResult(
            "chain",
            None,
            False,
            f"event #{walked.broken_at}'s chain value does not follow from the rows before it: "
            f"a row at or before it was edited, inserted or deleted",
        )
    return CheckResult("chain", None, True, f"{walked.count} events chained, head {walked.head}")


def _pragma_check(conn: Connection, pragma: str) -> CheckResult:
    rows = conn.exec_driver_sql(f"PRAGMA {pragma}").all()
    if pragma == "integrity_check":
        messages = [str(row[0]) for row in rows]
        if messages == ["ok"]:
            return CheckResult(pragma, None, True, "ok")
        shown = "; ".join(messages[:3])
        more = f" (and {len(messages) - 3} more)" if len(messages) > 3 else ""
        return CheckResult(pragma, None, False, shown + more)
    if not rows:
        return CheckResult(pragma, None, True, "ok")
    table, rowid, parent = rows[0][0], rows[0][1], rows[0][2]
    return CheckResult(
        pragma,
        None,
        False,
        f"{len(rows)} rows point at missing parents; first: {table} rowid {rowid} -> {parent}",
    )


def _check_version_chain(conn: Connection, inc: Incarnation) -> str:
    versions = (
        conn.execute(
            text("SELECT version FROM versions WHERE incarnation_id = :i ORDER BY version"),
            {"i": inc.incarnation_id},
        )
        .scalars()
        .all()
    )
    first = inc.first_version
    if not versions:
        raise Inconsistent(f"no versions at all (not even version {first}, its first)")
    if versions[0] < first:
        raise Inconsistent(
            f"version {versions[0]} comes before version {first}, which the incarnation "
            f"restored and started at"
        )
    # A reload's version jumps from its base_version to its new_version (no version between).
    jumps: dict[int, int] = {
        int(base): int(new)
        for base, new in conn.execute(
            text(
                "SELECT base_version, new_version FROM events WHERE incarnation_id = :i "
                "AND kind = 'reload' ORDER BY event_id"
            ),
            {"i": inc.incarnation_id},
        )
    }
    expected = first
    for version in versions:
        if version != expected:
            missing = expected if version == expected + 1 else f"{expected}..{version - 1}"
            raise Inconsistent(f"version {missing} is missing before version {version}")
        expected = jumps.get(version, version + 1)
    reloads = f" (and {len(jumps)} reload jumps)" if jumps else ""
    return f"versions {first}..{versions[-1]} without gaps{reloads}"


def _check_digests(conn: Connection, inc: Incarnation) -> str:
    initial = conn.execute(
        text("SELECT initial_map FROM incarnations WHERE incarnation_id = :i"),
        {"i": inc.incarnation_id},
    ).scalar()
    if layout_digest(json.loads(str(initial))) != inc.initial_digest:
        raise Inconsistent(
            f"the initial map does not give the recorded initial digest {inc.initial_digest[:12]}"
        )
    start = inc.first_version
    first_digest = conn.execute(
        text("SELECT digest FROM versions WHERE incarnation_id = :i AND version = :v"),
        {"i": inc.incarnation_id, "v": start},
    ).scalar()
    if first_digest is not None and first_digest != inc.initial_digest:
        raise Inconsistent(
            f"version {start} records digest {str(first_digest)[:12]} but the initial digest is "
            f"{inc.initial_digest[:12]}"
        )
    if inc.restored_from is not None and inc.restored_from.digest != inc.initial_digest:
        raise Inconsistent(
            f"the incarnation restored digest {inc.restored_from.digest[:12]} but its initial "
            f"digest is {inc.initial_digest[:12]}"
        )
    try:
        first, last = check_version_digests(conn, inc)
    except WalkInconsistency as exc:
        raise Inconsistent(str(exc)) from exc
    pruned = "" if first in (None, start) else f"; versions {start}..{first - 1} were pruned"
    restored = _check_restored_source(conn, inc)
    return f"digests of versions {first}..{last} recomputed from the rows match{pruned}{restored}"


def _check_restored_source(conn: Connection, inc: Incarnation) -> str:
    """A restore from this ledger names an earlier incarnation's version with the digest that
    incarnation recorded for it: a version number never names two maps along a restore."""
    restored = inc.restored_from
    if restored is None:
        return ""
    if restored.source is not None:
        return f"; restored from {restored.source}, which this ledger cannot check"
    if restored.incarnation >= inc.incarnation_id:
        raise Inconsistent(
            f"it restored incarnation {restored.incarnation}, which is not an earlier one"
        )
    recorded = conn.execute(
        text("SELECT digest FROM versions WHERE incarnation_id = :i AND version = :v"),
        {"i": restored.incarnation, "v": restored.version},
    ).scalar()
    if recorded != restored.digest:
        held = "holds no such version" if recorded is None else f"recorded {str(recorded)[:12]}"
        raise Inconsistent(
            f"it restored version {restored.version} of incarnation {restored.incarnation} with "
            f"digest {restored.digest[:12]}, but that incarnation {held}"
        )
    return (
        f"; version {restored.version} restored with the digest incarnation "
        f"{restored.incarnation} recorded for it"
    )


def _check_events(conn: Connection, inc: Incarnation) -> str:
    """Replay the events through the daemon's own rules (``layout_ledger.store.replay``)."""
    try:
        record = replay_incarnation(conn, inc)
    except ReplayMismatch as exc:
        raise Inconsistent(str(exc)) from exc
    current = conn.execute(
        text("SELECT max(version) FROM versions WHERE incarnation_id = :i"),
        {"i": inc.incarnation_id},
    ).scalar()
    if record.version != (current or 0):
        raise Inconsistent(
            f"the commits reach version {record.version} but the ledger holds versions up to "
            f"{current}"
        )
    if record.end_state != inc.end_state:
        raise Inconsistent(
            f"the incarnation row says it ended {inc.end_state!r} but its events end it "
            f"{record.end_state!r}"
        )
    stored = record.journal
    count = stored.count if isinstance(stored, StoredEvents) else 0
    return f"{count} events consistent"


def _check_fingerprints(conn: Connection, inc: Incarnation) -> str:
    """The slot fingerprint rows: each a JSON list of fingerprints of one daemon's slots, beside
    a layout row of the same layer and version, and every held layout row of a fingerprinted
    layer has one; each version's ``fingerprints_digest`` recomputed from its rows where they
    are all held (``store.chain.fingerprints_digest``)."""
    prints = conn.execute(
        text(
            "SELECT row_id, layer, version, first_slot, fingerprints FROM slot_fingerprints "
            "WHERE incarnation_id = :i ORDER BY version, layer"
        ),
        {"i": inc.incarnation_id},
    ).all()
    held = {
        (int(layer), int(version))
        for layer, version in conn.execute(
            text("SELECT layer, version FROM layout_rows WHERE incarnation_id = :i"),
            {"i": inc.incarnation_id},
        ).all()
    }
    if not prints:
        stored = conn.execute(
            text(
                "SELECT min(version) FROM versions WHERE incarnation_id = :i "
                "AND fingerprints_digest IS NOT NULL"
            ),
            {"i": inc.incarnation_id},
        ).scalar()
        if stored is not None and any(v == stored for _, v in held):
            raise Inconsistent(
                f"version {stored} records a fingerprints digest but no slot fingerprint row is "
                f"held (they were deleted)"
            )
        return "no slot fingerprints recorded"
    slots = inc.geometry.num_physical_slots
    shapes = set()
    by_version: dict[int, list[tuple[int, int, str]]] = {}
    for row_id, layer, version, first_slot, values in prints:
        where = f"slot_fingerprints row {row_id} (layer {layer}, version {version})"
        try:
            parsed = json.loads(values)
        except (TypeError, ValueError):
            parsed = None
        if not isinstance(parsed, list) or not all(is_fingerprint(v) for v in parsed):
            raise Inconsistent(f"{where} is not a JSON list of 64-hex-digit fingerprints")
        if not parsed or not 0 <= int(first_slot) <= slots - len(parsed):
            raise Inconsistent(f"{where} covers slots outside the layer's {slots}")
        shapes.add((int(first_slot), len(parsed)))
        if len(shapes) > 1:
            raise Inconsistent(f"{where} covers other slots than the incarnation's other rows")
        if (int(layer), int(version)) not in held:
            raise Inconsistent(f"{where} has no layout row of that layer and version beside it")
        by_version.setdefault(int(version), []).append((int(layer), int(first_slot), values))
    fingerprinted = {int(layer) for _, layer, *_ in prints}
    written = {(layer, version) for version, rows in by_version.items() for layer, *_ in rows}
    missing = sorted(
        (version, layer) for layer, version in held - written if layer in fingerprinted
    )
    if missing:
        version, layer = missing[0]
        raise Inconsistent(
            f"version {version} wrote layer {layer}'s row but its slot fingerprints are not "
            f"held beside it (deleted?)"
        )
    checked = 0
    for version, digest, layers_text in conn.execute(
        text(
            "SELECT version, fingerprints_digest, layers FROM versions "
            "WHERE incarnation_id = :i AND fingerprints_digest IS NOT NULL ORDER BY version"
        ),
        {"i": inc.incarnation_id},
    ).all():
        wrote = _layers_of(layers_text, f"versions row of version {version}")
        if not all((layer, int(version)) in held for layer in wrote):
            continue  # partly pruned: the chain still covers the digest it records
        if chain.fingerprints_digest(by_version.get(int(version), [])) != digest:
            raise Inconsistent(
                f"version {version}'s slot fingerprint rows do not give the fingerprints digest "
                f"its versions row records (a fingerprint row was edited, added or deleted)"
            )
        checked += 1
    return f"{len(prints)} slot fingerprint rows well formed; {checked} version digests match"


def _check_contents(conn: Connection, inc: Incarnation) -> str:
    """A version restored from this ledger holds the contents it held before, unless the
    checkpoint changed: the fingerprints a clean restored load recorded at the version it
    restored equal, slot by slot, those of every earlier clean incarnation that recorded that
    version (number and digest) without a ``checkpoint_changed`` between the two. Loads that
    went wrong (``store.baseline.load_was_dirty``) are no one's evidence, and are skipped."""
    restored = inc.restored_from
    if restored is None or restored.source is not None:
        return "not restored from this ledger"
    if load_was_dirty(conn, inc.incarnation_id):
        return "its load was dirty, so its fingerprints are compared with none"
    version, digest = restored.version, restored.digest
    try:
        mine = fingerprints_at(conn, inc, version)
    except LedgerError:
        return f"version {version}'s fingerprints are not all held"
    if mine is None:
        return "no slot fingerprints recorded"
    changes = {
        int(i)
        for (i,) in conn.execute(
            text("SELECT DISTINCT incarnation_id FROM events WHERE kind = :k"),
            {"k": ev.CHECKPOINT_CHANGED},
        )
    }
    earlier = [
        int(i)
        for (i,) in conn.execute(
            text(
                "SELECT incarnation_id FROM versions WHERE version = :v AND digest = :d "
                "AND incarnation_id < :i ORDER BY incarnation_id"
            ),
            {"v": version, "d": digest, "i": inc.incarnation_id},
        )
    ]
    compared = []
    for other in earlier:
        if any(other < changed <= inc.incarnation_id for changed in changes):
            continue
        if load_was_dirty(conn, other):
            continue
        try:
            theirs = fingerprints_at(conn, incarnation(conn, other), version)
        except LedgerError:
            continue  # pruned or damaged rows: the other checks name them
        if theirs is None:
            continue
        for layer in sorted(set(mine.layers) & set(theirs.layers)):
            ours = dict(enumerate(mine.layers[layer], mine.first_slot))
            held = dict(enumerate(theirs.layers[layer], theirs.first_slot))
            for slot in sorted(set(ours) & set(held)):
                if ours[slot] != held[slot]:
                    raise Inconsistent(
                        f"version {version} (digest {digest[:12]}) holds other contents than in "
                        f"incarnation {other} (layer {layer} slot {slot}: {ours[slot][:12]} here, "
                        f"{held[slot][:12]} there) without a checkpoint_changed between them: a "
                        f"record of a load that went wrong was trusted"
                    )
        compared.append(other)
    if not compared:
        return f"version {version}: no earlier clean incarnation of the same checkpoint holds it"
    return (
        f"version {version}'s contents are those incarnations {compared} recorded for it (same "
        f"checkpoint)"
    )


def _layers_of(value: object, what: str) -> list[int]:
    try:
        parsed = json.loads(str(value))
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(type(v) is int for v in parsed):
        raise Inconsistent(f"{what}: its layers are not a JSON list of ints")
    return parsed


_INCARNATION_CHECKS: tuple[tuple[str, Callable[[Connection, Incarnation], str]], ...] = (
    ("version_chain", _check_version_chain),
    ("digests", _check_digests),
    ("fingerprints", _check_fingerprints),
    ("events", _check_events),
    ("contents", _check_contents),
)


def collect_verify(
    ledger: LedgerReader, on_phase: Callable[[str], None] | None = None
) -> VerifyReport:
    """Every check, in order (each named to ``on_phase`` as it begins: the CLI's progress line):

    - ``integrity_check``: SQLite's ``PRAGMA integrity_check``; ``foreign_key_check`` likewise.
    - per incarnation, ``version_chain``: its versions are 0..current without a gap.
    - per incarnation, ``digests``: the initial map gives the initial digest, which version 0
      records; every held version (from the reconstructible floor) rebuilt from the rows gives
      the digest its versions row records, and its rows are exactly the layers it lists.
    - per incarnation, ``fingerprints``: every slot fingerprint row is a JSON list of
      fingerprints of the same slots, beside a layout row of its layer and version; every held
      layout row of a fingerprinted layer has its fingerprint row; every version whose rows are
      all held gives, from its fingerprint rows, the ``fingerprints_digest`` it records.
    - per incarnation, ``events``: the stored events, replayed through the daemon's own rules
      (``store.replay``), are exactly what the daemon would have written: it starts with
      ``start``; every transition is one the rules allow at that point (a commit needs its
      begin, same engine, layers and base, and names the next version with that version's
      digest; a ``dirty`` mark follows its engine's detach during its pending move, and only
      then; no begin while dirty, after a non-following fetch or beside another engine; ...);
      after ``end`` only ``prune``; every version has a commit; and the incarnation row's end
      state is its events'.
    - per incarnation, ``contents``: a clean restored load recorded, for the version it
      restored, the fingerprints every earlier clean incarnation recorded for that version,
      unless a ``checkpoint_changed`` lies between them.
    - last, ``chain``: every event's chain value recomputed from the one before it and its own
      fields, with its version's fingerprints digest for a start, commit or repair
      (``store.chain``), which also catches an edit that leaves a history the rules
      allow; the head it reaches is printed, to compare with the daemon's log.
    """
    phase = on_phase or _quiet
    results = []
    with ledger.connect() as conn:
        revision = file_revision(conn)
        for pragma in ("integrity_check", "foreign_key_check"):
            phase(pragma)
            results.append(_pragma_check(conn, pragma))
        rows = incarnation_rows(conn)
        for number, inc in enumerate(rows, 1):
            if isinstance(inc, DamagedRow):
                results.append(CheckResult("rows", inc.row_id, False, str(inc)))
            else:
                where = f"incarnation {inc.incarnation_id} ({number} of {len(rows)})"
                results.extend(_incarnation_checks(conn, inc, _named(phase, where)))
        # Last: an edit the rules can name is reported in their words first; the chain also
        # catches edits that leave a history the rules allow.
        phase("hash chain")
        results.append(_chain_check(conn))
    return VerifyReport(str(ledger.path), revision, tuple(results))


def _quiet(text: str) -> None:
    pass


def _named(phase: Callable[[str], None], where: str) -> Callable[[str], None]:
    return lambda name: phase(f"{name}, {where}")


def _incarnation_checks(
    conn: Connection, inc: Incarnation, phase: Callable[[str], None] = _quiet
) -> list[CheckResult]:
    results = []
    for name, check in _INCARNATION_CHECKS:
        phase(name)
        try:
            detail = check(conn, inc)
        except (Inconsistent, DamagedRow) as exc:
            results.append(CheckResult(name, inc.incarnation_id, False, str(exc)))
        else:
            results.append(CheckResult(name, inc.incarnation_id, True, detail))
    return results


def verify_incarnation(ledger: LedgerReader, incarnation_id: int) -> list[CheckResult]:
    """``verify``'s checks of one incarnation (its version chain, digests and events)."""
    with ledger.connect() as conn:
        return _incarnation_checks(conn, incarnation(conn, incarnation_id))
