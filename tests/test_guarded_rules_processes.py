"""Rules that live in real processes, guarded where they live: real model-less daemons on real
Unix sockets, sglang's real daemon load hook, engines of 2 gloo ranks (the toolkit in
``sglang_integration.testing``). Each test names its rule; a plausible bug breaking it passed
the suite before these tests.

- After a commit, each daemon's digest must equal the digest of the engine's own whole map,
  even when every daemon reports the same other digest (two lying relays, one per daemon).
- A repair is all daemons or none: every rank fails unless every daemon recorded the repair
  with the engine's digest, also the rank whose own daemon's reply was right.
- At load, a daemon of EP rank 1 checks its replicas in its own slots of the map (the load hook
  with sglang's real EPLB initialisation, a non-trivial layout).
- A commit whose moved-in slot is zero-filled (a new expert that never received its bytes) marks
  the daemon dirty.
- A fetch without the ``expert_layout`` field once an expert moved is refused with the advice to
  upgrade the engine or restart the daemon, also when no engine is attached.
- ``SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT=0`` means do not wait: the start fails at once naming the
  mover, not after the 300 s default.
- The content check marks a daemon dirty for content that moved in a layer no pending move is
  changing, while a move is pending.
- A repair is proven by the daemon's own fingerprints: a print carried in
  ``expected_fingerprints`` counts only for an expert the daemon never held; for one it recorded,
  another print is refused (a forged repair naming the wrong content) and nothing changes.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ledger_support import refusals_added, table_dump

from demo_cases import DemoConfig, Workspace
from demo_cases.workspace import query_daemons, started_workspace, wait_for_daemons
from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.core.startup_verdict import FindingKind
from layout_ledger.core.state import PendingMove
from layout_ledger.wire import protocol
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.protocol import Outcome
from sglang_integration import settings
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
    start_daemon,
)
from sglang_integration.testing.shared_experts import (
    ExpertTensorShape,
    SharedExperts,
    create_shared_experts,
    expert_values,
)
from sglang_integration.testing.slow_relay import RelayRule, start_relay

pytestmark = pytest.mark.timeout(600)

CONFIG = DemoConfig()
FORGED = "0" * 64


# --- a relay that rewrites what a daemon answers ------------------------------------------------


class Relays:
    """Relays that rewrite the ``digest`` of ``ok`` replies to one request type (the daemon
    records what it is sent and reports another digest), killed on ``close``."""

    def __init__(self) -> None:
        self.processes: list[Any] = []

    def start(self, listen: Path, upstream: str, kind: str) -> SimpleNamespace:
        rule = RelayRule(forged=frozenset({kind}), forged_digest=FORGED)
        self.processes.append(start_relay(listen, upstream, rule))
        return SimpleNamespace(socket_path=str(listen))

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.join(30)


@pytest.fixture(scope="module")
def workspace() -> Iterator[Workspace]:
    with started_workspace(CONFIG) as space:
        yield space


@pytest.fixture
def relays() -> Iterator[Relays]:
    started = Relays()
    try:
        yield started
    finally:
        started.close()


# --- the commit check trusts the engine's own map, not the daemons agreeing ----------------------


def test_daemons_all_reporting_the_same_digest_other_than_the_engines_stop_rebalancing(
    workspace: Workspace, relays: Relays
) -> None:
    experts = workspace.experts("lying-commits")
    daemons = workspace.daemons("lying-commits")
    directory = workspace.case_dir("lying-commits")
    lying = [
        relays.start(directory / f"lying{rank}.sock", daemon.socket_path, protocol.COMMIT)
        for rank, daemon in enumerate(daemons)
    ]
    engine = workspace.launch("lying-commits", "A", lying, experts)
    try:
        assert not engine.failed, engine.failed
        reports = engine.rebalance(1)
    finally:
        engine.exit()
    for report in reports:
        engine_digest = layout_digest(report["map"])
        assert report["state"]["stopped_reason"] == "; ".join(
            f"rank {rank}: daemon digest {FORGED!r} differs from the engine's {engine_digest}"
            for rank in range(CONFIG.ep_size)
        )
        assert report["state"]["chunks_committed"] == 0
        errors = [line for level, line in report["logs"] if level == "ERROR"]
        assert len(errors) == 1 and "Restart the weight cache daemons" in errors[0], errors
    # The first chunk was recorded by both daemons (they were sent the engine's rows); the
    # second never began.
    layouts = [reply.layout for reply in query_daemons(daemons)]
    assert [layout.version for layout in layouts] == [1, 1]
    assert all(layout.pending is None for layout in layouts)


# --- a repair is every daemon's or no one's ---------------------------------------------------


def test_every_rank_fails_a_repair_that_one_daemon_reports_with_another_digest(
    workspace: Workspace, relays: Relays
) -> None:
    experts = workspace.experts("lying-repair")
    daemons = workspace.daemons("lying-repair", experts=experts)
    engine_a = workspace.launch("lying-repair", "A", daemons, experts)
    engine_a.stop_in_move(1)
    engine_a.kill()
    wait_for_daemons(daemons, lambda layout: layout.dirty, "dirty")
    base = CONFIG.chunks_per_rebalance
    lying = relays.start(
        workspace.case_dir("lying-repair") / "lying1.sock", daemons[1].socket_path, protocol.REPAIR
    )
    engine_b = workspace.launch("lying-repair", "B", [daemons[0], lying], experts)
    assert [report["rank"] for report in engine_b.failed] == [0, 1], engine_b.started
    reasons = [report["error"] for report in engine_b.failed]
    assert reasons[0] == reasons[1]
    assert reasons[0].startswith("repairing the weight cache daemons' expert layout failed: ")
    assert f"rank 1: daemon digest {FORGED!r} differs from the engine's " in reasons[0]
    assert "rank 0:" not in reasons[0]  # rank 0's own daemon answered as the engine asked
    # Both daemons recorded the repair they were sent; the engine did not start on them.
    assert [reply.layout.version for reply in query_daemons(daemons)] == [base + 1] * 2


# --- the load check of EP rank 1 reads its own slots of the map --------------------------------

LOAD_LAYERS, LOAD_LOGICAL, LOAD_REDUNDANT = 3, 8, 2
# Rank 1 of 2 holds slots 5-9: experts 5, 6, 7, 5, 6 (replicas in slots 5/8 and 6/9), while the
# map's first five slots hold five different experts.
LOAD_MAP = [[0, 1, 2, 3, 4, 5, 6, 7, 5, 6] for _ in range(LOAD_LAYERS)]


def _rank_one_load_check(directory: str) -> None:
    """sglang's daemon load steps a CPU can run, published as world rank 1 (EP rank 1 of 2),
    then the plugin's load hook; EP rank 1's slot 8 of layer 1 (expert 5's replica) unfilled."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from test_daemon_sglang_hooks import _use_sglangs_cpu_platform

    from layout_ledger.core.layout import Geometry
    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.testing.cpu_engine import write_tiny_moe_config
    from sglang_integration.testing.daemon import build_model_less_daemon, model_less_cache_config
    from sglang_integration.testing.daemon_control import redirect_output

    root = Path(directory)
    redirect_output(str(root / "child.log"))
    _use_sglangs_cpu_platform()
    os.environ["SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"] = (
        f"{directory}/ledger-{{device_uuid}}.sqlite"
    )
    model_dir = write_tiny_moe_config(root / "model", LOAD_LAYERS, LOAD_LOGICAL)
    server_args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        tp_size=2,
        ep_size=2,
        skip_tokenizer_init=True,
        enable_eplb=True,
        ep_num_redundant_experts=LOAD_REDUNDANT,
        init_expert_location=json.dumps({"physical_to_logical_map": LOAD_MAP}),
    )
    local = (LOAD_LOGICAL + LOAD_REDUNDANT) // 2
    routed = {
        layer: [torch.tensor([[float(e), 1.0 + layer] for e in LOAD_MAP[layer][local:]])]
        for layer in range(LOAD_LAYERS)
    }
    routed[1][0][3] = 0.0  # slot 8 = local slot 3 of rank 1: never filled

    def load(daemon: Any) -> None:
        publish(server_args, role="weight_cache_daemon", ranks=SpawnRanks(world_rank=1, gpu_id=0))
        initialize_moe_config()
        model_config = ModelConfig(model_path=server_args.model_path, dtype="auto")
        daemon._initialize_eplb_expert_location_metadata(model_config)
        daemon.model = SimpleNamespace(routed_experts_weights_of_layer=routed)

    daemon = build_model_less_daemon(
        str(root / "d.sock"), model_less_cache_config(Geometry(1, 1, 1))
    )
    daemon.server_args = server_args
    daemon_hooks.around_load(load, daemon)
    service = daemon_hooks.daemon_layout(daemon).service
    checked = service.handle({"type": msg.CONTENT_CHECK})["content"]
    layout = service.handle({"type": msg.QUERY})["layout"]
    daemon_hooks.close_daemon_layout(daemon)
    (root / "result.json").write_text(
        json.dumps(
            {
                "first_slot": checked["first_slot"],
                "slots": {str(layer): len(v) for layer, v in checked["recorded"].items()},
                "map": layout["physical_to_logical_map"],
                "dirty": layout["dirty"],
                "dirty_reason": layout["dirty_reason"],
            }
        )
    )


def test_the_load_hook_of_ep_rank_1_checks_its_replicas_in_its_own_slots_of_the_map(
    tmp_path: Path,
) -> None:
    from test_daemon_sglang_hooks import run_isolated

    result = run_isolated(_rank_one_load_check, tmp_path)
    assert result["map"] == LOAD_MAP
    assert result["first_slot"] == 5
    assert result["slots"] == {"0": 5, "1": 5, "2": 5}
    assert result["dirty"], result["log"]
    reason = result["dirty_reason"]
    assert "layer 1: expert 5 in slots that differ (slot 5 " in reason, reason
    assert "slot 8 zero-filled" in reason
    assert "layer 0" not in reason and "layer 2" not in reason


# --- model-less daemons with expert files -------------------------------------------------------

LAYERS, LOGICAL, PHYSICAL = 4, 8, 12
INITIAL = trivial_map(LAYERS, PHYSICAL, LOGICAL)


def _daemon_of_rank_zero_of_two(directory: Path) -> tuple[DaemonProcess, SharedExperts]:
    """EP rank 0 of 2: slots 0-5, holding experts 0-5 (it never held 6 or 7)."""
    shape = ExpertTensorShape(LAYERS, LOGICAL, PHYSICAL, ep_size=2)
    experts = create_shared_experts(directory / "experts", 0, shape, INITIAL)
    handle = start_daemon(
        directory,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        extra=["--experts", str(directory / "experts"), "--expert-rank", "0"],
    )
    return handle, experts


def _layout(handle: DaemonProcess) -> msg.LayoutView:
    reply = client.query(handle.socket_path)
    assert reply.layout is not None, reply
    return reply.layout


def test_a_daemon_marks_itself_dirty_after_a_commit_whose_new_expert_slot_is_zero_filled(
    tmp_path: Path,
) -> None:
    handle, experts = _daemon_of_rank_zero_of_two(tmp_path)
    try:
        stand_in = EngineStandIn.start(handle.socket_path, "engine-a")
        assert stand_in.begin(0, [2]).ok
        row = list(INITIAL[2])
        row[3] = 7  # expert 7 into slot 3; its bytes never arrive
        for tensor in experts.tensors:
            tensor[2, 3].zero_()
        committed = stand_in.commit({2: row})
        assert committed.ok and committed.body["version"] == 1, committed
        layout = _layout(handle)
        assert layout.dirty and layout.dirty_reason is not None
        assert "layer 2: slot 3 holds zero-filled, not expert 7" in layout.dirty_reason
        begin = stand_in.begin(1, [1])
        assert begin.outcome is Outcome.REFUSED and "slot 3 holds zero-filled" in (
            begin.reason or ""
        )
        stand_in.exit()
    finally:
        handle.stop()


def test_a_daemon_records_a_commit_whose_new_expert_arrived_whole(tmp_path: Path) -> None:
    handle, experts = _daemon_of_rank_zero_of_two(tmp_path)
    try:
        stand_in = EngineStandIn.start(handle.socket_path, "engine-a")
        assert stand_in.begin(0, [2]).ok
        row = list(INITIAL[2])
        row[3] = 7
        for index, (tensor, width) in enumerate(
            zip(experts.tensors, experts.shape.widths, strict=True)
        ):
            tensor[2, 3] = expert_values(2, 7, index, width)
        assert stand_in.commit({2: row}).ok
        assert not _layout(handle).dirty
        stand_in.exit()
    finally:
        handle.stop()


def test_the_content_check_marks_a_layer_no_pending_move_changes_while_a_move_is_pending(
    tmp_path: Path,
) -> None:
    handle, experts = _daemon_of_rank_zero_of_two(tmp_path)
    try:
        stand_in = EngineStandIn.start(handle.socket_path, "engine-a")
        assert stand_in.begin(0, [1]).ok
        tensors = experts.tensors
        for tensor in tensors:
            tensor[1, 0] = tensor[1, 4]  # the pending move is under way in layer 1
            tensor[3, 2] = tensor[3, 5]  # someone else put expert 5 into slot 2 of layer 3
        reply = client.content_check(handle.socket_path)
        assert reply.ok and reply.content is not None, reply
        assert reply.content.dirty
        reason = reply.content.dirty_reason or ""
        assert "layer 3 slot 2: expert 2 by the record, holds expert 5" in reason, reason
        assert "layer 1" not in reason
        layout = _layout(handle)
        assert layout.dirty and layout.pending is not None and layout.pending.layers == (1,)
        stand_in.kill()
    finally:
        handle.stop()


# --- a fetch without the field once experts moved ---------------------------------------------


def _wait_detached(handle: DaemonProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _layout(handle).attached:
        assert time.monotonic() < deadline, "the daemon did not see the engine leave"
        time.sleep(0.05)


@pytest.mark.parametrize("attached", [True, False], ids=["an engine attached", "none attached"])
def test_a_daemon_refuses_a_fetch_without_the_field_after_a_move_advising_upgrade_or_restart(
    tmp_path: Path, attached: bool
) -> None:
    handle = start_daemon(tmp_path)
    try:
        stand_in = EngineStandIn.start(handle.socket_path, "engine-a")
        assert stand_in.begin(0, [1]).ok
        row = trivial_map(4, 10, 8)[1]
        row[0], row[1] = row[1], row[0]
        assert stand_in.commit({1: row}).ok
        if attached:
            others = EngineStandIn.start(handle.socket_path, "engine-b")
        else:
            stand_in.exit()
            _wait_detached(handle)
        config = request(handle.socket_path, {"type": "query_config"})["config"]
        reply = request(handle.socket_path, {"type": "fetch_state", "config": config})
        assert reply["status"] == msg.LAYOUT_REFUSED, reply
        assert reply["reason"] == (
            "this daemon's experts have moved (layout version 1) and the engine did not send "
            "the expert_layout field, so it would route with the initial layout; upgrade the "
            "engine (install the expert layout plugin) or restart the daemon"
        )
        layout = _layout(handle)
        assert not layout.non_following_fetch and layout.version == 1
        if attached:
            others.exit()
            stand_in.exit()
    finally:
        handle.stop()


# --- a wait timeout of 0 does not wait ---------------------------------------------------------


class _VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_wait_timeout_of_0_fails_the_start_at_once_naming_the_mover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_engine_startup_hook import scripted_peer

    from sglang_integration.engine import startup as engine_startup

    the_map = trivial_map(3, 10, 8)
    requests: list[str] = []

    def always_pending(conn: socket.socket) -> None:
        from sglang.srt.weight_cache.protocol import recv_msg, send_msg

        requests.append(recv_msg(conn)["type"])
        layout = protocol.LayoutView(
            version=2,
            digest=layout_digest(the_map),
            physical_to_logical_map=the_map,
            dirty=False,
            dirty_reason=None,
            pending=PendingMove("engine-b", (0, 1), 2),
            attached=("engine-b", "engine-a"),
            non_following_fetch=False,
        )
        send_msg(conn, protocol.layout_reply(layout))

    monkeypatch.setenv(settings.WAIT_TIMEOUT.env, "0")
    assert settings.WAIT_TIMEOUT.read() == 0.0
    clock = _VirtualClock()
    monkeypatch.setattr(engine_startup, "time", clock)
    path = tmp_path / "d.sock"
    with scripted_peer(path, always_pending):
        finding, attachment = engine_startup.read_daemon(
            str(path), "engine-a", rank=0, initial_digest=layout_digest(the_map)
        )
    assert attachment is not None
    attachment.close()
    assert finding.kind is FindingKind.STUCK
    assert finding.reason is not None and finding.reason.endswith(
        "engine 'engine-b' began a move of layers [0, 1] from version 2, and it was still "
        "pending after 0 s (SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT)"
    )
    assert (clock.now, clock.sleeps) == (0.0, [])
    assert requests == [protocol.ATTACH]  # not one poll


def _put_expert(experts: SharedExperts, slot: int, expert: int) -> None:
    """Expert ``expert``'s bytes into ``slot`` of layer 0, in every tensor."""
    for index, tensor in enumerate(experts.tensors):
        tensor[0, slot] = expert_values(0, expert, index, tensor.shape[-1])


def _left_mid_move(
    handle: DaemonProcess, experts: SharedExperts, slot: int, expert: int
) -> msg.ContentView:
    """A mover began a move of layer 0, put ``expert`` into ``slot`` and was SIGKILLed: the
    daemon is dirty; returns its content then."""
    mover = EngineStandIn.start(handle.socket_path, "engine-a")
    assert mover.begin(0, [0]).ok
    _put_expert(experts, slot, expert)
    mover.kill()
    deadline = time.monotonic() + 30
    while not _layout(handle).dirty:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    content = client.content_check(handle.socket_path).content
    assert content is not None
    return content


def test_a_daemon_refuses_a_forged_repair_of_an_expert_it_never_held_unless_its_print_is_carried(
    tmp_path: Path,
) -> None:
    handle, experts = _daemon_of_rank_zero_of_two(tmp_path)
    try:
        content = _left_mid_move(handle, experts, 0, 6)  # expert 6 (rank 1's) into slot 0
        attachment = client.attach(handle.socket_path, "engine-b")
        row = list(INITIAL[0])
        row[0], row[6] = 6, 0
        prints = {0: list(content.current[0])}
        forged = client.repair(handle.socket_path, "engine-b", {0: row}, prints)
        assert forged.outcome is Outcome.REFUSED
        assert "no fingerprint of expert 6" in (forged.reason or ""), forged
        wrong = {0: {6: content.recorded[0][1]}}  # expert 1's print, carried as expert 6's
        refused = client.repair(
            handle.socket_path, "engine-b", {0: row}, prints, expected_fingerprints=wrong
        )
        assert refused.outcome is Outcome.REFUSED and "parts 0-3 differ" in (refused.reason or "")
        carried = {0: {6: content.current[0][0]}}  # as rank 1's daemon recorded expert 6
        repaired = client.repair(
            handle.socket_path, "engine-b", {0: row}, prints, expected_fingerprints=carried
        )
        assert repaired.ok and repaired.body["version"] == 1, repaired
        assert not _layout(handle).dirty
        attachment.close()
    finally:
        handle.stop()


def test_a_daemon_refuses_a_repair_carrying_another_print_of_an_expert_it_recorded(
    tmp_path: Path,
) -> None:
    # A repair is proven by the daemon's own fingerprints: for an expert it recorded, a print
    # the repair carries counts for nothing, so a forged one (the bytes a slot holds now, named
    # as the expert the row claims) is refused and the ledger keeps its dirty mark.
    handle, experts = _daemon_of_rank_zero_of_two(tmp_path)
    try:
        content = _left_mid_move(handle, experts, 1, 7)  # expert 7 (rank 1's) into slot 1
        attachment = client.attach(handle.socket_path, "engine-b")
        row = list(INITIAL[0])  # as before the move: expert 1 in slot 1
        prints = {0: list(content.current[0])}
        forged = {0: {1: content.current[0][1]}}  # what slot 1 holds, carried as expert 1's
        assert handle.ledger_path is not None
        before = table_dump(Path(handle.ledger_path))
        refused = client.repair(
            handle.socket_path, "engine-b", {0: row}, prints, expected_fingerprints=forged
        )
        assert refused.outcome is Outcome.REFUSED, refused
        assert "layer 0 slot 1" in (refused.reason or "") and "expert 1" in (refused.reason or "")
        assert refusals_added(Path(handle.ledger_path), before) == ["repair_refused"]
        layout = _layout(handle)
        assert layout.dirty and layout.version == 0
        # Expert 1's own bytes back in slot 1: the same repair, carrying nothing, is accepted.
        _put_expert(experts, 1, 1)
        content = client.content_check(handle.socket_path).content
        assert content is not None
        honest = client.repair(handle.socket_path, "engine-b", {0: row}, {0: content.current[0]})
        assert honest.ok and honest.body["version"] == 1, honest
        assert not _layout(handle).dirty
        attachment.close()
    finally:
        handle.stop()
