"""``layout-ledger verify``: is the file intact, and do its rows, versions and events agree?

Checks, in order, inside one read transaction (a consistent snapshot while a daemon writes):

- ``integrity_check``: SQLite's ``PRAGMA integrity_check``; ``foreign_key_check`` likewise.
- per incarnation, ``version_chain``: its versions are 0..current without a gap.
- per incarnation, ``digests``: the initial map gives the initial digest, which version 0
  records; every held version (from the reconstructible floor) rebuilt from the rows gives
  the digest its versions row records, and its rows are exactly the layers it lists.
- per incarnation, ``events``: replayed in order, the events are a history the daemon's rules
  allow: it starts with ``start``; every commit has its begin (same engine, layers and base)
  and names the next version with that version's digest; an abort has its begin; a ``dirty``
  mark only right after its engine's detach while that engine's move was pending, and such a
  detach is always followed by one; no begin after a dirty mark or a non-following fetch;
  every detach has its attach; after ``end`` only ``prune``; and every version has a commit.

Each check reports its first inconsistency; the report names the first of all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy import Connection, text

from layout_ledger import events as ev
from layout_ledger import reader
from layout_ledger.json_shape import JsonShaped, json_field
from layout_ledger.layout import layout_digest
from layout_ledger.migrate import file_revision
from layout_ledger.reader import Incarnation, LedgerReader
from layout_ledger.report import EVENT_KINDS
from layout_ledger.version_walk import WalkInconsistency, walk_versions


@dataclass(frozen=True)
class CheckResult(JsonShaped):
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
class VerifyReport(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("ok", "first_inconsistency")

    path: str
    schema_revision: str | None
    results: tuple[CheckResult, ...] = field(metadata=json_field(key="checks"))

    @property
    def inconsistencies(self) -> tuple[CheckResult, ...]:
        return tuple(result for result in self.results if not result.ok)

    @property
    def ok(self) -> bool:
        return not self.inconsistencies

    @property
    def first_inconsistency(self) -> str | None:
        bad = self.inconsistencies
        return None if not bad else f"{bad[0].label}: {bad[0].detail}"


class Inconsistent(Exception):
    """Raised inside one check to stop it at its first inconsistency."""


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
    if not versions:
        raise Inconsistent("no versions at all (not even version 0)")
    for expected, version in enumerate(versions):
        if version != expected:
            missing = expected if version == expected + 1 else f"{expected}..{version - 1}"
            raise Inconsistent(f"version {missing} is missing before version {version}")
    return f"versions 0..{versions[-1]} without gaps"


def _check_digests(conn: Connection, inc: Incarnation) -> str:
    initial = conn.execute(
        text("SELECT initial_map FROM incarnations WHERE incarnation_id = :i"),
        {"i": inc.incarnation_id},
    ).scalar()
    if layout_digest(json.loads(str(initial))) != inc.initial_digest:
        raise Inconsistent(
            f"the initial map does not give the recorded initial digest {inc.initial_digest[:12]}"
        )
    version_zero = conn.execute(
        text("SELECT digest FROM versions WHERE incarnation_id = :i AND version = 0"),
        {"i": inc.incarnation_id},
    ).scalar()
    if version_zero is not None and version_zero != inc.initial_digest:
        raise Inconsistent(
            f"version 0 records digest {str(version_zero)[:12]} but the initial digest is "
            f"{inc.initial_digest[:12]}"
        )
    first = last = None
    try:
        for step in walk_versions(conn, inc):
            if first is None:
                first = step.version
            last = step.version
            if sorted(step.recorded_layers) != list(step.written_layers):
                raise Inconsistent(
                    f"version {step.version} lists layers {sorted(step.recorded_layers)} but "
                    f"has rows for layers {list(step.written_layers)}"
                )
            computed = step.computed_digest
            if computed != step.recorded_digest:
                raise Inconsistent(
                    f"version {step.version} records digest {step.recorded_digest[:12]} but its "
                    f"rows give {computed[:12]}"
                )
    except WalkInconsistency as exc:
        raise Inconsistent(str(exc)) from exc
    pruned = "" if not first else f"; versions 0..{first - 1} were pruned"
    return f"digests of versions {first}..{last} recomputed from the rows match{pruned}"


@dataclass
class _Replay:
    """The record's state while the events are replayed."""

    versions: dict[int, tuple[str, tuple[int, ...]]]
    version: int | None = None
    pending: tuple[str, tuple[int, ...], int] | None = None
    dirty: bool = False
    non_following: bool = False
    ended: bool = False
    attached: set[str] = field(default_factory=set)
    expect_dirty_of: str | None = None
    previous: Any = None


def _replay_one(state: _Replay, event: Any) -> None:
    kind = event.kind
    engine = event.engine_id
    layers = None if event.layers is None else tuple(json.loads(event.layers))
    where = f"event #{event.event_id} ({kind}"
    where += f" by {engine!r})" if engine else ")"
    if state.expect_dirty_of is not None and (kind != ev.DIRTY or engine != state.expect_dirty_of):
        raise Inconsistent(
            f"{where} follows engine {state.expect_dirty_of!r}'s detach during its pending "
            f"move, where a dirty mark must be"
        )
    if state.version is None and kind != ev.START:
        raise Inconsistent(f"{where} comes before the incarnation's start event")
    if state.ended and kind != ev.PRUNE:
        raise Inconsistent(f"{where} comes after the incarnation's end event")
    if kind not in EVENT_KINDS:
        raise Inconsistent(f"{where} has an unknown kind")
    if kind == ev.START:
        if state.version is not None:
            raise Inconsistent(f"{where} is a second start in one incarnation")
        if event.new_version != 0:
            raise Inconsistent(f"{where} starts at version {event.new_version}, not 0")
        state.version = 0
    elif kind == ev.ATTACH:
        if engine in state.attached:
            raise Inconsistent(f"{where}: the engine was already attached")
        state.attached.add(engine)
    elif kind == ev.DETACH:
        if engine not in state.attached:
            raise Inconsistent(f"{where}: the engine was not attached")
        state.attached.discard(engine)
        if state.pending is not None and state.pending[0] == engine:
            state.expect_dirty_of = engine
    elif kind == ev.BEGIN:
        if state.dirty:
            raise Inconsistent(f"{where} was accepted although the layout was dirty")
        if state.non_following:
            raise Inconsistent(f"{where} was accepted after a non-following fetch")
        if state.pending is not None:
            raise Inconsistent(
                f"{where} was accepted while engine {state.pending[0]!r}'s move was pending"
            )
        if engine not in state.attached:
            raise Inconsistent(f"{where}: the engine was not attached")
        others = sorted(state.attached - {engine})
        if others:
            raise Inconsistent(f"{where} was accepted while {others} were attached too")
        if event.base_version != state.version:
            raise Inconsistent(
                f"{where} names base version {event.base_version} but the version was "
                f"{state.version}"
            )
        state.pending = (engine, layers or (), int(event.base_version))
    elif kind in (ev.COMMIT, ev.ABORT):
        pending = state.pending
        if pending is None:
            raise Inconsistent(f"{where} has no begin before it")
        if pending != (engine, layers or (), event.base_version):
            raise Inconsistent(
                f"{where} of layers {list(layers or ())} from version {event.base_version} does "
                f"not match the pending begin by {pending[0]!r} of layers {list(pending[1])} "
                f"from version {pending[2]}"
            )
        state.pending = None
        if kind == ev.COMMIT:
            _replay_commit(state, event, where, layers or ())
    elif kind == ev.DIRTY:
        pending = state.pending
        previous = state.previous
        after_detach = (
            previous is not None and previous.kind == ev.DETACH and previous.engine_id == engine
        )
        if not after_detach or pending is None:
            raise Inconsistent(
                f"{where} does not follow a detach of that engine during its pending move"
            )
        if pending != (engine, layers or (), event.base_version):
            raise Inconsistent(f"{where} names another move than the pending one")
        state.pending = None
        state.dirty = True
        state.expect_dirty_of = None
    elif kind == ev.NON_FOLLOWING_FETCH:
        if state.dirty or state.pending is not None:
            raise Inconsistent(f"{where} was served while the layout was dirty or in flux")
        state.non_following = True
    elif kind == ev.END:
        state.ended = True
        state.expect_dirty_of = None


def _replay_commit(state: _Replay, event: Any, where: str, layers: tuple[int, ...]) -> None:
    expected = (state.version or 0) + 1
    if event.new_version != expected:
        raise Inconsistent(f"{where} names version {event.new_version}, expected {expected}")
    recorded = state.versions.get(expected)
    if recorded is None:
        raise Inconsistent(f"{where}: the ledger has no version {expected}")
    digest, recorded_layers = recorded
    if event.digest_after != digest:
        raise Inconsistent(
            f"{where} records digest {str(event.digest_after)[:12]} but version {expected} "
            f"records {digest[:12]}"
        )
    if sorted(recorded_layers) != sorted(layers):
        raise Inconsistent(
            f"{where} moved layers {list(layers)} but version {expected} lists "
            f"{list(recorded_layers)}"
        )
    state.version = expected


def _check_events(conn: Connection, inc: Incarnation) -> str:
    i = inc.incarnation_id
    versions = {
        int(row.version): (str(row.digest), tuple(json.loads(row.layers)))
        for row in conn.execute(
            text("SELECT version, digest, layers FROM versions WHERE incarnation_id = :i"),
            {"i": i},
        )
    }
    state = _Replay(versions=versions)
    count = 0
    for event in conn.execute(
        text(
            "SELECT event_id, at, kind, engine_id, layers, base_version, new_version, "
            "digest_after FROM events WHERE incarnation_id = :i ORDER BY event_id"
        ),
        {"i": i},
    ):
        _replay_one(state, event)
        state.previous = event
        count += 1
    if state.expect_dirty_of is not None:
        raise Inconsistent(
            f"engine {state.expect_dirty_of!r} detached during its pending move but no dirty "
            f"mark follows"
        )
    if state.version is None:
        raise Inconsistent("the incarnation has no start event")
    current = max(versions) if versions else 0
    if state.version != current:
        raise Inconsistent(
            f"the commits reach version {state.version} but the ledger holds versions up to "
            f"{current}"
        )
    return f"{count} events consistent"


_INCARNATION_CHECKS: tuple[tuple[str, Callable[[Connection, Incarnation], str]], ...] = (
    ("version_chain", _check_version_chain),
    ("digests", _check_digests),
    ("events", _check_events),
)


def collect_verify(ledger: LedgerReader) -> VerifyReport:
    results = []
    with ledger.connect() as conn:
        revision = file_revision(conn)
        results.append(_pragma_check(conn, "integrity_check"))
        results.append(_pragma_check(conn, "foreign_key_check"))
        for inc in reader.incarnations(conn):
            for name, check in _INCARNATION_CHECKS:
                try:
                    detail = check(conn, inc)
                except Inconsistent as exc:
                    results.append(CheckResult(name, inc.incarnation_id, False, str(exc)))
                else:
                    results.append(CheckResult(name, inc.incarnation_id, True, detail))
    return VerifyReport(str(ledger.path), revision, tuple(results))


def render_verify(report: VerifyReport) -> list[str]:
    lines = [f"ledger {report.path} (schema {report.schema_revision})"]
    for result in report.results:
        verdict = "ok" if result.ok else "INCONSISTENT"
        detail = "" if result.ok and result.detail == "ok" else f": {result.detail}"
        lines.append(f"{result.label}: {verdict}{detail}")
    if report.ok:
        lines.append("verified: no inconsistency")
    else:
        lines.append(
            f"{len(report.inconsistencies)} inconsistent; first: {report.first_inconsistency}"
        )
    return lines
