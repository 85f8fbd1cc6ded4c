"""Restored incarnations in the ledger: what is offered, how it starts, and that readers agree.

Real ledger files: an incarnation moves experts, the next one reads the ledger's offer (the newest
committed version, its rows verified) and starts at that version's number and digest, with a
``restore`` event; the reader, ``verify``, retention, the CLI and the next start derive its state
from the rows alone.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from alembic import command
from ledger_support import SMALL, move, open_ledger, random_row
from sqlalchemy import create_engine

from layout_ledger.cli.app import main as cli_main
from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import LedgerInconsistent, SchemaDowngradeRefused
from layout_ledger.core.layout import Geometry, Map, layout_digest, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.core.state import RestoredFrom
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.migrate import alembic_config
from layout_ledger.store.restore_offer import NoOffer, RestoreOffer, newest_offer

CHECKPOINT = "c" * 64
INITIAL = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)


def start(ledger: Ledger, the_map: Map = INITIAL, **fields: object) -> LayoutRecord:
    values: dict[str, object] = {"checkpoint_digest": CHECKPOINT}
    values.update(fields)
    return ledger.start_incarnation(
        SMALL, the_map, config_fingerprint="test", daemon_label="test-daemon", **values
    )


def moved_ledger(path: Path, moves: int = 2, **fields: object) -> LayoutRecord:
    """A closed ledger whose one incarnation committed ``moves`` versions; its record."""
    ledger = open_ledger(path)
    record = start(ledger, **fields)
    record.attach("engine-a")
    rng = random.Random(7)
    for number in range(moves):
        move(record, "engine-a", [number % SMALL.num_layers, 5], rng)
    ledger.close()
    return record


def offered(path: Path, geometry: Geometry = SMALL, checkpoint: str = CHECKPOINT):
    ledger = open_ledger(path)
    try:
        return ledger.restore_offer(geometry, checkpoint)
    finally:
        ledger.close()


def restore(ledger: Ledger) -> LayoutRecord:
    offer = ledger.restore_offer(SMALL, CHECKPOINT)
    assert isinstance(offer, RestoreOffer)
    restored = RestoredFrom(offer.incarnation, offer.version, offer.digest)
    return start(ledger, offer.physical_to_logical_map, restored_from=restored)


def restarted(path: Path, attach: str | None = None) -> LayoutRecord:
    """A daemon's restart that restores (with ``attach`` attached), then its clean stop;
    returns the record of the incarnation restored from."""
    first = moved_ledger(path)
    ledger = open_ledger(path)
    record = restore(ledger)
    if attach is not None:
        record.attach(attach)
    ledger.close()
    return first


def verified(path: Path) -> list[str]:
    with LedgerReader(path) as reader:
        report = collect_verify(reader)
    return [f"{result.label}: {result.detail}" for result in report.inconsistencies]


def test_a_restored_incarnation_starts_at_the_offered_version_and_moves_on_from_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "l.sqlite"
    first = moved_ledger(path)
    ledger = open_ledger(path)
    record = restore(ledger)
    assert (record.version, record.digest) == (2, first.digest)
    assert record.physical_to_logical_map() == first.physical_to_logical_map()
    assert record.state().restored_from == RestoredFrom(1, 2, first.digest)
    record.attach("engine-b")
    assert move(record, "engine-b", [1], random.Random(1)) == 3
    ledger.close()
    with LedgerReader(path) as reader:
        state = reader.state()
    assert (state.incarnation_id, state.version) == (2, 3)
    assert state.restored_from == RestoredFrom(1, 2, first.digest)
    assert verified(path) == []
    with sqlite3.connect(path) as conn:
        events = conn.execute(
            "SELECT kind, base_version, new_version, digest_after, reason FROM ledger_events "
            "WHERE incarnation_id = 2 ORDER BY event_id LIMIT 2"
        ).fetchall()
        versions = conn.execute(
            "SELECT version FROM versions WHERE incarnation_id = 2 ORDER BY version"
        ).fetchall()
    assert events == [
        ("start", None, 2, first.digest, "test-daemon"),
        ("restore", 2, 2, first.digest, "restored version 2 of incarnation 1"),
    ]
    assert versions == [(2,), (3,)]  # no version 0: a number never names two maps


def test_the_offer_is_the_newest_committed_version_of_an_incarnation_left_mid_move(
    tmp_path: Path,
) -> None:
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    record = start(ledger)
    record.attach("engine-a")
    move(record, "engine-a", [0], random.Random(0))
    record.begin("engine-a", 1, [2])
    record.detach("engine-a")  # dirty: the move of layer 2 never committed
    ledger.close()
    offer = offered(path)
    assert isinstance(offer, RestoreOffer)
    assert (offer.incarnation, offer.version, offer.digest) == (1, 1, record.digest)


def test_a_killed_restored_incarnation_is_replayed_and_ended_at_the_next_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "l.sqlite"
    moved_ledger(path)
    child = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_restore_ledger import restore
        from ledger_support import open_ledger
        record = restore(open_ledger({str(path)!r}))
        record.attach("engine-b")
        record.begin("engine-b", record.version, [3])
        os._exit(0)  # no end recorded, as after SIGKILL
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    ledger = open_ledger(path)
    third = restore(ledger)  # ends incarnation 2 by replaying it, restores its version 2
    assert third.restored_from == RestoredFrom(2, 2, third.digest)
    ledger.close()
    with sqlite3.connect(path) as conn:
        ends = conn.execute(
            "SELECT incarnation_id, end_state FROM incarnations ORDER BY incarnation_id"
        ).fetchall()
    assert ends == [(1, "clean"), (2, "unknown"), (3, "clean")]
    assert verified(path) == []


@pytest.mark.parametrize(
    ("fields", "geometry", "checkpoint", "reason"),
    [
        ({}, Geometry(8, 16, 8), CHECKPOINT, "incarnation 1 has another geometry (8 layers x 12"),
        ({"checkpoint_digest": None}, SMALL, CHECKPOINT, "recorded no checkpoint identity"),
    ],
)
def test_another_geometry_or_an_incarnation_from_before_restores_offers_nothing(
    tmp_path: Path, fields: dict[str, object], geometry: Geometry, checkpoint: str, reason: str
) -> None:
    path = tmp_path / "l.sqlite"
    moved_ledger(path, **fields)
    offer = offered(path, geometry, checkpoint)
    assert isinstance(offer, NoOffer)
    assert reason in offer.reason


def test_a_new_checkpoint_of_the_same_geometry_is_offered_the_placement_naming_the_old_one(
    tmp_path: Path,
) -> None:
    """Issue 40, 3: the placement is valid for any weights of the same geometry; the offer names
    the identity its incarnation loaded, so the daemon can tell a new checkpoint."""
    path = tmp_path / "l.sqlite"
    first = moved_ledger(path)
    offer = offered(path, SMALL, "d" * 64)
    assert isinstance(offer, RestoreOffer)
    assert (offer.version, offer.digest, offer.checkpoint_digest) == (2, first.digest, CHECKPOINT)


def test_an_empty_ledger_offers_nothing(tmp_path: Path) -> None:
    assert offered(tmp_path / "l.sqlite") == NoOffer(
        "no earlier version (the ledger holds no incarnation)"
    )


def fingerprinted_ledger(path: Path, moves: int) -> None:
    """A closed ledger whose one incarnation committed ``moves`` versions, its first 6 slots'
    fingerprints recorded with each (an expert's fingerprint is its own wherever it lies)."""
    ledger = open_ledger(path)
    the_map = [list(row) for row in INITIAL]

    def fingerprints_of(layers: Sequence[int] | None = None) -> LocalFingerprints:
        chosen = range(SMALL.num_layers) if layers is None else layers
        return LocalFingerprints(
            0,
            {
                layer: tuple(
                    hashlib.sha256(f"{layer}:{expert}".encode()).hexdigest()
                    for expert in the_map[layer][:6]
                )
                for layer in chosen
            },
        )

    record = start(ledger, content=fingerprints_of())
    record.attach("engine-a")
    rng = random.Random(7)
    for number in range(moves):
        layers = sorted({number % SMALL.num_layers, (number + 3) % SMALL.num_layers})
        record.begin("engine-a", record.version, layers)
        rows = {layer: random_row(rng, SMALL) for layer in layers}
        the_map = [rows.get(layer, row) for layer, row in enumerate(the_map)]
        record.commit("engine-a", rows, fingerprints_of)
    ledger.close()


def offer_steps(ledger: Ledger) -> tuple[RestoreOffer | NoOffer, int]:
    """The offer, and how many SQLite virtual machine steps reading it took."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    with ledger.transaction("reading the offer of") as conn:
        driver = conn.connection.driver_connection
        driver.set_progress_handler(count, 1)
        try:
            offer = newest_offer(conn, SMALL, CHECKPOINT)
        finally:
            driver.set_progress_handler(None, 1)
    return offer, steps[0]


def test_the_offer_reads_what_its_version_rests_on_in_steps_that_do_not_grow_with_history(
    tmp_path: Path,
) -> None:
    """The map, its fingerprints and the chain links of the start and of the version's event:
    per layer and per link, so 400 versions cost the SQLite steps 4 versions do (a walk of the
    history would take 100 times more)."""
    measured = {}
    for moves in (4, 400):
        fingerprinted_ledger(tmp_path / f"l{moves}.sqlite", moves)
        ledger = open_ledger(tmp_path / f"l{moves}.sqlite")  # the daemon's next start
        offer, measured[moves] = offer_steps(ledger)
        ledger.close()
        assert isinstance(offer, RestoreOffer) and offer.version == moves
        assert offer.recorded is not None and sorted(offer.recorded.layers) == list(range(8))
    assert measured[400] <= measured[4] * 1.1, measured


def test_an_edit_the_offered_version_does_not_rest_on_is_left_to_verify(tmp_path: Path) -> None:
    """An attach's row edited: the offered rows, their digest and the events they rest on hold,
    so the offer stands; ``verify`` (the whole chain) names the edit."""
    path = tmp_path / "l.sqlite"
    moved_ledger(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET reason = 'edited' WHERE kind = 'attach'")
    offer = offered(path)
    assert isinstance(offer, RestoreOffer) and offer.version == 2
    assert any("chain" in problem for problem in verified(path)), verified(path)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            "UPDATE layout_rows SET slots = '[0,0,0,0,0,0,0,0,0,0,0,0]' "
            "WHERE version = 2 AND layer = 5",
            "its rows do not give the digest",
        ),
        ("UPDATE events SET reason = 'edited' WHERE kind = 'start'", "the events' chain breaks"),
        (
            "UPDATE versions SET digest = (SELECT digest FROM versions WHERE version = 1) "
            "WHERE version = 2",
            "the event that wrote it names",
        ),
    ],
)
def test_rows_that_do_not_verify_are_never_offered(tmp_path: Path, edit: str, problem: str) -> None:
    path = tmp_path / "l.sqlite"
    moved_ledger(path)
    with sqlite3.connect(path) as conn:
        conn.execute(edit)
    with pytest.raises(LedgerInconsistent, match=problem):
        offered(path)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            "DELETE FROM events WHERE kind = 'restore'",
            "incarnation 2 events: event #10 (attach by 'engine-b') follows the start of an "
            "incarnation whose row records a restore, where the restore event must be",
        ),
        (
            "UPDATE incarnations SET restored_from_incarnation = NULL, restored_from_version = "
            "NULL, restored_from_digest = NULL WHERE incarnation_id = 2",
            "incarnation 2 version_chain: version 0..1 is missing before version 2",
        ),
        (
            "UPDATE incarnations SET restored_from_version = 1 WHERE incarnation_id = 2",
            "incarnation 2 version_chain: version 1 is missing before version 2",
        ),
    ],
)
def test_verify_names_a_restored_incarnation_whose_row_and_events_disagree(
    tmp_path: Path, edit: str, problem: str
) -> None:
    path = tmp_path / "l.sqlite"
    restarted(path, attach="engine-b")
    with sqlite3.connect(path) as conn:
        conn.execute(edit)
    assert verified(path)[0] == problem


def test_verify_names_a_restore_whose_source_recorded_another_digest_for_that_version(
    tmp_path: Path,
) -> None:
    path = tmp_path / "l.sqlite"
    first = moved_ledger(path)
    ledger = open_ledger(path)
    at_2 = first.physical_to_logical_map()
    start(ledger, at_2, restored_from=RestoredFrom(1, 1, layout_digest(at_2)))  # not version 1's
    ledger.close()
    problems = verified(path)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"incarnation 2 digests: it restored version 1 of incarnation 1 with digest "
        f"{first.digest[:12]}, but that incarnation recorded "
    )


def test_retention_keeps_a_restored_incarnations_versions_from_its_first(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    moved_ledger(path)
    ledger = open_ledger(path)
    record = restore(ledger)
    record.attach("engine-b")
    rng = random.Random(3)
    for _ in range(6):
        move(record, "engine-b", [rng.randrange(SMALL.num_layers)], rng)
    (report,) = ledger.prune(3, record.incarnation_id)
    assert (report.keep_from_version, record.version) == (6, 8)
    ledger.close()
    assert verified(path) == []
    code = cli_main(["show", str(path), "--version", "5"])
    assert code != 0


def test_status_json_history_and_the_views_show_the_restore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "l.sqlite"
    first = restarted(path)
    assert cli_main(["status", "--json", str(path)]) == 6  # its daemon is not running
    (status,) = json.loads(capsys.readouterr().out)["ledgers"]
    assert (status["version"], status["restored_from"]) == (
        2,
        {"incarnation": 1, "version": 2, "digest": first.digest},
    )
    assert cli_main(["status", "--json", str(path), "--incarnation", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["ledgers"][0]["restored_from"] is None
    assert cli_main(["status", str(path)]) == 6
    assert (
        f"restored:            version 2 of incarnation 1 (digest {first.digest[:12]}) at its "
        f"start" in capsys.readouterr().out
    )
    assert cli_main(["history", str(path), "--kind", "restore"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith(
        f"inc=2  #9  restore base=2 version=2 digest={first.digest[:12]}  (restored version 2 "
        f"of incarnation 1)"
    )
    with sqlite3.connect(path) as conn:
        assert conn.execute(
            "SELECT incarnation_id, current_version, current_digest, initial_digest "
            "FROM ledger_incarnations ORDER BY incarnation_id"
        ).fetchall() == [
            (1, 2, first.digest, layout_digest(INITIAL)),
            (2, 2, first.digest, first.digest),
        ]


def _migrate(path: Path, action: object, revision: str) -> None:
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        action(alembic_config(conn), revision)  # type: ignore[operator]
    engine.dispose()


def test_a_downgrade_refuses_a_ledger_holding_a_restored_incarnation(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    moved_ledger(path)
    _migrate(path, command.downgrade, "0007_fingerprint_digests")  # nothing restored: it goes
    assert isinstance(offered(path), NoOffer)  # back up, a ledger from before restores
    restarted(path)
    with pytest.raises(SchemaDowngradeRefused, match="holds 1 restored incarnations"):
        _migrate(path, command.downgrade, "0007_fingerprint_digests")
    assert verified(path) == []


def _restored_start(
    ledger: Ledger, held: dict[int, tuple[str, ...]], verdict: str | None = None
) -> LayoutRecord:
    """A restored start of the newest offered version, its slots holding ``held``; its load's
    ``verdict`` in the start's transaction: None (clean), ``"dirty"`` (a slot read wrong) or
    ``"changed"`` (another checkpoint)."""
    from layout_ledger.core.content import LocalFingerprints

    offer = ledger.restore_offer(SMALL, CHECKPOINT)
    assert isinstance(offer, RestoreOffer)
    restored = RestoredFrom(offer.incarnation, offer.version, offer.digest)

    def after(record: LayoutRecord) -> None:
        if verdict == "dirty":
            record.mark_content_dirty([0], "layer 0: slot 2 holds expert 2, not expert 3")
        elif verdict == "changed":
            record.note_checkpoint_changed("the checkpoint changed: identity c -> d")

    return start(
        ledger,
        offer.physical_to_logical_map,
        restored_from=restored,
        content=LocalFingerprints(0, held),
        after_start=after,
    )


def _content_ledger(path: Path, verdicts: list[str | None]) -> list[str]:
    """Incarnation 1 commits version 1 (its slots fingerprinted); each next one restores it
    with the load's verdict given, its slots holding other bytes (seed 8's, or a bad read's)
    whenever the verdict or the old code's bug would have it. ``verify``'s inconsistencies."""
    from content_support import Slots

    ledger = open_ledger(path)
    slots = Slots(INITIAL, 0, SMALL.num_physical_slots)
    record = start(ledger, content=slots.fingerprints())
    record.attach("engine-a")
    record.begin("engine-a", 0, [0])
    row = list(INITIAL[0])
    row[0], row[1] = row[1], row[0]
    slots.fill(0, row)
    record.commit("engine-a", {0: row}, slots.fingerprints)
    ledger.close()
    other = {
        layer: tuple(f"{layer:02d}{slot:02d}" + "e" * 60 for slot, _ in enumerate(held))
        for layer, held in slots.held_tuples().items()
    }
    for verdict in verdicts:
        ledger = open_ledger(path)
        _restored_start(
            ledger,
            other if verdict != "same" else slots.held_tuples(),
            None if verdict in ("same", "trusted") else verdict,
        )
        ledger.close()
    return verified(path)


def test_verify_names_a_version_whose_contents_differ_across_incarnations_without_a_change(
    tmp_path: Path,
) -> None:
    """Issue 40, 4: the ledger today's main left after seed 7, then two restarts on seed 8 (the
    first dirty from its load, the second trusting its record: clean): version 1 names one
    digest with two contents, and verify says so."""
    found = _content_ledger(tmp_path / "l.sqlite", ["dirty", "trusted"])
    assert found == [
        "incarnation 3 contents: version 1 (digest "
        f"{layout_digest([[1, 0, *INITIAL[0][2:]], *INITIAL[1:]])[:12]}) holds other contents "
        f"than in incarnation 1 (layer 0 slot 0: 0000eeeeeeee here, "
        f"{_fingerprint_of(0, 1)[:12]} there) without a checkpoint_changed between them: a "
        f"record of a load that went wrong was trusted"
    ]


def test_verify_accepts_contents_that_changed_with_a_checkpoint_changed_between_them(
    tmp_path: Path,
) -> None:
    assert _content_ledger(tmp_path / "l.sqlite", ["changed", "trusted"]) == []
    # the second restart on the new bytes is compared with the first, never with incarnation 1
    # (a checkpoint_changed lies between them)
    with LedgerReader(tmp_path / "l.sqlite") as reader:
        report = collect_verify(reader)
    details = {r.incarnation_id: r.detail for r in report.checks if r.check == "contents"}
    assert details[2] == "version 1: no earlier clean incarnation of the same checkpoint holds it"
    assert details[3] == (
        "version 1's contents are those incarnations [2] recorded for it (same checkpoint)"
    )


def _fingerprint_of(layer: int, expert: int) -> str:
    from content_support import expert_fingerprint

    return expert_fingerprint(layer, expert)
