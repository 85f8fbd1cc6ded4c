"""No read of the checkpoint can stop a daemon (issue 40, 1): a shard that blocks, is a FIFO or
may not be read makes the heal fail naming the file and its cause, and the daemon answers
throughout and stops on SIGTERM.

One group of two model-backed daemons (sglang's own ``WeightCacheDaemon`` loading a tiny
Qwen3-MoE with sglang's loader; heal ``auto``, ``--expert-layout-heal-timeout 8``) serves every
case in turn. Each case puts the odd layers' shard somewhere a read goes wrong, then has an
engine begin a move of layer 1 on both daemons and die (its attach connection closes): both
daemons are dirty and heal by themselves, reading that shard. Meanwhile every rank is asked
``ping``, ``query_config``, ``expert_layout_query`` and ``fetch_state`` four times a second; each
must answer within 1 s. The stalled mounts are real FUSE mounts over the shard
(``testing.stalled_mount``: a server that never answers a read, as a hard-mounted NFS server
that stopped; or one that refuses the open with ``EACCES``). The last case SIGTERMs the daemons
while their heals wait on the stalled mount: they end within 30 s, their incarnations ended
``dirty`` after a ``heal_failed``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.checkpoint_experts import CheckpointExperts, count_matching
from sglang_integration.testing.daemon_control import EngineStandIn, request
from sglang_integration.testing.daemon_prober import DaemonProber
from sglang_integration.testing.daemons import ModelDaemonGroup, start_model_daemons
from sglang_integration.testing.routed_weights import attach_routed_weights
from sglang_integration.testing.stalled_mount import fuse_available, stalled_file

pytestmark = pytest.mark.timeout(600)

NUM_EXPERTS, NUM_REDUNDANT, RANKS = 8, 4, 2
LOCAL = (NUM_EXPERTS + NUM_REDUNDANT) // RANKS
HEAL_TIMEOUT = 8.0  # the group's --expert-layout-heal-timeout
ANSWER_WITHIN = 1.0  # every request during a heal, in seconds
SHARD = "model-00002-of-00002.safetensors"  # the odd layers' tensors: layer 1's among them
NO_FUSE = fuse_available()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reads")
    return write_checkpoint(root / "checkpoint", CheckpointSpec("qwen3_moe", "bf16", seed=7))


@pytest.fixture(scope="module")
def group(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelDaemonGroup]:
    run = tmp_path_factory.mktemp("reads-run")
    started = start_model_daemons(
        run,
        checkpoint,
        ep_size=RANKS,
        num_redundant_experts=NUM_REDUNDANT,
        model="qwen3_moe",
        daemon_args=["--expert-layout-heal-timeout", str(HEAL_TIMEOUT)],
    )
    try:
        yield started
    finally:
        started.stop()


def prober(group: ModelDaemonGroup) -> DaemonProber:
    """Asks every rank ping, query_config, expert_layout_query and fetch_state four times a
    second on a thread; keeps the slowest answer and every failure."""
    configs = [
        request(group.socket(rank), {"type": "query_config"})["config"] for rank in range(RANKS)
    ]

    def message(kind: str, rank: int) -> dict[str, Any]:
        if kind != "fetch_state":
            return {"type": kind}
        layout = {"engine_id": None, "version": 0, "digest": "0" * 64}
        return {"type": kind, "config": configs[rank], "expert_layout": layout}

    return DaemonProber(
        group.sockets,
        ("ping", "query_config", "expert_layout_query", "fetch_state"),
        interval=0.25,
        answer_within=ANSWER_WITHIN,
        message=message,
    )


def _events(group: ModelDaemonGroup, rank: int) -> list[tuple[str, str]]:
    """(kind, reason) of the latest incarnation's events, in order."""
    with contextlib.closing(sqlite3.connect(f"file:{group.ledger(rank)}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT kind, coalesce(reason, '') FROM events WHERE incarnation_id = "
            "(SELECT max(incarnation_id) FROM incarnations) ORDER BY event_id"
        ).fetchall()
    return [(str(kind), str(reason)) for kind, reason in rows]


def _layout(group: ModelDaemonGroup, rank: int) -> dict[str, Any]:
    layout: dict[str, Any] = request(group.socket(rank), {"type": "expert_layout_query"})["layout"]
    return layout


def _leave_mid_move(group: ModelDaemonGroup) -> float:
    """An engine begins a move of layer 1 on both daemons and is SIGKILLed: both are dirty and
    start healing. Returns the time of the kill."""
    version = _layout(group, 0)["version"]
    engines = [EngineStandIn.start(group.socket(rank), "engine-m") for rank in range(RANKS)]
    for engine in engines:
        assert engine.begin(version, [1]).ok
    killed = time.monotonic()
    for engine in engines:
        engine.kill()
    return killed


def _wait_heal_end(group: ModelDaemonGroup, rank: int, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kind, reason = _events(group, rank)[-1]
        if kind in ("heal", "heal_failed"):
            return kind, reason
        time.sleep(0.05)
    raise AssertionError(
        f"rank {rank}: no heal or heal_failed in {timeout} s: {_events(group, rank)[-3:]}"
    )


def _heal_by_hand(group: ModelDaemonGroup, checkpoint: Path) -> None:
    """The shard is back: `expert_layout_heal` makes each daemon clean, every slot right."""
    for rank in range(RANKS):
        reply = request(group.socket(rank), {"type": "expert_layout_heal"}, timeout=60)
        assert reply["status"] == "ok", reply
        routed = attach_routed_weights(group.socket(rank))
        held = CheckpointExperts(checkpoint).judge_routed(
            routed.routed_experts_weights_of_layer, routed.names, NUM_EXPERTS
        )
        assert count_matching(
            held, _layout(group, rank)["physical_to_logical_map"], rank * LOCAL
        ) == (len(routed.routed_experts_weights_of_layer) * LOCAL)


@contextlib.contextmanager
def _shard_as_fifo(shard: Path) -> Iterator[None]:
    original = shard.read_bytes()
    shard.unlink()
    os.mkfifo(shard)
    try:
        yield
    finally:
        shard.unlink()
        shard.write_bytes(original)


def test_a_fifo_in_place_of_a_shard_fails_the_heal_at_once_naming_it_and_every_request_answers(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    shard = checkpoint / SHARD
    with _shard_as_fifo(shard), prober(group) as probing:
        killed = _leave_mid_move(group)
        ends = [_wait_heal_end(group, rank, HEAL_TIMEOUT + 10) for rank in range(RANKS)]
        took = time.monotonic() - killed
        time.sleep(1.0)  # and after it
    for kind, reason in ends:
        assert kind == "heal_failed"
        assert (
            f"the checkpoint file {shard} cannot be read (it is a FIFO, not a regular file: "
            f"refused without reading it, a read could block)"
        ) in reason
    assert took < HEAL_TIMEOUT
    assert probing.failures == [] and probing.asked >= 16
    assert probing.slowest < ANSWER_WITHIN
    _heal_by_hand(group, checkpoint)


@pytest.mark.skipif(NO_FUSE is not None, reason=f"no FUSE mount here: {NO_FUSE}")
def test_a_shard_on_a_mount_that_stopped_answering_fails_the_heal_at_its_deadline_naming_it(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    shard = checkpoint / SHARD
    with stalled_file(shard, "blocked"), prober(group) as probing:
        killed = _leave_mid_move(group)
        ends = [_wait_heal_end(group, rank, HEAL_TIMEOUT + 30) for rank in range(RANKS)]
        took = time.monotonic() - killed
        assert all(_layout(group, rank)["dirty"] for rank in range(RANKS))
    for kind, reason in ends:
        assert kind == "heal_failed"
        assert (
            f"the checkpoint file {shard} cannot be read (no answer within the deadline of "
            f"{HEAL_TIMEOUT:g} s (--expert-layout-heal-timeout), the reader was killed"
        ) in reason.replace("\n", " ")
    assert HEAL_TIMEOUT <= took < HEAL_TIMEOUT + 3.0
    assert probing.failures == [] and probing.asked >= 8 * HEAL_TIMEOUT
    assert probing.slowest < ANSWER_WITHIN
    _heal_by_hand(group, checkpoint)


@pytest.mark.skipif(NO_FUSE is not None, reason=f"no FUSE mount here: {NO_FUSE}")
def test_a_shard_the_daemon_may_not_read_is_named_permission_denied_not_missing(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    shard = checkpoint / SHARD
    with stalled_file(shard, "denied"):
        _leave_mid_move(group)
        ends = [_wait_heal_end(group, rank, HEAL_TIMEOUT + 10) for rank in range(RANKS)]
    for kind, reason in ends:
        assert kind == "heal_failed"
        assert f"the checkpoint file {shard} cannot be read (Permission denied (EACCES))" in reason
        assert "No such file" not in reason
    _heal_by_hand(group, checkpoint)


@pytest.mark.skipif(NO_FUSE is not None, reason=f"no FUSE mount here: {NO_FUSE}")
def test_sigterm_ends_a_daemon_whose_heal_waits_on_a_stalled_mount_within_30_s(
    group: ModelDaemonGroup, checkpoint: Path
) -> None:
    """Last: it stops the group."""
    shard = checkpoint / SHARD
    with stalled_file(shard, "blocked"):
        _leave_mid_move(group)
        time.sleep(1.5)  # both heals are waiting on the mount (the deadline is 8 s)
        assert all(_events(group, rank)[-1][0] == "dirty" for rank in range(RANKS))
        started = time.monotonic()
        for rank in range(RANKS):
            group.terminate(rank)
        for rank in range(RANKS):
            group.processes[rank].join(30)
        took = time.monotonic() - started
    assert [process.exitcode for process in group.processes] == [0, 0]
    assert took < 30
    for rank in range(RANKS):
        (heal_kind, heal_reason), (end_kind, end_reason) = _events(group, rank)[-2:]
        assert heal_kind == "heal_failed"
        assert "the daemon is stopping, its read was stopped" in heal_reason
        assert (end_kind, end_reason) == ("end", "dirty: daemon shut down")
