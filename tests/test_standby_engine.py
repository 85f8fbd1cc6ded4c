"""A warm standby's forward passes across real engine ranks (gloo groups of 2 and 4).

The ranks are ``EngineRanks`` (tests/test_engine_startup_hook.py): real sglang world groups on
gloo, the real (hooked) startup, then ``sglang_integration.testing.standby_steps`` drives
forward passes through the hook on ``ModelRunner.forward`` (``engine.standby.around_forward``)
around a stand-in forward that meets the other ranks in a barrier, as the model's collectives
do, and records the map this rank routes with and whether its daemon lists its lease. Each rank
has its own model-less daemon with a ledger; a mover engine (``EngineStandIn``, another process)
moves experts on them.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_engine_startup_hook import INITIAL as HOOK_INITIAL
from test_engine_startup_hook import (
    EngineRanks,
    models,  # noqa: F401 (fixtures of the one-rank engine)
    one_rank,  # noqa: F401
    scripted_peer,
    sglang_context,
    warnings_of,
)
from test_engine_startup_ranks import (
    FIRST_MOVE,
    INITIAL,
    NUM_REDUNDANT,
    SECOND_MOVE,
    after,
    daemons,
    scenario,
)

from layout_ledger.core.layout import layout_digest
from sglang_integration.engine import client
from sglang_integration.testing.cpu_engine import write_tiny_moe_config
from sglang_integration.testing.daemon_control import DaemonProcess, EngineStandIn

pytestmark = pytest.mark.timeout(300)

NUM_LAYERS = 3
NUM_LOGICAL = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_config(tmp_path_factory.mktemp("model") / "moe", NUM_LAYERS, NUM_LOGICAL)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[EngineRanks]:
    sglang_context()
    with EngineRanks(
        request.param, model_dir, enable_eplb=True, ep_num_redundant_experts=NUM_REDUNDANT
    ) as engine_ranks:
        yield engine_ranks


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path) -> Iterator[EngineRanks]:
    with EngineRanks(
        2, model_dir, enable_eplb=True, ep_num_redundant_experts=NUM_REDUNDANT
    ) as engine_ranks:
        yield engine_ranks


def standby(started: list[DaemonProcess], model_dir: Path, then: list, idle: float = 30) -> dict:
    return scenario(
        started,
        model_dir=model_dir,
        env={
            "SGLANG_EXPERT_LAYOUT_ROLE": "standby",
            "SGLANG_EXPERT_LAYOUT_STANDBY_IDLE": str(idle),
            "SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT": "20",
        },
        then=then,
    )


def later(then: list) -> dict[str, Any]:
    return {"continue": True, "then": then}


def leases_of(daemon: DaemonProcess) -> list[str]:
    layout = client.query(daemon.socket_path).layout
    assert layout is not None
    return list(layout.leases)


def kinds(daemon: DaemonProcess, *wanted: str) -> list[str]:
    with sqlite3.connect(f"file:{daemon.ledger_path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT kind FROM events ORDER BY event_id").fetchall()
    return [kind for (kind,) in rows if kind in wanted]


def ok(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["error"] is None, report.get("traceback")


class Mover:
    """An active engine on every daemon, moving them one after the other (as its ranks would)."""

    def __init__(self, started: list[DaemonProcess], engine_id: str = "mover") -> None:
        self.stand_ins = [EngineStandIn.start(d.socket_path, engine_id) for d in started]
        self.versions = [s.attach_reply.layout.version for s in self.stand_ins]

    def begin(self, rows: dict[int, list[int]], which: list[int] | None = None) -> list[Any]:
        picked = range(len(self.stand_ins)) if which is None else which
        return [self.stand_ins[i].begin(self.versions[i], sorted(rows)) for i in picked]

    def commit(self, rows: dict[int, list[int]], which: list[int] | None = None) -> None:
        for i in range(len(self.stand_ins)) if which is None else which:
            committed = self.stand_ins[i].commit(rows)
            assert committed.ok, committed
            self.versions[i] = committed.body["version"]

    def move(self, rows: dict[int, list[int]]) -> None:
        assert all(reply.ok for reply in self.begin(rows))
        self.commit(rows)

    def exit(self) -> None:
        for stand_in in self.stand_ins:
            stand_in.exit()


def test_a_standby_starts_with_its_lease_and_releases_it_on_every_rank_when_idle(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        # idle long enough that the busy begin below meets the lease on a loaded machine
        reports = ranks.run(standby(started, model_dir, then=[], idle=4.0))
        ok(reports)
        engine_id = reports[0]["session"]["engine_id"]
        assert all(leases_of(d) == [engine_id] for d in started)
        mover = Mover(started)
        try:
            busy = mover.begin(FIRST_MOVE)  # while the standby holds its lease: busy
            assert [reply.outcome.value for reply in busy] == ["busy"] * ranks.world_size
            deadline = time.monotonic() + 30
            while any(leases_of(d) for d in started):
                assert time.monotonic() < deadline, "the idle standby never released its lease"
                time.sleep(0.05)
            mover.move(FIRST_MOVE)  # released on every rank: the active engine moves again
        finally:
            mover.exit()
        for daemon in started:
            assert kinds(daemon, "lease", "release") == ["lease", "release"]


def test_no_forward_runs_before_every_rank_holds_its_lease_and_routes_with_the_current_map(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        ok(ranks.run(standby(started, model_dir, then=[["wait_released", 20]], idle=0.3)))
        mover = Mover(started)
        try:
            mover.move(FIRST_MOVE)  # moves while the standby is attached: not paused
            mover.move(SECOND_MOVE)
        finally:
            mover.exit()
        reports = ranks.run(later([["forward"], ["forward"]]))
        ok(reports)
        expected = after(FIRST_MOVE, SECOND_MOVE)
        for report in reports:
            assert report["raised"] is None, report
            first, second = report["forwards"]
            assert first["leased"] and first["map"] == expected == first["daemon_map"]
            assert first["same_addresses"], "the metadata was not updated in place"
            assert second["leased"] and second["map"] == expected
            gate = report["gate"]
            assert (gate["version"], gate["digest"]) == (2, layout_digest(expected))
            assert gate["acquisitions"] == 1  # one collective, the second forward a flag check


def test_a_standby_that_holds_its_lease_makes_the_movers_begins_busy(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * 2) as started:
        ok(two_ranks.run(standby(started, model_dir, then=[["forward"]])))
        mover = Mover(started)
        try:
            assert [r.outcome.value for r in mover.begin(FIRST_MOVE)] == ["busy", "busy"]
        finally:
            mover.exit()


def test_a_standby_holds_its_lease_through_a_whole_batch_also_the_first_after_an_idle_spell(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    # The idle time counts from the last batch's end, so the first batch after an idle spell
    # starts "idle": an idle release firing in it (its check ran just before the batch began)
    # must leave the lease alone, or the active engine moves experts under the running batch.
    steps = [["forward"], ["wait_released", 20], ["forward", 1.2]]
    with daemons(tmp_path, ["ledger"] * 2) as started:
        reports = two_ranks.run(standby(started, model_dir, then=steps, idle=0.3))
        ok(reports)
        for report in reports:
            assert report["raised"] is None, report
            batch = report["forwards"][-1]
            assert batch["leased"], "the standby's lease was released while its batch ran"
        for daemon in started:  # leased at start, released when idle, leased for the batch
            assert kinds(daemon, "lease", "release")[:3] == ["lease", "release", "lease"]


def test_a_lease_busy_on_one_rank_holds_every_rank_and_the_granted_ones_release(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * 2) as started:
        ok(two_ranks.run(standby(started, model_dir, then=[["forget"]])))
        mover = Mover(started)
        try:
            assert mover.begin(FIRST_MOVE, which=[1])[0].ok  # a move pending on rank 1 only
            two_ranks.start(later([["forward"]]))
            time.sleep(1.5)
            assert leases_of(started[1]) == []  # rank 1 waits
            mover.stand_ins[1].abort()
            reports = two_ranks.collect()
        finally:
            mover.exit()
        ok(reports)
        for report in reports:
            assert report["raised"] is None
            (forward,) = report["forwards"]
            assert forward["leased"] and forward["map"] == INITIAL
        # Rank 0 was granted each round and released while rank 1 was busy: all or none.
        granted = kinds(started[0], "lease", "release")
        assert granted[:4] == ["lease", "release", "lease", "release"] and granted[-1] == "lease"
        assert kinds(started[1], "lease_busy") == ["lease_busy"]  # repeats count on one row


def test_a_move_pending_past_the_wait_timeout_fails_every_rank_naming_the_mover(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * 2) as started:
        ok(two_ranks.run(standby(started, model_dir, then=[["forget"]])))
        mover = Mover(started, engine_id="hung-mover")
        try:
            assert all(reply.ok for reply in mover.begin(FIRST_MOVE))
            two_ranks.start(later([["forward"]]))
            reports = two_ranks.collect(timeout=60)
        finally:
            mover.exit()
    raised = [report["raised"] for report in reports]
    assert raised[0] is not None and raised == [raised[0]] * 2, raised
    assert raised[0].startswith("ExpertLayoutStartupError: this standby engine waited 20 s")
    assert "'hung-mover'" in raised[0]
    assert all(report["forwards"] == [] for report in reports)


def test_a_mover_killed_mid_move_makes_the_standbys_first_forward_refuse_as_startup_would(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * 2) as started:
        ok(two_ranks.run(standby(started, model_dir, then=[["release_now"]])))
        mover = Mover(started)
        assert all(reply.ok for reply in mover.begin(FIRST_MOVE))
        for stand_in in mover.stand_ins:
            stand_in.kill()  # SIGKILL mid-move: every daemon dirty
        deadline = time.monotonic() + 30
        while not all(client.query(d.socket_path).layout.dirty for d in started):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        reports = two_ranks.run(later([["forward"]]))
        # What an engine starting on these daemons reaches (model-less daemons record no
        # content, so nothing can be repaired): the same refusal.
        fresh = two_ranks.run(scenario(started, model_dir=model_dir))
    raised = [report["raised"] for report in reports]
    assert raised[0] is not None and raised == [raised[0]] * 2
    assert all(report["forwards"] == [] for report in reports)
    assert raised[0] == fresh[0]["error"]


def test_a_standbys_eof_never_dirties_the_daemon(tmp_path: Path) -> None:
    with daemons(tmp_path, ["ledger"]) as (daemon,):
        mover = Mover([daemon])
        try:
            assert mover.begin(FIRST_MOVE)[0].ok
            script = (
                "import sys, time\n"
                "from sglang_integration.engine import client\n"
                "a = client.attach(sys.argv[1], 'standby-c', role='standby')\n"
                "assert a.reply.ok, a.reply\n"
                "print('attached', flush=True)\n"
                "time.sleep(600)\n"
            )
            child = subprocess.Popen(
                [sys.executable, "-c", script, daemon.socket_path],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None and child.stdout.readline() == "attached\n"
            child.kill()  # SIGKILL while another engine's move is pending
            child.wait(10)
            deadline = time.monotonic() + 10
            while "standby-c" in client.query(daemon.socket_path).layout.attached:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert not client.query(daemon.socket_path).layout.dirty
            mover.commit(FIRST_MOVE)
        finally:
            mover.exit()


def _daemon_before_roles(layout: dict[str, Any]) -> Any:
    """A daemon of this plugin from before roles: attach and query answer the layout without a
    role (nor standbys, nor leases); the requests it does not know get sglang's reply."""

    def handle(conn: Any) -> None:
        from sglang.srt.weight_cache.protocol import recv_msg, send_msg

        request = recv_msg(conn)
        kind = request.get("type")
        if kind in ("expert_layout_attach", "expert_layout_query"):
            send_msg(conn, {"status": "ok", "layout": layout})
        else:
            send_msg(conn, {"status": "error", "message": f"Unknown request type: {kind}"})

    return handle


@pytest.mark.timeout(180)
def test_a_standby_on_a_daemon_from_before_roles_runs_as_active_and_warns_once(
    one_rank: EngineRanks,  # noqa: F811 (the fixture imported above)
    models: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    layout = {
        "version": 0,
        "digest": layout_digest(HOOK_INITIAL),
        "physical_to_logical_map": HOOK_INITIAL,
        "dirty": False,
        "dirty_reason": None,
        "pending": None,
        "attached": [],
        "non_following_fetch": False,
    }
    with scripted_peer(tmp_path / "d.sock", _daemon_before_roles(layout)):
        (report,) = one_rank.run(
            {
                "model_dir": str(models["moe"]),
                "args": {"weight_cache_mode": "client"},
                "sockets": [str(tmp_path / "d.sock")],
                "env": {"SGLANG_EXPERT_LAYOUT_ROLE": "standby"},
                "then": [["forward"]],
            }
        )
    assert report["error"] is None, report.get("traceback")
    assert report["gate"] is None  # no gate: an active engine's forward runs at once
    assert report["forwards"] and report["raised"] is None
    warned = [text for text in warnings_of(report) if "know no roles" in text]
    assert len(warned) == 1 and "runs as an active engine" in warned[0]


@pytest.mark.parametrize("layers", [[0, 2], [0, 1, 2]], ids=["some layers", "every layer"])
def test_the_in_place_copy_writes_what_sglangs_update_writes_and_keeps_the_tensors(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path, layers: list[int]
) -> None:
    target = after(FIRST_MOVE, SECOND_MOVE)
    with daemons(tmp_path, ["ledger"] * 2) as started:
        reports = two_ranks.run(
            standby(started, model_dir, then=[["compare_update", target, layers]])
        )
    ok(reports)
    for report in reports:
        assert report["compare_update"] == {"same": True, "kept": True}


def test_an_idle_standby_prepares_the_newest_map_off_the_forward_path(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * 2) as started:
        ok(two_ranks.run(standby(started, model_dir, then=[["wait_released", 20]], idle=0.3)))
        mover = Mover(started)
        try:
            mover.move(FIRST_MOVE)
        finally:
            mover.exit()
        reports = two_ranks.run(later([["sleep", 3.0], ["forward"]]))
    ok(reports)
    expected = after(FIRST_MOVE)
    for report in reports:
        (forward,) = report["forwards"]
        assert forward["leased"] and forward["map"] == expected and forward["same_addresses"]
        assert report["gate"]["prepared_adoptions"] == 1
