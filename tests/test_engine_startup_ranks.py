"""Startup agreement across real engine ranks (gloo groups of 2 and 4), one daemon per rank.

Each rank is a fresh process with sglang's real world group on gloo, calling sglang's real
(hooked) ``ModelRunner.maybe_init_expert_location_metadata`` (``EngineRanks`` in
tests/test_engine_startup_hook.py); each has its own model-less daemon (sglang's real
``WeightCacheDaemon`` serve loop with the plugin's daemon hooks and a ledger,
``sglang_integration.testing.daemon_control.start_daemon``). Daemon states come from what a
real engine does: another engine attached to the same daemon (``EngineStandIn``, a separate
process) begins and commits moves, holds a move pending, or is killed with SIGKILL mid-move.

Every case asserts what every rank did: the same error text on every rank (so none is left in a
collective), or the same adopted map.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_engine_startup_hook import (
    NUM_LAYERS,
    NUM_LOGICAL,
    EngineRanks,
    model_less_daemon,
    scripted_peer,
    sglang_context,
    warnings_of,
)

from layout_ledger.core.layout import layout_digest, trivial_map
from sglang_integration.engine import client
from sglang_integration.testing.cpu_engine import write_tiny_moe_config
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    start_daemon,
)

NUM_REDUNDANT = 4  # 12 slots: divisible by EP 2 and EP 4
NUM_SLOTS = NUM_LOGICAL + NUM_REDUNDANT
INITIAL = trivial_map(NUM_LAYERS, NUM_SLOTS, NUM_LOGICAL)
# Two moves of a mover engine: layers 0 and 2, then layer 1.
FIRST_MOVE = {
    0: [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 0, 1],
    2: [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4],
}
SECOND_MOVE = {1: [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 2, 3]}


def after(*moves: dict[int, list[int]]) -> list[list[int]]:
    the_map = [list(row) for row in INITIAL]
    for move in moves:
        for layer, row in move.items():
            the_map[layer] = list(row)
    return the_map


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


@pytest.fixture
def two_ranks(model_dir: Path) -> Iterator[EngineRanks]:
    with EngineRanks(
        2, model_dir, enable_eplb=True, ep_num_redundant_experts=NUM_REDUNDANT
    ) as engine_ranks:
        yield engine_ranks


@contextlib.contextmanager
def daemons(directory: Path, records: Sequence[str]) -> Iterator[list[DaemonProcess]]:
    """One model-less daemon per rank; ``records[r]`` is ledger, none or no-plugin."""
    started: list[DaemonProcess] = []
    try:
        for rank, record in enumerate(records):
            started.append(
                start_daemon(
                    directory,
                    f"rank{rank}",
                    num_layers=NUM_LAYERS,
                    num_logical_experts=NUM_LOGICAL,
                    num_physical_experts=NUM_SLOTS,
                    record=record,
                )
            )
        yield started
    finally:
        for daemon in started:
            daemon.stop()


def move(daemon: DaemonProcess, *moves: dict[int, list[int]], engine_id: str = "mover") -> None:
    """Another engine attaches, commits ``moves`` one after the other, and exits."""
    mover = EngineStandIn.start(daemon.socket_path, engine_id)
    try:
        version = mover.attach_reply.layout.version
        for rows in moves:
            assert mover.begin(version, sorted(rows)).ok
            committed = mover.commit(rows)
            assert committed.ok, committed
            version = committed.body["version"]
    finally:
        mover.exit()


def wait_until_attached(daemon: DaemonProcess, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        reply = client.query(daemon.socket_path)
        if reply.layout is not None and len(reply.layout.attached) >= count:
            return
        assert time.monotonic() < deadline, f"{count} engines never attached to {daemon}"
        time.sleep(0.05)


def wait_until_dirty(daemon: DaemonProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        reply = client.query(daemon.socket_path)
        if reply.layout is not None and reply.layout.dirty:
            return
        assert time.monotonic() < deadline, f"{daemon} never turned dirty"
        time.sleep(0.05)


def scenario(daemon_list: Sequence[DaemonProcess], **extra: Any) -> dict[str, Any]:
    return {
        "model_dir": str(extra.pop("model_dir")),
        "args": {
            "weight_cache_mode": "client",
            "enable_eplb": True,
            "ep_num_redundant_experts": NUM_REDUNDANT,
        },
        "sockets": [d.socket_path for d in daemon_list],
        **extra,
    }


def the_same_error_on_every_rank(reports: Sequence[dict[str, Any]]) -> str:
    errors = [report["error"] for report in reports]
    assert errors[0] is not None
    assert errors == [errors[0]] * len(errors), errors
    assert errors[0].startswith("ExpertLayoutStartupError: ")
    return errors[0]


def test_daemons_at_the_same_version_are_adopted_by_every_rank(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        for daemon in started:
            move(daemon, FIRST_MOVE, SECOND_MOVE)
        reports = ranks.run(scenario(started, model_dir=model_dir))
        expected = after(FIRST_MOVE, SECOND_MOVE)
        engine_ids = set()
        for report in reports:
            assert report["error"] is None, report.get("traceback")
            assert report["map"] == expected
            assert report["session"]["finding"] == "record"
            assert report["session"]["attached"] is True
            assert report["session"]["version"] == 2
            assert report["session"]["digest"] == layout_digest(expected)
            assert any(
                "expert layout at version 2" in text and "replacing" in text
                for _, text in report["logs"]
            )
            engine_ids.add(report["session"]["engine_id"])
        (engine_id,) = engine_ids  # one id, shared by every rank
        # The attach connections stay open: each daemon lists this engine as attached.
        for daemon in started:
            probe = EngineStandIn.start(daemon.socket_path, "probe")
            try:
                assert engine_id in probe.attach_reply.layout.attached
            finally:
                probe.exit()


@pytest.mark.parametrize("enable_eplb", [True, False], ids=["eplb", "no-eplb"])
def test_the_agents_gloo_group_is_made_exactly_when_eplb_is_on(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path, enable_eplb: bool
) -> None:
    """sglang runs an EPLBManager, so a rebalance, so the agents' collectives, only with
    --enable-eplb: without it no rank makes the agents' group (a collective every rank makes
    or none does)."""
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        chosen = scenario(started, model_dir=model_dir)
        chosen["args"]["enable_eplb"] = enable_eplb
        reports = ranks.run(chosen)
    for report in reports:
        assert report["error"] is None, report.get("traceback")
        assert report["map"] == INITIAL
        assert report["session"]["agents_group"] is enable_eplb


def test_daemons_at_version_zero_leave_the_initial_layout_as_it_is(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        reports = ranks.run(scenario(started, model_dir=model_dir))
    for report in reports:
        assert report["error"] is None
        assert report["map"] == INITIAL
        assert report["session"]["version"] == 0
        assert any("equal to" in text for _, text in report["logs"])


def test_daemons_no_daemon_can_bring_to_the_newest_fail_every_rank_naming_ranks_and_versions(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    """Rank 1's daemon two versions ahead: a move commits one version, and these model-less
    daemons cannot reload from a checkpoint, so no daemon can reach the newest layout."""
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        for rank, daemon in enumerate(started):
            move(daemon, *([FIRST_MOVE, SECOND_MOVE] if rank == 1 else []))
        reports = ranks.run(scenario(started, model_dir=model_dir))
    error = the_same_error_on_every_rank(reports)
    assert error.startswith(
        "ExpertLayoutStartupError: converging the weight cache daemons on version 2 (digest "
        f"{layout_digest(after(FIRST_MOVE, SECOND_MOVE))[:12]}, the newest any of them "
        "committed) failed at the reload: "
    )
    assert (
        f"rank 0 (daemon {started[0].socket_path}, at version 0): reload refused: this daemon "
        "cannot reload from its checkpoint: this daemon has no checkpoint reloader"
    ) in error
    for report in reports:
        assert report["session"] is None
        assert report["map"] == INITIAL  # nothing adopted


def _refuse_every_fetch(configs: list[dict[str, Any]]) -> Any:
    """A scripted daemon that answers attach as an older daemon and keeps each fetch's config."""

    def handle(conn: socket.socket) -> None:
        from sglang.srt.weight_cache.protocol import recv_msg, send_msg

        request_ = recv_msg(conn)
        if request_.get("type") == "fetch_state":
            configs.append(dict(request_["config"]))
            send_msg(conn, {"status": "layout_refused", "reason": "capture"})
        else:
            send_msg(conn, {"status": "error", "message": f"Unknown request type: {request_}"})

    return handle


def test_converge_a_rank_fetches_while_converging_with_its_own_daemons_digest(
    two_ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    """Rank 1's daemon one version ahead, every expert rank 0's target slots need held: the
    engine starts routing with what the daemons hold (the move comes after the load), and each
    rank's fetch (sglang's real IPC loader) declares its own daemon's version and digest, which
    that daemon serves (daemons stating the engine's ``CacheConfig``, as in test_loader_layout)."""
    captured: list[list[dict[str, Any]]] = [[], []]  # each rank's, from its own peer
    peers = [tmp_path / f"capture{rank}.sock" for rank in range(2)]
    with (
        scripted_peer(peers[0], _refuse_every_fetch(captured[0])),
        scripted_peer(peers[1], _refuse_every_fetch(captured[1])),
    ):
        capture = scenario([], model_dir=model_dir, fetch="fetch")
        reports = two_ranks.run({**capture, "sockets": [str(peer) for peer in peers]})
    assert [len(each) for each in captured] == [1, 1], reports
    configs = [each[0] for each in captured]
    with contextlib.ExitStack() as stack:
        started = [
            stack.enter_context(
                model_less_daemon(
                    tmp_path / f"d{rank}",
                    cache_config=configs[rank],
                    num_physical_experts=NUM_SLOTS,
                )
            )
            for rank in range(2)
        ]
        move(started[0], FIRST_MOVE)
        move(started[1], FIRST_MOVE, SECOND_MOVE)
        reports = two_ranks.run(scenario(started, model_dir=model_dir, fetch="fetch"))
    held = after(FIRST_MOVE)
    held[1][6:] = SECOND_MOVE[1][6:]  # rank 1's slots as its daemon's map names them
    for rank, report in enumerate(reports):
        assert report["error"] is None, report.get("traceback")
        assert report["map"] == held
        own = after(FIRST_MOVE, *([SECOND_MOVE] if rank == 1 else []))
        assert (report["session"]["version"], report["session"]["digest"]) == (
            1 + rank,
            layout_digest(own),
        )
        assert report["fetch"] == {"result": "ok", "weight_source": "daemon"}


def test_a_rank_that_cannot_read_its_daemon_fails_every_rank(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        # The last rank's daemon crashed: its socket file is left, nobody listens.
        crashed = tmp_path / "crashed.sock"
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(crashed))
        dead.close()
        sockets = [d.socket_path for d in started[:-1]] + [str(crashed)]
        reports = ranks.run({**scenario(started, model_dir=model_dir), "sockets": sockets})
    error = the_same_error_on_every_rank(reports)
    last = ranks.world_size - 1
    assert (
        f"rank {last} (daemon {crashed}): unreadable: attach unreachable: could not read the "
        "daemon" in error
    )
    assert "ConnectionRefusedError" in error


def test_a_dirty_daemon_fails_every_rank_naming_engine_layers_and_base_version(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        move(started[0], FIRST_MOVE)
        for daemon in started[1:]:
            move(daemon, FIRST_MOVE)
        # On rank 0's daemon, an engine dies (SIGKILL) with its move of layer 1 pending.
        doomed = EngineStandIn.start(started[0].socket_path, "doomed-engine")
        assert doomed.begin(1, [1]).ok
        doomed.kill()
        wait_until_dirty(started[0])  # the daemon's watcher sees the EOF, on its own thread
        reports = ranks.run(scenario(started, model_dir=model_dir))
    error = the_same_error_on_every_rank(reports)
    assert f"rank 0 (daemon {started[0].socket_path}): dirty: " in error
    assert "engine 'doomed-engine'" in error
    assert "layers [1]" in error
    assert "from version 1" in error
    assert "Restart the weight cache daemons" in error


def test_ranks_wait_for_a_pending_move_and_adopt_the_version_it_commits(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        movers = [EngineStandIn.start(d.socket_path, "moving-engine") for d in started]
        try:
            for mover in movers:
                assert mover.begin(0, sorted(FIRST_MOVE)).ok
            ranks.start(scenario(started, model_dir=model_dir))
            for daemon in started:
                wait_until_attached(daemon, count=2)  # the mover and this engine's rank
            time.sleep(0.6)  # a poll or so of waiting
            for mover in movers:
                assert mover.commit(FIRST_MOVE).ok
            reports = ranks.collect()
        finally:
            for mover in movers:
                mover.exit()
    for report in reports:
        assert report["error"] is None
        assert report["map"] == after(FIRST_MOVE)
        assert report["session"]["version"] == 1
        assert any("'moving-engine' is moving layers [0, 2]" in t for _, t in report["logs"])
        assert any("The pending move on the daemon" in t for _, t in report["logs"])


def test_a_move_still_pending_after_the_wait_timeout_fails_naming_engine_and_layers(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        movers = [EngineStandIn.start(d.socket_path, "stuck-engine") for d in started]
        try:
            for mover in movers:
                assert mover.begin(0, [2]).ok
            reports = ranks.run(
                {
                    **scenario(started, model_dir=model_dir),
                    "env": {"SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT": "1.5"},
                }
            )
        finally:
            for mover in movers:
                mover.kill()
    error = the_same_error_on_every_rank(reports)
    assert "another engine's expert move is still pending" in error
    assert (
        "engine 'stuck-engine' began a move of layers [2] from version 0, and it was still "
        "pending after 1.5 s (SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT)"
    ) in error
    for report in reports:
        assert 1.5 <= report["seconds"] < 30


def _mixed_records(world_size: int) -> list[str]:
    # Rank 0 keeps a record; the next rank's daemon runs without --enable-eplb; with 4 ranks,
    # one more records and one is sglang's own daemon without the plugin.
    return ["ledger", "none"] if world_size == 2 else ["ledger", "none", "ledger", "no-plugin"]


def test_recording_and_non_recording_daemons_at_version_zero_keep_the_initial_layout(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    records = _mixed_records(ranks.world_size)
    with daemons(tmp_path, records) as started:
        reports = ranks.run(scenario(started, model_dir=model_dir))
    expected_finding = {"ledger": "record", "none": "no_record", "no-plugin": "older_daemon"}
    for report, record in zip(reports, records, strict=True):
        assert report["error"] is None
        assert report["map"] == INITIAL
        assert report["session"]["finding"] == expected_finding[record]
        assert report["session"]["attached"] is (record == "ledger")
        assert report["session"]["version"] == 0
    (warning,) = warnings_of(reports[0])  # once, from the first rank
    assert "keep no expert layout record" in warning
    assert all(warnings_of(report) == [] for report in reports[1:])


def test_recording_and_non_recording_daemons_fail_once_a_recording_daemon_moved(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    records = _mixed_records(ranks.world_size)
    with daemons(tmp_path, records) as started:
        for daemon, record in zip(started, records, strict=True):
            if record == "ledger":
                move(daemon, FIRST_MOVE)
        reports = ranks.run(scenario(started, model_dir=model_dir))
    error = the_same_error_on_every_rank(reports)
    assert "keep no expert layout record while others have moved experts" in error
    assert f"rank 0 (daemon {started[0].socket_path}) at version 1" in error
    assert f"rank 1 (daemon {started[1].socket_path}): no_record" in error
