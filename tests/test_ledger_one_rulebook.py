"""One rulebook: the live record, the replay of its stored events, and the forensic views agree.

The daemon's record applies the rules forward; ``reader.read_state`` (and ``verify``) replays the
stored events through the same record; the ``ledger_*`` views derive the same state in SQL for
``sqlite3`` users. After every kind of transition, pruned histories included, all three must say
the same: version, digest, map, pending move, dirty mark, attached engines, non-following flag.
"""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3

import pytest
from ledger_support import open_ledger, random_row, start

from layout_ledger.core import errors
from layout_ledger.core.state import LayoutState
from layout_ledger.history.reader import LedgerReader


def _views(path, incarnation_id: int) -> dict:
    """The state as the forensic views show it, with nothing but sqlite3."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        inc = conn.execute(
            "SELECT current_version, current_digest, dirty, dirty_engine_id, dirty_layers, "
            "dirty_base_version, pending_engine_id, pending_layers, pending_base_version, "
            "non_following_fetch FROM ledger_incarnations WHERE incarnation_id = ?",
            (incarnation_id,),
        ).fetchone()
        rows = conn.execute(
            "SELECT layer, slots FROM ledger_current_layout WHERE incarnation_id = ? "
            "ORDER BY layer",
            (incarnation_id,),
        ).fetchall()
        attached = [
            engine
            for (engine,) in conn.execute(
                "SELECT engine_id FROM ledger_attachments WHERE incarnation_id = ? "
                "AND detached_at IS NULL ORDER BY attached_at",
                (incarnation_id,),
            )
        ]
    version, digest, dirty, d_engine, d_layers, d_base, p_engine, p_layers, p_base, nf = inc
    return {
        "version": version,
        "digest": digest,
        "map": [json.loads(slots) for _, slots in rows],
        "dirty": None if not dirty else (d_engine, tuple(json.loads(d_layers)), d_base),
        "pending": None if p_engine is None else (p_engine, tuple(json.loads(p_layers)), p_base),
        "attached": attached,
        "non_following_fetch": bool(nf),
    }


def _as_views_show(state: LayoutState) -> dict:
    dirty = state.dirty
    pending = state.pending
    return {
        "version": state.version,
        "digest": state.digest,
        "map": state.physical_to_logical_map,
        "dirty": None
        if dirty is None
        else (dirty.move.engine_id, dirty.move.layers, dirty.move.base_version),
        "pending": None
        if pending is None
        else (pending.engine_id, pending.layers, pending.base_version),
        "attached": list(state.attached),
        "non_following_fetch": state.non_following_fetch,
    }


def _replayed(path) -> LayoutState:
    with LedgerReader(path) as reader:
        return reader.state()


def _steps(ledger, record, rng):
    """(name, step) for every transition kind, refusals and prunes among them."""

    def commit(engine: str, layers: list[int]) -> None:
        record.begin(engine, record.version, layers)
        record.commit(engine, {layer: random_row(rng) for layer in layers})

    return [
        ("attach", lambda: record.attach("A")),
        ("begin", lambda: record.begin("A", 0, [1, 2])),
        ("commit", lambda: record.commit("A", {1: random_row(rng), 2: random_row(rng)})),
        ("three more commits", lambda: [commit("A", [rng.randrange(8)]) for _ in range(3)]),
        ("prune to the last 2 versions", lambda: ledger.prune(2)),
        ("attach refused", lambda: record.attach("A")),
        ("begin refused (stale base)", lambda: record.begin("A", 0, [3])),
        ("commit refused (no move)", lambda: record.commit("A", {3: random_row(rng)})),
        ("abort refused (no move)", lambda: record.abort("A")),
        ("attach another", lambda: record.attach("B")),
        ("begin busy", lambda: record.begin("A", record.version, [3])),
        ("begin of the other, busy too", lambda: record.begin("B", record.version, [3])),
        ("detach the other", lambda: record.detach("B")),
        ("begin", lambda: record.begin("A", record.version, [3, 4])),
        ("abort", lambda: record.abort("A")),
        ("fetch refused (wrong digest)", lambda: record.fetch({"version": 0, "digest": "0" * 64})),
        ("begin", lambda: record.begin("A", record.version, [5])),
        ("fetch refused (in flux)", lambda: record.fetch(None)),
        ("commit", lambda: record.commit("A", {5: random_row(rng)})),
        ("prune again", lambda: ledger.prune(1)),
        (
            "non-following fetch",
            lambda: record.fetch({"engine_id": None, "version": 1, "digest": record.digest}),
        ),
        ("begin refused (moves disabled)", lambda: record.begin("A", record.version, [6])),
        ("attach a third", lambda: record.attach("C")),
        ("detach without a move", lambda: record.detach("A")),
    ]


def _dirty_steps(record, rng):
    return [
        ("attach", lambda: record.attach("A")),
        ("begin", lambda: record.begin("A", 0, [0, 7])),
        ("detach mid-move: dirty", lambda: record.detach("A")),
        ("attach after dirty", lambda: record.attach("B")),
        ("begin refused (dirty)", lambda: record.begin("B", 0, [1])),
        ("fetch refused (dirty)", lambda: record.fetch(None)),
    ]


def _assert_all_agree(ledger, record, name: str) -> None:
    live = record.state()
    replayed = _replayed(ledger.path)
    assert replayed == live, name
    assert _views(ledger.path, record.incarnation_id) == _as_views_show(live), name


@pytest.mark.parametrize("history", ["moves, refusals and prunes", "dirty"])
def test_the_views_the_replay_and_the_live_record_agree_after_every_transition(tmp_path, history):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record = start(ledger)
    rng = random.Random(5)
    steps = _steps(ledger, record, rng) if history != "dirty" else _dirty_steps(record, rng)
    _assert_all_agree(ledger, record, "start")
    for name, step in steps:
        with contextlib.suppress(errors.RequestRefused, errors.MoveBusy):
            step()
        _assert_all_agree(ledger, record, name)
    incarnation_id = record.incarnation_id
    ledger.close()  # the shutdown's end event
    with LedgerReader(ledger.path) as reader:
        ended = reader.state(incarnation_id)
    assert ended.attached == ()
    assert _views(ledger.path, incarnation_id)["attached"] == []


def test_a_pruned_history_still_replays_and_verifies(tmp_path):
    from layout_ledger.history.checks import collect_verify

    ledger = open_ledger(tmp_path / "l.sqlite")
    record = start(ledger)
    rng = random.Random(2)
    for _, step in _steps(ledger, record, rng):
        with contextlib.suppress(errors.RequestRefused, errors.MoveBusy):
            step()
    ledger.close()
    with LedgerReader(ledger.path) as reader:
        with reader.connect() as conn:
            floor = conn.exec_driver_sql(
                "SELECT max(base_version) FROM events WHERE kind = 'prune'"
            ).scalar()
        assert floor and floor > 1  # rows of early commits are gone
        report = collect_verify(reader)
    assert report.ok, report.first_inconsistency
