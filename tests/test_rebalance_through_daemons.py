"""Rebalancing daemon-shared experts: two phases per chunk, pauses, refusals, a lying daemon.

One engine of 2 real gloo rank processes (see tests/test_rebalance_engine.py) runs on two real
model-less daemons (``sglang_integration.testing.daemon``: sglang's real ``WeightCacheDaemon``
serve loop and request handling with this plugin, one ledger each, started by
``daemon_control.start_daemon``), over real Unix sockets, and moves shared-memory experts with
sglang's real updater. The parent process drives
the story phase by phase and checks the daemons' records, the engine's metadata and the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_rebalance_engine import (
    ALL_SLOTS,
    build_rebalancing_engine,
    routed_map,
    run_rebalances,
)
from test_updater_shared_experts import (
    EP_SIZE,
    NUM_LAYERS,
    NUM_LOGICAL,
    SHAPE,
    engine_process_context,
    free_port,
    write_tiny_moe_config,
)

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.wire import protocol
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    process_context,
    start_daemon,
)
from sglang_integration.testing.shared_experts import (
    count_matching_slots,
    create_shared_experts,
    read_physical_to_logical_map,
)
from sglang_integration.testing.slow_relay import RelayRule, start_relay

INITIAL = trivial_map(NUM_LAYERS, SHAPE.num_physical_slots, NUM_LOGICAL)
CHUNKS_PER_REBALANCE = 2
LOCAL_SLOTS = NUM_LAYERS * SHAPE.num_local_slots


# ---------------------------------------------------------------- processes -----------------


def start_layout_daemon(directory: Path, name: str) -> DaemonProcess:
    """A model-less daemon with a ledger and this engine's shape, serving when this returns."""
    return start_daemon(
        directory,
        name,
        num_layers=NUM_LAYERS,
        num_logical_experts=NUM_LOGICAL,
        num_physical_experts=SHAPE.num_physical_slots,
    )


def _unattached_engine_fetch(socket_path: str) -> None:
    """An engine that sends the ``expert_layout`` field but never attached fetches the weights.

    The daemon serves it (its digest matches) and, unable to tell when it exits, refuses every
    begin from then on.
    """
    from sglang_integration.engine import client
    from sglang_integration.testing.daemon_control import request

    layout = client.query(socket_path).layout
    if layout is None:
        raise RuntimeError("the daemon keeps no record")
    config = request(socket_path, {"type": "query_config"})["config"]
    field = {"engine_id": None, "version": layout.version, "digest": layout.digest}
    reply = request(socket_path, {"type": "fetch_state", "config": config, "expert_layout": field})
    if reply.get("status") != "ok":
        raise RuntimeError(f"the unattached fetch was not served: {reply!r}")


class _CallOrder:
    """In an engine rank: the order of the steps the synchronize rule is about.

    Wraps, where the rebalance hook looks them up at call time, sglang's
    ``update_expert_location_with_recovery`` ("move", noted when it returns), the device's
    ``synchronize`` (``torch.cpu`` on this CPU engine; "synchronize", noted when it returns) and
    the rank's kept connection's ``commit`` ("commit", noted before it is sent).
    """

    def __init__(self) -> None:
        self.calls: list[str] = []

    def install(self) -> _CallOrder:
        import torch
        from sglang.srt.eplb import eplb_manager

        from sglang_integration.engine import client

        self._note_after(eplb_manager, "update_expert_location_with_recovery", "move")
        self._note_after(torch.cpu, "synchronize", "synchronize")
        commit = client.LayoutConnection.commit

        def noted_commit(*args: Any, **kwargs: Any) -> Any:
            self.calls.append("commit")
            return commit(*args, **kwargs)

        client.LayoutConnection.commit = noted_commit  # type: ignore[method-assign]
        return self

    def _note_after(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def noted(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.calls.append(label)
            return result

        setattr(owner, name, noted)


class _LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _daemon_engine_rank(
    rank: int,
    port: int,
    model_dir: str,
    expert_dir: str,
    sockets: list[str],
    plan: list[tuple[str, int]],
    phase_events: dict[str, Any],
    results: Any,
) -> None:
    """Engine A's rank: start on its daemon, then per phase wait for the parent and rebalance."""
    from sglang_integration.engine.startup import current_session

    records = _LogRecords()
    logging.getLogger("sglang_integration.engine.rebalance").addHandler(records)
    logging.getLogger("sglang_integration.engine.rebalance").setLevel(logging.INFO)
    manager, model = build_rebalancing_engine(
        rank,
        port,
        model_dir,
        expert_dir,
        daemon_socket=sockets[rank],
        weight_cache_mode="client",
    )
    calls = _CallOrder().install()
    engine_id = current_session().engine_id
    for phase, rebalances in plan:
        try:
            calls.calls.clear()
            report = _run_phase(
                rank, phase, rebalances, manager, model, sockets, engine_id, phase_events, records
            )
            report["calls"] = list(calls.calls)
        except Exception:
            results.put({"rank": rank, "phase": phase, "error": traceback.format_exc()})
            raise
        results.put(report)


def _run_phase(
    rank: int,
    phase: str,
    rebalances: int,
    manager: Any,
    model: Any,
    sockets: list[str],
    engine_id: str,
    phase_events: dict[str, Any],
    records: _LogRecords,
) -> dict[str, Any]:
    from sglang_integration.engine import client
    from sglang_integration.engine.rebalance import rebalance_state

    event = phase_events.get(phase)
    if event is not None and not event.wait(120):
        raise RuntimeError(f"the parent never started phase {phase}")
    if phase == "resumed":
        # The daemon sees the standby's EOF on its own thread; wait until it has.
        deadline = time.monotonic() + 30
        while list(client.query(sockets[rank]).layout.attached) != [engine_id]:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not detach the standby within 30 s")
            time.sleep(0.05)
    records.lines.clear()
    run_rebalances(manager, rebalances)
    state = rebalance_state(manager)
    layout = client.query(sockets[rank]).layout
    return {
        "rank": rank,
        "phase": phase,
        "engine_id": engine_id,
        "mode": state.mode.value if state.mode else None,
        "version": state.version,
        "stopped": state.stopped_reason,
        "paused": state.rebalances_paused,
        "routed": routed_map(),
        "matching": model.experts.count_matching_slots(routed_map()),
        "daemon": None
        if layout is None
        else {
            "version": layout.version,
            "digest": layout.digest,
            "map": layout.physical_to_logical_map,
            "pending": layout.pending,
            "attached": list(layout.attached),
            "dirty": layout.dirty,
        },
        "logs": list(records.lines),
    }


@dataclass
class Story:
    reports: dict[tuple[str, int], dict[str, Any]]
    expert_dir: Path

    def __getitem__(self, key: tuple[str, int]) -> dict[str, Any]:
        return self.reports[key]


@contextlib.contextmanager
def engine_on_daemons(
    tmp_path: Path, plan: list[tuple[str, int]], sockets: list[Path]
) -> Iterator[tuple[Any, dict[str, Any], Any, Path, list[Any]]]:
    model_dir = write_tiny_moe_config(tmp_path / "model", NUM_LAYERS, NUM_LOGICAL)
    expert_dir = tmp_path / "experts"
    for rank in range(EP_SIZE):
        create_shared_experts(expert_dir, rank, SHAPE, INITIAL)
    context = engine_process_context()
    results = context.Queue()
    phase_events = {phase: context.Event() for phase, _ in plan[1:]}
    port = free_port()
    ranks = [
        context.Process(
            target=_daemon_engine_rank,
            args=(
                rank,
                port,
                str(model_dir),
                str(expert_dir),
                [str(path) for path in sockets],
                plan,
                phase_events,
                results,
            ),
        )
        for rank in range(EP_SIZE)
    ]
    for process in ranks:
        process.start()
    try:
        yield context, phase_events, results, expert_dir, ranks
    finally:
        for event in phase_events.values():
            event.set()
        for process in ranks:
            process.join(60)
            if process.exitcode is None:
                process.kill()


def take_phase(results: Any, phase: str, into: dict[tuple[str, int], dict[str, Any]]) -> None:
    for _ in range(EP_SIZE):
        report = results.get(timeout=200)
        if "error" in report:
            raise AssertionError(
                f"rank {report['rank']} failed in phase {phase}:\n{report['error']}"
            )
        if report["phase"] != phase:
            raise AssertionError(f"expected phase {phase}, got {report['phase']}")
        into[(phase, report["rank"])] = report


# ---------------------------------------------------------------- story 1 -------------------

STANDBY_ID = "engine-C-standby"
STORY_PLAN = [("alone", 2), ("standby", 1), ("resumed", 1), ("refused", 1), ("after", 1)]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    """Engine A alone rebalances; standby C on rank 1's daemon only; C leaves; an older engine
    fetches from rank 0's daemon (its begins are refused from then on); one more rebalance."""
    tmp_path = tmp_path_factory.mktemp("story")
    engine_process_context()  # start the sglang forkserver before the daemons use it
    daemons = [start_layout_daemon(tmp_path, f"daemon{rank}") for rank in range(EP_SIZE)]
    sockets = [Path(daemon.socket_path) for daemon in daemons]
    reports: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        with engine_on_daemons(tmp_path, STORY_PLAN, sockets) as (
            _,
            events,
            results,
            expert_dir,
            ranks,
        ):
            take_phase(results, "alone", reports)
            reports[("alone", -1)] = {"held": read_physical_to_logical_map(expert_dir)}

            standby = EngineStandIn.start(sockets[1], STANDBY_ID)
            assert standby.attach_reply.ok
            events["standby"].set()
            take_phase(results, "standby", reports)
            reports[("standby", -1)] = {"held": read_physical_to_logical_map(expert_dir)}
            standby.exit()

            events["resumed"].set()
            take_phase(results, "resumed", reports)
            reports[("resumed", -1)] = {"held": read_physical_to_logical_map(expert_dir)}

            fetch = process_context().Process(
                target=_unattached_engine_fetch, args=(str(sockets[0]),)
            )
            fetch.start()
            fetch.join(60)
            assert fetch.exitcode == 0
            events["refused"].set()
            take_phase(results, "refused", reports)
            events["after"].set()
            take_phase(results, "after", reports)
            reports[("after", -1)] = {"held": read_physical_to_logical_map(expert_dir)}
        assert [process.exitcode for process in ranks] == [0, 0]
        yield Story(reports, expert_dir)
    finally:
        for daemon in daemons:
            daemon.stop()


def _assert_daemons_hold_the_engines_layout(story: Story, phase: str, version: int) -> None:
    routed = story[(phase, 0)]["routed"]
    for rank in range(EP_SIZE):
        report = story[(phase, rank)]
        assert report["routed"] == routed
        assert report["version"] == version
        assert report["matching"] == LOCAL_SLOTS
        daemon = report["daemon"]
        assert daemon["version"] == version
        assert daemon["map"] == routed
        assert daemon["digest"] == layout_digest(routed)
        assert daemon["pending"] is None
        assert not daemon["dirty"]
    assert count_matching_slots(story[(phase, -1)]["held"], routed) == ALL_SLOTS


@pytest.mark.timeout(300)
def test_every_chunk_is_committed_on_every_daemon_at_the_next_version(story: Story) -> None:
    _assert_daemons_hold_the_engines_layout(story, "alone", version=2 * CHUNKS_PER_REBALANCE)
    assert story[("alone", 0)]["mode"] == "two_phase"
    assert count_matching_slots(story[("alone", -1)]["held"], INITIAL) < ALL_SLOTS // 2


@pytest.mark.timeout(300)
def test_every_rank_synchronizes_the_device_after_the_experts_move_and_before_it_commits(
    story: Story,
) -> None:
    for rank in range(EP_SIZE):
        calls = story[("alone", rank)]["calls"]
        commits = [index for index, call in enumerate(calls) if call == "commit"]
        assert len(commits) == 2 * CHUNKS_PER_REBALANCE, calls
        for index in commits:
            since_move = calls[:index][::-1]
            assert "move" in since_move, calls
            assert "synchronize" in since_move[: since_move.index("move")], calls


@pytest.mark.timeout(300)
def test_a_standby_on_one_ranks_daemon_pauses_the_move_on_every_rank(story: Story) -> None:
    before = story[("alone", 0)]["routed"]
    for rank in range(EP_SIZE):
        report = story[("standby", rank)]
        assert report["routed"] == before
        assert report["stopped"] is None
        assert report["paused"] == 1
        # Rank 0's begin succeeded; it aborted, so its daemon has nothing pending.
        assert report["daemon"]["pending"] is None
        assert report["daemon"]["version"] == 2 * CHUNKS_PER_REBALANCE
    standby_daemon = story[("standby", 1)]["daemon"]
    assert sorted(standby_daemon["attached"]) == sorted(
        [story[("standby", 1)]["engine_id"], STANDBY_ID]
    )
    assert story[("standby", -1)]["held"] == story[("alone", -1)]["held"]
    assert any("paused" in line for _, line in story[("standby", 0)]["logs"])


@pytest.mark.timeout(300)
def test_after_the_standby_leaves_the_engine_rebalances_again(story: Story) -> None:
    _assert_daemons_hold_the_engines_layout(story, "resumed", version=3 * CHUNKS_PER_REBALANCE)
    assert story[("resumed", 0)]["routed"] != story[("alone", 0)]["routed"]


@pytest.mark.timeout(300)
def test_a_refused_begin_turns_rebalancing_off_for_good_with_one_warning(story: Story) -> None:
    resumed = story[("resumed", 0)]["routed"]
    for phase in ("refused", "after"):
        for rank in range(EP_SIZE):
            report = story[(phase, rank)]
            assert report["routed"] == resumed
            assert report["daemon"]["version"] == 3 * CHUNKS_PER_REBALANCE
            # Rank 1's begin succeeded and was aborted.
            assert report["daemon"]["pending"] is None
            assert report["stopped"].startswith("rank 0: refused: ")
    warnings = [line for level, line in story[("refused", 0)]["logs"] if level == "WARNING"]
    assert len(warnings) == 1 and "off for good" in warnings[0]
    assert [level for level, _ in story[("refused", 1)]["logs"] if level == "WARNING"] == []
    assert story[("after", 0)]["logs"] == []
    assert story[("after", -1)]["held"] == story[("resumed", -1)]["held"]


# ---------------------------------------------------------------- story 2 -------------------


@pytest.mark.timeout(300)
def test_a_daemon_reporting_a_wrong_digest_stops_rebalancing_with_a_restart_error(
    tmp_path: Path,
) -> None:
    engine_process_context()  # start the sglang forkserver before the daemons use it
    daemons = [start_layout_daemon(tmp_path, f"daemon{rank}") for rank in range(EP_SIZE)]
    lying_socket = tmp_path / "lying1.sock"
    # A daemon that records commits correctly but reports a wrong digest for them.
    lying = RelayRule(forged=frozenset({protocol.COMMIT}))
    proxy = start_relay(lying_socket, daemons[1].socket_path, lying)
    reports: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        plan = [("lie", 1), ("after", 1)]
        with engine_on_daemons(tmp_path, plan, [Path(daemons[0].socket_path), lying_socket]) as (
            _,
            events,
            results,
            expert_dir,
            ranks,
        ):
            take_phase(results, "lie", reports)
            events["after"].set()
            take_phase(results, "after", reports)
            held = read_physical_to_logical_map(expert_dir)
        assert [process.exitcode for process in ranks] == [0, 0]
    finally:
        proxy.kill()
        for daemon in daemons:
            daemon.stop()

    first_chunk = list(range(NUM_LAYERS // CHUNKS_PER_REBALANCE))
    for rank in range(EP_SIZE):
        report = reports[("lie", rank)]
        # The first chunk moved and both daemons recorded it; the second chunk never began.
        assert report["daemon"]["version"] == 1
        assert report["daemon"]["pending"] is None
        assert report["daemon"]["map"] == report["routed"]
        assert report["routed"][NUM_LAYERS - 1] == INITIAL[NUM_LAYERS - 1]
        assert report["routed"][: len(first_chunk)] != INITIAL[: len(first_chunk)]
        assert report["stopped"] == (
            f"rank 1: daemon digest {'0' * 64!r} differs from the engine's "
            f"{layout_digest(report['routed'])}"
        )
        errors = [line for level, line in report["logs"] if level == "ERROR"]
        assert len(errors) == 1
        assert "Restart the weight cache daemons before another engine uses them" in errors[0]
        after = reports[("after", rank)]
        assert after["logs"] == []
        assert after["daemon"]["version"] == 1
        assert after["routed"] == report["routed"]
    assert count_matching_slots(held, reports[("after", 0)]["routed"]) == ALL_SLOTS
