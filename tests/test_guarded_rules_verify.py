"""Rules of ``verify`` and of the replay (``layout_ledger.history.checks``, ``store.replay``)
that a plausible bug could break without any other test noticing; each test names its rule.

- ``verify`` (and a daemon's next start) compares each event the replay appends with the stored
  row exactly, every field (time, reason, digest, new version); only the read commands compare
  the transition alone, so that they still show the state of an edited ledger.
- ``verify`` checks an incarnation row's ``end_state`` against what its events say.

Every ledger is a real one (tests/cli_ledgers.py) edited afterwards with plain ``sqlite3``. An
edit of an event row is made the way someone who knows the format would make it: with the hash
chain recomputed after it, so that the chain check passes and only the replay can tell.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from cli_ledgers import at, build, execute, query, run_cli
from ledger_support import open_ledger, start

from layout_ledger.cli import exit_codes
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store import chain


def recompute_chain(path: Path) -> None:
    """Every event's chain value again, from the rows as they are now (a consistent forgery)."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        rows = conn.execute(
            f"SELECT event_id, {', '.join(chain.FIELDS)} FROM events ORDER BY event_id"
        ).fetchall()
        previous = chain.GENESIS
        for event_id, *fields in rows:
            previous = chain.link(previous, fields)
            conn.execute("UPDATE events SET chain = ? WHERE event_id = ?", (previous, event_id))


def _inconsistencies(path: Path) -> list[str]:
    with LedgerReader(path) as reader:
        report = collect_verify(reader)
    return [f"{result.label}: {result.detail}" for result in report.inconsistencies]


# The "dirty" ledger (tests/cli_ledgers.py): #2 attach, #4 commit (version 1), #6 detach during
# the move begun at #5 and #7 its dirty mark, #8 and #9 refusals.
_DIRTY_REASON = (
    "engine 'engine-a' detached while its move of layers [2, 3] from version 1 was pending, so "
    "the weights of those layers may be half-moved; restart the daemon (it reloads the weights "
    "from disk) and the engines that use it"
)
_HALF_A_SECOND_LATER = "2026-01-01T00:00:05.500000+00:00"  # than its detach, at(5)
_EDITS = {
    "time": (
        f"UPDATE events SET at = '{_HALF_A_SECOND_LATER}' WHERE event_id = 7",
        f"event #7 (dirty by 'engine-a') differs from what the rules write: at "
        f"'{_HALF_A_SECOND_LATER}' where the rules give '{at(5)}'",
    ),
    "reason": (
        "UPDATE events SET reason = 'the operator said so' WHERE event_id = 7",
        "event #7 (dirty by 'engine-a') differs from what the rules write: reason 'the operator "
        f"said so' where the rules give {_DIRTY_REASON!r}",
    ),
    "digest": (
        "UPDATE events SET digest_after = '" + "ab" * 32 + "' WHERE event_id = 4",
        "event #4 (commit by 'engine-a') differs from what the rules write: digest_after "
        f"'{'ab' * 32}' where the rules give ",
    ),
    "new version": (
        "UPDATE events SET new_version = 7 WHERE event_id = 2",
        "event #2 (attach by 'engine-a') differs from what the rules write: new_version 7 where "
        "the rules give 0",
    ),
    "refusal's version": (
        "UPDATE events SET new_version = 0 WHERE event_id = 8",
        "event #8 (fetch_refused by 'engine-b') differs from what the rules write: new_version 0 "
        "where the rules give 1",
    ),
}


@pytest.mark.parametrize("field", sorted(_EDITS))
def test_verify_compares_every_field_of_each_replayed_event_with_the_stored_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    path = build("dirty", tmp_path / "l.sqlite")
    statement, named = _EDITS[field]
    execute(path, statement)
    recompute_chain(path)
    (inconsistency,) = _inconsistencies(path)
    assert inconsistency.startswith(f"incarnation 1 events: {named}"), inconsistency
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    assert "\nchain: ok: 9 events chained" in out, out
    assert "incarnation 1 events: INCONSISTENT: " in out


@pytest.mark.parametrize("field", sorted(_EDITS))
def test_the_read_commands_still_show_the_state_of_a_ledger_whose_event_fields_were_edited(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    path = build("dirty", tmp_path / "l.sqlite")
    execute(path, _EDITS[field][0])
    recompute_chain(path)
    code, out, _ = run_cli(capsys, "status", str(path))
    assert code == exit_codes.DIRTY, out
    assert out.splitlines()[-1] == "state:               dirty"


@pytest.mark.parametrize("field", sorted(_EDITS))
def test_a_daemons_next_start_replays_exactly_and_ends_an_edited_incarnation_unknown(
    tmp_path: Path, field: str
) -> None:
    path = build("dirty", tmp_path / "l.sqlite")
    statement, named = _EDITS[field]
    execute(path, statement)
    recompute_chain(path)
    ledger = open_ledger(path)
    try:
        start(ledger)
    finally:
        ledger.close()
    ((end_state, reason),) = query(
        path,
        "SELECT i.end_state, e.reason FROM incarnations i JOIN events e ON "
        "e.incarnation_id = i.incarnation_id AND e.kind = 'end' WHERE i.incarnation_id = 1",
    )
    assert end_state == "unknown"
    assert f"its rows cannot be interpreted: {named}" in reason


def test_an_unedited_dirty_incarnation_is_ended_dirty_at_the_next_start(tmp_path: Path) -> None:
    path = build("dirty", tmp_path / "l.sqlite")
    ledger = open_ledger(path)
    try:
        start(ledger)
    finally:
        ledger.close()
    assert query(path, "SELECT end_state FROM incarnations WHERE incarnation_id = 1") == [
        ("dirty",)
    ]
    assert _inconsistencies(path) == []


# --- the incarnation row's end state is its events' ---------------------------------------------


@pytest.mark.parametrize(
    ("kind", "incarnation", "forged", "events_say"),
    [
        ("clean", 1, "dirty", "'clean'"),
        ("clean", 1, "unknown", "'clean'"),
        ("clean", 2, "clean", "None"),  # still running: no end event at all
        ("dirty", 1, "clean", "None"),
    ],
)
def test_verify_checks_an_incarnation_rows_end_state_against_its_events(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    incarnation: int,
    forged: str,
    events_say: str,
) -> None:
    path = build(kind, tmp_path / "l.sqlite")
    execute(
        path,
        "PRAGMA ignore_check_constraints = ON",
        f"UPDATE incarnations SET end_state = '{forged}' WHERE incarnation_id = {incarnation}",
    )
    assert _inconsistencies(path) == [
        f"incarnation {incarnation} events: the incarnation row says it ended {forged!r} but its "
        f"events end it {events_say}"
    ]
    code, _, err = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    assert "the incarnation row says it ended" in err


def test_a_dirty_end_that_the_events_write_verifies(tmp_path: Path) -> None:
    path = build("dirty", tmp_path / "l.sqlite")
    ledger = open_ledger(path)
    try:
        record = start(ledger)
        record.attach("engine-c")
        record.begin("engine-c", 0, [0])
    finally:
        ledger.close()  # a move pending at a clean shutdown: ended dirty
    assert query(path, "SELECT end_state FROM incarnations ORDER BY incarnation_id") == [
        ("dirty",),
        ("dirty",),
    ]
    assert _inconsistencies(path) == []
