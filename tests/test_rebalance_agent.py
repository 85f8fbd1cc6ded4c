"""The rebalance agent: a chunked rebalance's daemon round trips off the forward path.

One engine of 2 real gloo rank processes (tests/test_rebalance_engine.py) on two real model-less
daemons, rank 1's behind a relay that holds every begin, commit and abort reply back ``DELAY``
seconds (``testing.slow_relay``: a slow daemon). Each rank drives its rebalances one forward
pass at a time (a 1 ms sleep per pass, ``FORWARD_PASS_SECONDS``), timing each pass of the hook,
and notes, with the system-wide monotonic clock, when each begin reply arrived, when each move
started and ended and when each commit was sent. Then rank 0's agent is killed, and last the
engine's session is closed.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import pytest
from test_rebalance_engine import build_rebalancing_engine
from test_rebalance_through_daemons import INITIAL, start_layout_daemon
from test_updater_shared_experts import (
    EP_SIZE,
    NUM_LAYERS,
    NUM_LOGICAL,
    SHAPE,
    engine_process_context,
    free_port,
    write_tiny_moe_config,
)

from sglang_integration.testing.cpu_engine import FORWARD_PASS_SECONDS
from sglang_integration.testing.shared_experts import create_shared_experts
from sglang_integration.testing.slow_relay import start_slow_relay

DELAY = 0.4  # seconds each reply of rank 1's daemon is held back
CHUNKS = 2


class AgentKilled(BaseException):
    """Raised inside rank 0's agent (a bug there): not an ``Exception``, so nothing catches it."""


class _Notes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _drive(manager: Any, moves: list[Any]) -> dict[str, Any]:
    """One rebalance, one forward pass at a time: each pass's hook time, and whether it moved."""
    from sglang_integration.engine.rebalance import rebalance_state

    times: list[float] = []
    steps = manager.rebalance()
    while True:
        moved_before = len(moves)
        started = time.monotonic()
        try:
            next(steps)
        except StopIteration:
            times.append(time.monotonic() - started)
            break
        if len(moves) == moved_before:  # sglang's move is sglang's time, not the plugin's
            times.append(time.monotonic() - started)
        time.sleep(FORWARD_PASS_SECONDS)
    state = rebalance_state(manager)
    return {
        "max_pass": max(times),
        "passes": len(times),
        "stopped": state.stopped_reason,
        "version": state.version,
        "last_passes": state.last_passes,
    }


def _agent_rank(
    rank: int, port: int, model_dir: str, expert_dir: str, sockets: list[str], results: Any
) -> None:
    report: dict[str, Any] = {"rank": rank}
    try:
        _agent_story(report, port, model_dir, expert_dir, sockets)
    except BaseException:
        report["error"] = traceback.format_exc()
        raise
    finally:
        results.put(report)
        results.close()
        results.join_thread()  # the report is out before anything at this process's exit


def _agent_story(
    report: dict[str, Any], port: int, model_dir: str, expert_dir: str, sockets: list[str]
) -> None:
    """Fills ``report`` phase by phase (a failed phase leaves the ones before it)."""
    import threading

    from sglang.srt.eplb import eplb_manager

    from sglang_integration.engine import client, rebalance_agent
    from sglang_integration.engine.startup import close_session

    rank = report["rank"]
    notes = _Notes()
    logging.getLogger("sglang_integration.engine.rebalance").addHandler(notes)
    manager, _ = build_rebalancing_engine(
        rank, port, model_dir, expert_dir, daemon_socket=sockets[rank], weight_cache_mode="client"
    )
    begins: list[float] = []
    commits: list[float] = []
    moves: list[tuple[int, float, float]] = []  # (pass, started, ended)
    begin, commit = client.LayoutConnection.begin, client.LayoutConnection.commit
    move = eplb_manager.update_expert_location_with_recovery
    kill_commits = threading.Event()

    def noted_begin(connection: Any, *args: Any) -> Any:
        reply = begin(connection, *args)
        begins.append(time.monotonic())
        return reply

    def noted_commit(connection: Any, *args: Any) -> Any:
        if kill_commits.is_set():
            raise AgentKilled("killed in its commit")
        commits.append(time.monotonic())
        return commit(connection, *args)

    def noted_move(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        result = move(*args, **kwargs)
        agent = rebalance_agent.current_agent()
        moves.append((-1 if agent is None else agent.step, started, time.monotonic()))
        return result

    client.LayoutConnection.begin = noted_begin  # type: ignore[method-assign,assignment]
    client.LayoutConnection.commit = noted_commit  # type: ignore[method-assign,assignment]
    eplb_manager.update_expert_location_with_recovery = noted_move

    slow = _drive(manager, moves)
    agent = rebalance_agent.current_agent()
    assert agent is not None
    report["slow"] = {
        **slow,
        "begins": list(begins),
        "commits": list(commits),
        "moves": list(moves),
        "blocked": agent.blocked,
    }

    notes.lines.clear()
    if rank == 0:
        kill_commits.set()
    dead = _drive(manager, moves)
    report["dead"] = {
        **dead,
        "agent_alive": agent.alive,
        "errors": [line for level, line in notes.lines if level == "ERROR"],
    }
    report["after"] = _drive(manager, moves)

    connection = agent.moves.connection  # type: ignore[attr-defined]
    close_session()
    report["closed"] = {
        "agent_threads": [
            thread.name
            for thread in threading.enumerate()
            if thread.name == rebalance_agent.THREAD_NAME
        ],
        "group": rebalance_agent.current_group() is not None,
        "agent": rebalance_agent.current_agent() is not None,
        "connection_open": connection.is_open,
    }


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("agent")
    context = engine_process_context()
    daemons = [start_layout_daemon(tmp_path, f"daemon{rank}") for rank in range(EP_SIZE)]
    slow_socket = tmp_path / "slow1.sock"
    relay = start_slow_relay(slow_socket, daemons[1].socket_path, DELAY)
    try:
        model_dir = write_tiny_moe_config(tmp_path / "model", NUM_LAYERS, NUM_LOGICAL)
        expert_dir = tmp_path / "experts"
        for rank in range(EP_SIZE):
            create_shared_experts(expert_dir, rank, SHAPE, INITIAL)
        results = context.Queue()
        port = free_port()
        sockets = [daemons[0].socket_path, str(slow_socket)]
        ranks = [
            context.Process(
                target=_agent_rank,
                args=(rank, port, str(model_dir), str(expert_dir), sockets, results),
            )
            for rank in range(EP_SIZE)
        ]
        for process in ranks:
            process.start()
        reports = [results.get(timeout=200) for _ in ranks]
        for process in ranks:
            process.join(60)
            if process.exitcode is None:
                process.kill()
        return {report["rank"]: report for report in reports}
    finally:
        relay.kill()
        for daemon in daemons:
            daemon.stop()


def phase(story: dict[int, dict[str, Any]], rank: int, name: str) -> dict[str, Any]:
    """Rank ``rank``'s report of phase ``name``; fails with its error if it never got there."""
    report = story[rank]
    if name not in report:
        raise AssertionError(f"rank {rank} did not reach phase {name}:\n{report.get('error')}")
    found: dict[str, Any] = report[name]
    return found


@pytest.mark.timeout(300)
def test_every_rank_moves_each_chunk_at_the_same_pass_after_every_ranks_begin_was_granted(
    story: dict[int, dict[str, Any]],
) -> None:
    slow = [phase(story, rank, "slow") for rank in range(EP_SIZE)]
    assert [each["stopped"] for each in slow] == [None] * EP_SIZE
    assert [each["version"] for each in slow] == [CHUNKS] * EP_SIZE
    steps = [[step for step, _, _ in each["moves"]] for each in slow]
    assert len(steps[0]) == CHUNKS and steps[1] == steps[0], steps
    for chunk in range(CHUNKS):
        last_grant = max(each["begins"][chunk] for each in slow)
        for each in slow:
            assert each["moves"][chunk][1] > last_grant  # the move started after it


@pytest.mark.timeout(300)
def test_no_rank_commits_a_chunk_before_its_move_ended(story: dict[int, dict[str, Any]]) -> None:
    for rank in range(EP_SIZE):
        slow = phase(story, rank, "slow")
        assert len(slow["commits"]) == CHUNKS
        for (_, _, moved), committed in zip(slow["moves"], slow["commits"], strict=True):
            assert committed > moved


@pytest.mark.timeout(300)
def test_a_slow_daemon_delays_the_move_by_forward_passes_and_never_holds_a_forward_pass(
    story: dict[int, dict[str, Any]],
) -> None:
    for rank in range(EP_SIZE):
        slow = phase(story, rank, "slow")
        # Each chunk waits for two slowed replies (begin; commit then the next begin).
        assert slow["passes"] > 2 * DELAY / (FORWARD_PASS_SECONDS * 10)
        assert slow["max_pass"] < DELAY / 2, slow


@pytest.mark.timeout(300)
def test_a_dead_agent_turns_rebalancing_off_loudly_on_every_rank_without_holding_a_pass(
    story: dict[int, dict[str, Any]],
) -> None:
    for rank in range(EP_SIZE):
        dead = phase(story, rank, "dead")
        assert dead["stopped"].startswith("the rebalance agent stopped: "), dead
        assert not dead["agent_alive"]
        assert len(dead["errors"]) == 1 and "off for good" in dead["errors"][0]
        assert "Restart the weight cache daemons" in dead["errors"][0]
        assert dead["max_pass"] < 1.0, dead
        assert dead["version"] == CHUNKS
        assert (
            phase(story, rank, "after")["passes"] == 1
        )  # rebalancing is off: the hook returns at once
    assert "AgentKilled: killed in its commit" in story[0]["dead"]["stopped"]


@pytest.mark.timeout(300)
def test_the_agent_its_connection_and_its_group_end_with_the_engines_session(
    story: dict[int, dict[str, Any]],
) -> None:
    for rank in range(EP_SIZE):
        closed = phase(story, rank, "closed")
        assert closed == {
            "agent_threads": [],
            "group": False,
            "agent": False,
            "connection_open": False,
        }
