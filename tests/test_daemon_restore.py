"""A restarted daemon keeps the balance: it restores its ledger's last committed version.

Model-less daemons (sglang's real serve loop with the plugin, a real ledger) killed with SIGKILL
and started again on the same ledger: the new incarnation starts at the last committed version's
number and digest, an engine without the plugin is refused as after a move, ``verify`` stays
clean, and a daemon whose ledger offers nothing restorable loads the initial layout with one
warning naming why. With ``--experts`` (the CPU stand-in for a daemon's loaded tensors, written
by the harness into the restored map as sglang's loader writes a real daemon's), each slot is
checked against what the ledger recorded for its expert.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import Geometry, layout_digest, trivial_map
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.wire import protocol as msg
from sglang_integration.engine import client
from sglang_integration.testing.daemon import model_less_cache_config
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
    start_daemon,
)
from sglang_integration.testing.shared_experts import ExpertTensorShape, create_shared_experts

pytestmark = pytest.mark.timeout(180)

LAYERS, LOGICAL, PHYSICAL = 3, 6, 8
GEOMETRY = Geometry(LAYERS, PHYSICAL, LOGICAL)
INITIAL = trivial_map(LAYERS, PHYSICAL, LOGICAL)
# Slots 6 and 7 replicate experts 0 and 1; a move gives every layer another order.
ROW = [5, 4, 3, 2, 1, 0, 5, 4]
MOVED = [ROW, INITIAL[1], ROW]


def start(directory: Path, *extra: str, layers: int = LAYERS, **options: Any) -> DaemonProcess:
    return start_daemon(
        directory,
        num_layers=layers,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        extra=list(extra),
        **options,
    )


def layout(daemon: DaemonProcess) -> dict[str, Any]:
    reply = request(daemon.socket_path, {"type": msg.QUERY})
    assert reply["status"] == "ok", reply
    result: dict[str, Any] = reply["layout"]
    return result


def move_to_moved(daemon: DaemonProcess, engine_id: str = "engine-a") -> None:
    """Two commits (versions 1 and 2) that leave the layout at ``MOVED``."""
    engine = EngineStandIn.start(daemon.socket_path, engine_id)
    try:
        assert engine.begin(0, [0]).ok and engine.commit({0: ROW}).ok
        assert engine.begin(1, [2]).ok and engine.commit({2: ROW}).ok
    finally:
        engine.exit()


def verified(path: str) -> str | None:
    with LedgerReader(path) as reader:
        return collect_verify(reader).first_inconsistency


def test_a_killed_daemon_restarts_at_its_last_committed_version_and_refuses_older_engines(
    tmp_path: Path,
) -> None:
    first = start(tmp_path)
    move_to_moved(first)
    first.kill()  # SIGKILL: no clean end

    second = start(tmp_path)
    try:
        state = layout(second)
        digest = layout_digest(MOVED)
        assert (state["version"], state["digest"], state["physical_to_logical_map"]) == (
            2,
            digest,
            MOVED,
        )
        assert state["restored_from"] == {"incarnation": 1, "version": 2, "digest": digest}
        # an engine without the plugin routes with the initial layout: refused, as after a move
        older = request(
            second.socket_path,
            {"type": "fetch_state", "config": model_less_cache_config(GEOMETRY)},
        )
        assert older["status"] == msg.LAYOUT_REFUSED
        assert "this daemon's experts have moved (layout version 2)" in older["reason"]
        # an engine with it starts from version 2 and moves on to 3
        engine = client.attach(second.socket_path, "engine-b")
        assert engine.reply.layout is not None and engine.reply.layout.version == 2
        assert client.begin(second.socket_path, "engine-b", 2, [1]).ok
        committed = client.commit(second.socket_path, "engine-b", {1: ROW})
        assert committed.body["version"] == 3
        engine.close()
    finally:
        assert second.stop() == 0
    assert second.ledger_path is not None
    assert verified(second.ledger_path) is None
    with sqlite3.connect(second.ledger_path) as conn:
        rows = conn.execute(
            "SELECT incarnation_id, end_state, current_version FROM ledger_incarnations"
        ).fetchall()
        restored = conn.execute(
            "SELECT incarnation_id, base_version, new_version FROM ledger_events "
            "WHERE kind = 'restore'"
        ).fetchall()
    assert rows == [(1, "unknown", 2), (2, "clean", 3)]
    assert restored == [(2, 2, 2)]


def test_fleet_agrees_again_once_a_killed_daemon_restarts_and_restores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from layout_ledger.cli.app import main as cli_main

    daemons = [start(tmp_path, "--tp-rank", str(r), name=f"daemon{r}") for r in (0, 1)]
    engine = [EngineStandIn.start(d.socket_path, "engine-a") for d in daemons]
    try:
        for stand_in in engine:
            assert stand_in.begin(0, [0]).ok and stand_in.commit({0: ROW}).ok
        daemons[1].kill()
        daemons[1] = start(tmp_path, "--tp-rank", "1", name="daemon1")
        paths = [str(d.ledger_path) for d in daemons]
        assert cli_main(["fleet", "--json", *paths]) == 0
        verdict = json.loads(capsys.readouterr().out)["verdict"]
        assert (verdict["outcome"], verdict["version"]) == ("adopt", 1)
    finally:
        for stand_in in engine:
            stand_in.kill()
        for daemon in daemons:
            daemon.kill()


def test_a_ledger_that_offers_nothing_restorable_loads_the_initial_layout_and_says_why(
    tmp_path: Path,
) -> None:
    first = start(tmp_path)
    move_to_moved(first)
    assert first.stop() == 0
    ledger = str(first.ledger_path)

    cases = [
        (
            {"layers": LAYERS + 1},
            [],
            "nothing to restore: rank 0 (ledger {ledger}): incarnation 1 has another geometry",
        ),
        ({}, ["--expert-layout-restore", "initial"], "--expert-layout-restore initial on rank 0"),
    ]
    for options, extra, reason in cases:
        daemon = start(tmp_path, *extra, **options)
        try:
            state = layout(daemon)
            assert (state["version"], state["restored_from"]) == (0, None)
            warning = (
                f"expert layout ledger {ledger}: loading sglang's initial layout at "
                f"version 0: " + reason.format(ledger=ledger)
            )
            assert warning in daemon.log()
        finally:
            assert daemon.stop() == 0
        # back to incarnation 1's geometry and layout: the next case starts from version 2
        move_to_moved(restarted := start(tmp_path, "--expert-layout-restore", "initial"))
        assert restarted.stop() == 0

    with sqlite3.connect(ledger) as conn:  # rows edited in the file: nothing is restored
        conn.execute("UPDATE layout_rows SET slots = '[0,1,2,3,4,5,0,0]' WHERE version = 2")
    daemon = start(tmp_path)
    try:
        assert (layout(daemon)["version"], layout(daemon)["restored_from"]) == (0, None)
        assert (
            f"version 0: a ledger cannot be read or its rows do not verify: rank 0 (ledger "
            f"{ledger}): its rows do not verify: " in daemon.log()
        )
    finally:
        assert daemon.stop() == 0


SHAPE = ExpertTensorShape(LAYERS, LOGICAL, PHYSICAL, ep_size=1)


def moved_in_shared_bytes(tmp_path: Path) -> tuple[Path, DaemonProcess]:
    """A daemon over shared expert files, at version 1: layer 0 moved to ``ROW`` in the shared
    bytes and committed by an engine that has since detached. Its expert files and the daemon."""
    experts_dir = tmp_path / "experts"
    experts = create_shared_experts(experts_dir, 0, SHAPE, INITIAL)
    daemon = start(tmp_path, "--experts", str(experts_dir))
    engine = EngineStandIn.start(daemon.socket_path, "engine-a")
    try:
        assert engine.begin(0, [0]).ok
        experts.fill([ROW, INITIAL[1], INITIAL[2]])  # the move, in the shared bytes
        assert engine.commit({0: ROW}).ok
    finally:
        engine.exit()
    return experts_dir, daemon


def test_each_slot_loaded_into_the_restored_layout_is_checked_against_the_ledger(
    tmp_path: Path,
) -> None:
    experts_dir, first = moved_in_shared_bytes(tmp_path)
    first.kill()
    restored = [ROW, INITIAL[1], INITIAL[2]]

    # the loader writes every slot as the restored map names it: clean
    create_shared_experts(experts_dir, 0, SHAPE, restored)
    second = start(tmp_path, "--experts", str(experts_dir))
    try:
        state = layout(second)
        assert (state["version"], state["dirty"]) == (1, False)
    finally:
        second.kill()

    # slot 2 of layer 0 (expert 3, its only copy) loaded with expert 2's bytes: named, dirty
    wrong = [list(row) for row in restored]
    wrong[0][2] = 2
    create_shared_experts(experts_dir, 0, SHAPE, wrong)
    third = start(tmp_path, "--experts", str(experts_dir))
    try:
        state = layout(third)
        assert (state["version"], state["dirty"]) == (1, True)
        assert state["dirty_reason"].startswith(
            "the weights loaded into the restored version 1 of incarnation 2 do not hold what "
            "incarnation 2's clean load of the same checkpoint recorded for those experts: "
            "layer 0: slot 2 holds expert 2, not expert 3"
        )
        fetch = request(
            third.socket_path,
            {"type": "fetch_state", "config": model_less_cache_config(GEOMETRY)},
        )
        assert fetch["status"] == msg.LAYOUT_REFUSED  # dirty from its start
    finally:
        third.stop()


def test_a_load_that_went_wrong_is_never_the_baseline_of_a_later_restore(tmp_path: Path) -> None:
    """Issue 40, 4: an incarnation dirty from its own load (same checkpoint, a slot read wrong)
    recorded what that load left; the next restarts on the same files judge their slots against
    the clean load before it, never against it: right bytes come up clean, wrong bytes dirty,
    as often as they are restarted, and verify finds every version's contents consistent."""
    experts_dir, first = moved_in_shared_bytes(tmp_path)
    first.stop()
    restored = [ROW, INITIAL[1], INITIAL[2]]
    wrong = [list(row) for row in restored]
    wrong[0][2] = 2  # slot 2 (expert 3, its only copy) read with expert 2's bytes
    verdicts = []
    for held in (restored, wrong, restored, restored, wrong, restored):
        create_shared_experts(experts_dir, 0, SHAPE, held)
        daemon = start(tmp_path, "--experts", str(experts_dir))
        try:
            state = layout(daemon)
            assert state["version"] == 1
            verdicts.append(state["dirty"])
        finally:
            daemon.stop()
    assert verdicts == [False, True, False, False, True, False]
    with sqlite3.connect(f"file:{first.ledger_path}?mode=ro", uri=True) as conn:
        dirty_from_load = conn.execute(
            "SELECT incarnation_id FROM ledger_checkpoints WHERE load_dirty ORDER BY 1"
        ).fetchall()
    assert dirty_from_load == [(3,), (6,)]
    assert first.ledger_path is not None and verified(first.ledger_path) is None
