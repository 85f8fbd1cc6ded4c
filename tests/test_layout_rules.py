"""Rules of the record that no other test pinned, each on its own, through the daemon's service.

``LayoutService`` is what the daemon answers with (the socket adds only sglang's framing), over
a real ledger file. Each test here was checked by breaking its rule in the code once.
"""

from __future__ import annotations

import random
import sqlite3

import pytest
from ledger_support import SMALL, open_ledger, random_row, start

from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.history.reader import LedgerReader
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.service import LayoutService


@pytest.fixture
def ledger(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    yield ledger
    ledger.close()


def _on_disk(ledger):
    with LedgerReader(ledger.path) as reader:
        return reader.state()


def _begin(service, engine, version, layers):
    return service.handle(
        {"type": msg.BEGIN, "engine_id": engine, "base_version": version, "layers": layers}
    )


# --- only the mover's detach makes a daemon dirty ------------------------------------------


def test_an_attached_engine_that_is_not_the_mover_detaching_mid_move_leaves_the_daemon_clean(
    ledger,
):
    record = start(ledger)
    service = LayoutService(record)
    for engine in ("mover", "standby"):
        assert service.handle({"type": msg.ATTACH, "engine_id": engine})["status"] == msg.OK
    record.detach("standby")  # so that the mover is alone and may begin
    assert _begin(service, "mover", 0, [2, 3])["status"] == msg.OK
    assert service.handle({"type": msg.ATTACH, "engine_id": "late"})["status"] == msg.OK

    assert service.detach("late") is None
    state = _on_disk(ledger)
    assert state.dirty is None and record.dirty is None
    assert state.pending is not None and state.pending.engine_id == "mover"

    service.detach("mover")
    assert _on_disk(ledger).dirty is not None  # the mover's own detach does


# --- a change the ledger cannot persist does not happen in memory either -------------------

BIG = Geometry(num_layers=4, num_physical_slots=2048, num_logical_experts=8)


def _fill_the_disk(ledger) -> None:
    """SQLite's own limit on the file's pages: the next write that needs a page fails with
    SQLITE_FULL ("database or disk is full"), exactly as on a full disk."""
    driver = ledger._writer.driver()
    pages = driver.execute("PRAGMA page_count").fetchone()[0]
    driver.execute(f"PRAGMA max_page_count = {pages}")


def _wire_state(ledger) -> dict:
    return msg.LayoutView.of(_on_disk(ledger)).to_wire()


def test_when_the_ledger_cannot_persist_a_change_the_daemons_answers_show_what_the_file_holds(
    ledger,
):
    record = start(ledger, BIG, trivial_map(4, 2048, 8))
    service = LayoutService(record)
    assert service.handle({"type": msg.ATTACH, "engine_id": "A"})["status"] == msg.OK
    assert _begin(service, "A", 0, [0, 1, 2, 3])["status"] == msg.OK
    rng = random.Random(4)
    rows = {layer: random_row(rng, BIG) for layer in range(4)}
    _fill_the_disk(ledger)

    failed = service.handle({"type": msg.COMMIT, "engine_id": "A", "rows": rows})
    assert failed["status"] == msg.ERROR
    assert "database or disk is full" in failed["reason"]

    on_disk = _wire_state(ledger)
    assert (on_disk["version"], on_disk["attached"]) == (0, ["A"])
    assert on_disk["pending"] == {"engine_id": "A", "layers": [0, 1, 2, 3], "base_version": 0}
    assert service.handle({"type": msg.QUERY})["layout"] == on_disk
    again = _begin(service, "A", 0, [0])
    assert again["status"] == msg.REFUSED
    assert "already has a move of layers [0, 1, 2, 3] pending" in again["reason"]
    fetch = service.check_fetch({msg.FETCH_LAYOUT_FIELD: {"version": 0, "digest": record.digest}})
    assert fetch is not None and fetch["status"] == msg.LAYOUT_REFUSED
    assert "is moving layers [0, 1, 2, 3] from version 0" in fetch["reason"]

    ledger._writer.driver().execute("PRAGMA max_page_count = 1073741823")
    done = service.handle({"type": msg.COMMIT, "engine_id": "A", "rows": rows})
    assert (done["status"], done["version"]) == (msg.OK, 1)
    assert service.handle({"type": msg.QUERY})["layout"] == _wire_state(ledger)


# --- a permanent refusal wins over busy ------------------------------------------------------


@pytest.fixture
def two_engines(ledger):
    """A record with engine A and another engine B attached (B alone would make A busy)."""
    record = start(ledger)
    service = LayoutService(record)
    for engine in ("A", "B"):
        assert service.handle({"type": msg.ATTACH, "engine_id": engine})["status"] == msg.OK
    return record, service


def test_a_begin_on_a_dirty_daemon_is_refused_even_while_another_engine_is_attached(ledger):
    record = start(ledger)
    service = LayoutService(record)
    service.handle({"type": msg.ATTACH, "engine_id": "mover"})
    assert _begin(service, "mover", 0, [1])["status"] == msg.OK
    service.handle({"type": msg.ATTACH, "engine_id": "B"})
    service.handle({"type": msg.ATTACH, "engine_id": "C"})
    service.detach("mover")  # dirty; B and C stay attached
    reply = _begin(service, "B", 0, [1])
    assert reply["status"] == msg.REFUSED, reply
    assert "expert layout is unknown" in reply["reason"]


def test_a_begin_by_an_engine_not_attached_is_refused_even_while_another_engine_is_attached(
    two_engines,
):
    _, service = two_engines
    reply = _begin(service, "Z", 0, [1])
    assert reply["status"] == msg.REFUSED, reply
    assert "engine 'Z' is not attached" in reply["reason"]


def test_a_begin_from_a_stale_base_is_refused_even_while_another_engine_is_attached(two_engines):
    _, service = two_engines
    reply = _begin(service, "A", 3, [1])
    assert reply["status"] == msg.REFUSED, reply
    assert "base_version 3 is not the current version 0" in reply["reason"]


# --- a commit's rows: each check on its own ------------------------------------------------


@pytest.fixture
def moving(ledger):
    record = start(ledger)
    service = LayoutService(record)
    service.handle({"type": msg.ATTACH, "engine_id": "A"})
    assert _begin(service, "A", 0, [1])["status"] == msg.OK
    return record, service


def _layout_tables(path) -> dict:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("versions", "layout_rows")
        }


def test_a_commit_row_one_slot_short_is_refused_and_the_move_stays_pending(ledger, moving):
    record, service = moving
    before = _layout_tables(ledger.path)
    short = [slot % SMALL.num_logical_experts for slot in range(SMALL.num_physical_slots - 1)]
    reply = service.handle({"type": msg.COMMIT, "engine_id": "A", "rows": {1: short}})
    assert reply == {
        "status": msg.REFUSED,
        "reason": "row of layer 1 has 11 slots; this layout has 12 physical slots per layer",
    }
    assert _layout_tables(ledger.path) == before
    assert record.pending is not None and _on_disk(ledger).pending.layers == (1,)


def test_a_commit_row_naming_expert_num_logical_experts_is_refused_and_the_move_stays_pending(
    ledger, moving
):
    record, service = moving
    before = _layout_tables(ledger.path)
    row = [slot % SMALL.num_logical_experts for slot in range(SMALL.num_physical_slots)]
    row[5] = SMALL.num_logical_experts
    reply = service.handle({"type": msg.COMMIT, "engine_id": "A", "rows": {1: row}})
    assert reply == {
        "status": msg.REFUSED,
        "reason": "row of layer 1 slot 5 holds expert 8, outside [0, 8)",
    }
    assert _layout_tables(ledger.path) == before
    assert record.pending is not None and _on_disk(ledger).pending.layers == (1,)
