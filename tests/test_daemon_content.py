"""A daemon that serves expert tensors fingerprints them: at load, at each commit, on request.

Each test starts a model-less daemon with ``--experts`` (shared-memory expert files the CPU
harness writes, whose bytes say which expert they are) in its own process, changes those bytes
the way a move, a broken loader or an engine without the plugin would, and talks to the daemon
over its real socket.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import trivial_map
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.protocol import Outcome
from sglang_integration.content.fingerprints import fingerprint_hex, fingerprint_slots
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
    start_daemon,
)
from sglang_integration.testing.expert_files import map_expert_files
from sglang_integration.testing.shared_experts import (
    ExpertTensorShape,
    SharedExperts,
    attach_shared_experts,
    create_shared_experts,
    expert_values,
)

pytestmark = pytest.mark.timeout(120)

LAYERS, LOGICAL, PHYSICAL = 4, 8, 12  # one daemon: EP rank 0 of 1, slots 8-11 replicate 0-3
INITIAL = trivial_map(LAYERS, PHYSICAL, LOGICAL)
SHAPE = ExpertTensorShape(LAYERS, LOGICAL, PHYSICAL, ep_size=1)


def _experts(directory: Path) -> SharedExperts:
    return create_shared_experts(directory / "experts", 0, SHAPE, INITIAL)


def _start(directory: Path, *extra: str, experts: Path | None = None) -> DaemonProcess:
    return start_daemon(
        directory,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        extra=["--experts", str(experts or directory / "experts"), *extra],
    )


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, SharedExperts]]:
    experts = _experts(tmp_path)
    handle = _start(tmp_path)
    yield handle, experts
    handle.stop()


def _write(experts: SharedExperts, layer: int, slot: int, expert: int) -> None:
    for index, (tensor, width) in enumerate(zip(experts.tensors, SHAPE.widths, strict=True)):
        tensor[layer, slot] = expert_values(layer, expert, index, width)


def _slot_prints(experts: SharedExperts, layer: int) -> list[str]:
    return fingerprint_hex(fingerprint_slots([t[layer] for t in experts.tensors], PHYSICAL))


def _layout(daemon: DaemonProcess) -> msg.LayoutView:
    reply = client.query(daemon.socket_path)
    assert reply.layout is not None, reply
    return reply.layout


def test_the_daemon_reads_the_files_the_harness_writes_as_the_same_tensors(tmp_path):
    experts = _experts(tmp_path)
    shape, routed = map_expert_files(tmp_path / "experts", 0)
    assert (shape.num_local_slots, shape.widths) == (PHYSICAL, SHAPE.widths)
    for layer in range(LAYERS):
        theirs_of_layer = experts.routed_experts_weights_of_layer()[layer]
        for mine, theirs in zip(routed[layer], theirs_of_layer, strict=True):
            assert mine.data_ptr() != theirs.data_ptr() and bool((mine == theirs).all())
    experts.tensors[1][2, 3, 0] = 99.0  # one mapping, the same bytes
    assert float(routed[2][1][3, 0]) == 99.0


def test_the_start_records_every_slot_and_the_content_check_finds_them_unchanged(daemon):
    handle, experts = daemon
    reply = client.content_check(handle.socket_path)
    assert reply.ok and reply.content is not None, reply
    content = reply.content
    assert (content.version, content.first_slot, content.dirty) == (0, 0, False)
    assert content.recorded == content.current
    assert list(content.recorded[2]) == _slot_prints(experts, 2)
    assert content.recorded[2][1] == content.recorded[2][9]  # slot 9 replicates expert 1
    with contextlib.closing(sqlite3.connect(f"file:{handle.ledger_path}?mode=ro", uri=True)) as c:
        rows = c.execute(
            "SELECT count(*), count(DISTINCT fingerprint) FROM ledger_slot_fingerprints "
            "WHERE layer = 2 AND version = 0"
        ).fetchone()
    assert rows == (PHYSICAL, LOGICAL)


def test_a_load_with_an_unfilled_replica_is_refused_naming_layer_and_slots(tmp_path):
    experts = _experts(tmp_path)
    for tensor in experts.tensors:
        tensor[3, 10].zero_()  # the second replica of expert 2 in layer 3, never filled
    handle = _start(tmp_path)
    try:
        layout = _layout(handle)
        assert layout.dirty and layout.dirty_reason is not None
        assert "layer 3: expert 2 in slots that differ (slot 2 " in layout.dirty_reason
        assert "slot 10 zero-filled" in layout.dirty_reason
        stand_in = EngineStandIn.start(handle.socket_path, "engine-A")
        begin = stand_in.begin(0, [1])
        assert begin.outcome is Outcome.REFUSED and "slot 10 zero-filled" in (begin.reason or "")
        config = request(handle.socket_path, {"type": "query_config"})["config"]
        fetch = stand_in.fetch_state(
            config, {"engine_id": "engine-A", "version": 0, "digest": layout.digest}
        )
        assert fetch["status"] == msg.LAYOUT_REFUSED and "slot 10 zero-filled" in fetch["reason"]
        stand_in.exit()
    finally:
        handle.stop()


def test_warn_serves_a_load_with_an_unfilled_replica_and_off_records_no_fingerprints(tmp_path):
    experts = _experts(tmp_path)
    for tensor in experts.tensors:
        tensor[3, 10].zero_()
    files = tmp_path / "experts"
    warned = _start(tmp_path / "warn", "--expert-layout-content-check", "warn", experts=files)
    try:
        assert not _layout(warned).dirty
        assert "slot 10 zero-filled) (content check warn: serving anyway)" in warned.log()
    finally:
        warned.stop()
    off = _start(tmp_path / "off", "--expert-layout-content-check", "off", experts=files)
    try:
        assert not _layout(off).dirty
        reply = client.content_check(off.socket_path)
        assert reply.outcome is Outcome.NO_RECORD
        assert "records no slot fingerprints" in (reply.reason or "")
    finally:
        off.stop()


def test_content_that_moved_without_a_commit_marks_the_daemon_dirty_at_the_check(daemon):
    handle, experts = daemon
    _write(experts, 1, 6, 0)  # an engine without the plugin put expert 0 in slot 6
    reply = client.content_check(handle.socket_path)
    assert reply.ok and reply.content is not None and reply.content.dirty
    assert "layer 1 slot 6: expert 6 by the record, holds expert 0" in (
        reply.content.dirty_reason or ""
    )
    assert _layout(handle).dirty


def test_a_commit_records_the_moved_layers_fingerprints(daemon):
    handle, experts = daemon
    stand_in = EngineStandIn.start(handle.socket_path, "engine-A")
    assert stand_in.begin(0, [2]).ok
    row = list(INITIAL[2])
    row[0], row[5] = row[5], row[0]
    _write(experts, 2, 0, row[0])
    _write(experts, 2, 5, row[5])
    committed = stand_in.commit({2: row})
    assert committed.ok, committed
    content = client.content_check(handle.socket_path).content
    assert content is not None and not content.dirty
    assert list(content.recorded[2]) == _slot_prints(experts, 2)
    stand_in.exit()


def test_a_repair_over_the_socket_records_what_the_slots_hold_and_clears_the_dirty_mark(daemon):
    handle, experts = daemon
    mover = EngineStandIn.start(handle.socket_path, "engine-A")
    assert mover.begin(0, [1, 3]).ok
    row = list(INITIAL[1])
    row[2], row[4] = row[4], row[2]
    _write(experts, 1, 2, row[2])
    _write(experts, 1, 4, row[4])  # layer 1 moved; layer 3 not yet
    mover.kill()
    _wait_dirty(handle)
    content = client.content_check(handle.socket_path).content
    assert content is not None and content.dirty_move is not None
    assert content.dirty_move.layers == (1, 3)
    repairer = EngineStandIn.start(handle.socket_path, "engine-B")
    rows = {1: row, 3: list(INITIAL[3])}
    prints = {layer: list(content.current[layer]) for layer in rows}
    wrong = client.repair(handle.socket_path, "engine-B", {1: INITIAL[1], 3: INITIAL[3]}, prints)
    assert wrong.outcome is Outcome.REFUSED and "slot 2 holds expert 4, not expert 2" in (
        wrong.reason or ""
    )
    repaired = client.repair(handle.socket_path, "engine-B", rows, prints)
    assert repaired.ok and repaired.body["version"] == 1, repaired
    layout = _layout(handle)
    assert (layout.dirty, layout.version, layout.physical_to_logical_map[1]) == (False, 1, row)
    assert repairer.begin(1, [0]).ok  # moves are allowed again
    repairer.exit()


def test_a_daemon_without_expert_files_answers_the_content_check_no_record(tmp_path):
    handle = start_daemon(
        tmp_path, num_layers=LAYERS, num_logical_experts=LOGICAL, num_physical_experts=PHYSICAL
    )
    try:
        reply = client.content_check(handle.socket_path)
        assert reply.outcome is Outcome.NO_RECORD
    finally:
        handle.stop()


@pytest.mark.parametrize("kind", [msg.CONTENT_CHECK, msg.REPAIR])
def test_sglangs_own_daemon_answers_the_new_requests_unknown_request_type(tmp_path, kind):
    handle = start_daemon(
        tmp_path,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        record="no-plugin",
    )
    try:
        if kind == msg.CONTENT_CHECK:
            reply = client.content_check(handle.socket_path)
        else:
            reply = client.repair(handle.socket_path, "engine-B", {0: INITIAL[0]}, {0: []})
        assert reply.outcome is Outcome.OLDER_DAEMON, reply
    finally:
        handle.stop()


def _wait_dirty(handle: DaemonProcess, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not _layout(handle).dirty:
        if time.monotonic() > deadline:
            raise TimeoutError("the daemon did not turn dirty")
        time.sleep(0.05)


def test_the_expert_files_of_a_second_rank_start_at_its_first_slot(tmp_path):
    shape = ExpertTensorShape(LAYERS, LOGICAL, PHYSICAL, ep_size=2)
    for rank in range(2):
        create_shared_experts(tmp_path / "experts", rank, shape, INITIAL)
    handle = _start(tmp_path, "--expert-rank", "1")
    try:
        content = client.content_check(handle.socket_path).content
        assert content is not None and content.first_slot == 6
        second = attach_shared_experts(tmp_path / "experts", 1)
        prints = fingerprint_hex(fingerprint_slots([t[0] for t in second.tensors], 6))
        assert list(content.recorded[0]) == prints
    finally:
        handle.stop()


# --- the real load hook, around sglang's EPLB initialisation, with a loaded model ---------------


def _load_hook_check(directory: str) -> None:
    import json
    from types import SimpleNamespace

    import torch
    from test_daemon_sglang_hooks import (
        INITIAL as HOOK_INITIAL,
    )
    from test_daemon_sglang_hooks import (
        _cpu_part_of_load,
        _server_args,
        _use_sglangs_cpu_platform,
    )

    from layout_ledger.core.layout import Geometry
    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.daemon import layout_side
    from sglang_integration.testing.daemon import build_model_less_daemon, model_less_cache_config
    from sglang_integration.testing.daemon_control import redirect_output

    root = Path(directory)
    redirect_output(str(root / "child.log"))
    _use_sglangs_cpu_platform()
    os.environ["SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"] = (
        f"{directory}/ledger-{{device_uuid}}.sqlite"
    )
    server_args = _server_args(root, enable_eplb=True)
    # EP rank 0 of 2: local slots 0-4; each slot's bytes say the expert the map names there
    routed = {
        layer: [torch.tensor([[float(e), 1.0 + layer] for e in HOOK_INITIAL[layer][:5]])]
        for layer in range(len(HOOK_INITIAL))
    }
    cpu_load = _cpu_part_of_load(server_args)

    def load(daemon: Any) -> None:
        cpu_load(daemon)
        daemon.model = SimpleNamespace(routed_experts_weights_of_layer=routed)

    daemon = build_model_less_daemon(
        str(root / "d.sock"), model_less_cache_config(Geometry(1, 1, 1))
    )
    daemon.server_args = server_args
    daemon_hooks.around_load(load, daemon)
    service = layout_side.daemon_layout(daemon).service
    first = service.handle({"type": msg.CONTENT_CHECK})
    routed[2][0][3] = routed[2][0][0]  # slot 3 of layer 2 now holds slot 0's expert
    second = service.handle({"type": msg.CONTENT_CHECK})
    layout_side.close_daemon_layout(daemon)
    (root / "result.json").write_text(
        json.dumps(
            {
                "first": {k: first["content"][k] for k in ("first_slot", "dirty")},
                "layers": sorted(first["content"]["recorded"]),
                "slots": [len(v) for v in first["content"]["recorded"].values()],
                "expected": fingerprint_hex(fingerprint_slots(routed[0], 5)),
                "recorded0": first["content"]["recorded"][0],
                "second_dirty": second["content"]["dirty_reason"],
            }
        )
    )


def test_the_daemon_load_hook_fingerprints_the_loaded_models_routed_expert_slots(tmp_path):
    from test_daemon_sglang_hooks import INITIAL as HOOK_INITIAL
    from test_daemon_sglang_hooks import run_isolated

    result = run_isolated(_load_hook_check, tmp_path)
    assert result["first"] == {"first_slot": 0, "dirty": False}
    assert (result["layers"], result["slots"]) == ([0, 1, 2], [5, 5, 5])
    assert result["recorded0"] == result["expected"]
    named = HOOK_INITIAL[2][3]
    assert (
        f"layer 2 slot 3: expert {named} by the record, holds expert {HOOK_INITIAL[2][0]}"
        in (result["second_dirty"])
    )


def test_a_content_check_racing_a_begin_move_and_commit_leaves_the_daemon_clean(tmp_path):
    """The daemon's gate (``--fingerprint-gate``) holds the check between its read of the slots
    and its comparison while an engine begins, moves and commits: the check must compare its
    fingerprints with the version they were read at, never the commit's."""
    import threading
    import time

    experts = _experts(tmp_path)
    gate = tmp_path / "gate"
    gate.mkdir()
    handle = _start(tmp_path, "--fingerprint-gate", str(gate))
    try:
        replies: list[Any] = []
        checker = threading.Thread(
            target=lambda: replies.append(client.content_check(handle.socket_path))
        )
        checker.start()
        deadline = time.monotonic() + 30
        while not (gate / "read-1").exists():
            assert time.monotonic() < deadline, "the check never read the slots"
            time.sleep(0.01)
        stand_in = EngineStandIn.start(handle.socket_path, "engine-A")
        assert stand_in.begin(0, [0]).ok
        row = list(INITIAL[0])
        row[0], row[1] = row[1], row[0]
        _write(experts, 0, 0, row[0])
        _write(experts, 0, 1, row[1])
        assert stand_in.commit({0: row}).ok
        for n in range(1, 5):
            (gate / f"go-{n}").touch()
        checker.join(60)
        (reply,) = replies
        assert reply.ok and reply.content is not None, reply
        assert not reply.content.dirty, reply.content.dirty_reason
        layout = _layout(handle)
        assert (layout.dirty, layout.version) == (False, 1)
        assert stand_in.begin(1, [2]).ok  # still clean: moves go on
        stand_in.exit()
    finally:
        handle.stop()


def test_a_load_whose_only_copy_of_an_expert_is_negative_zeros_is_refused(tmp_path):
    experts = _experts(tmp_path)
    for tensor in experts.tensors:
        tensor[1, 5] = -0.0  # expert 5's only copy in layer 1: bytes, but no weights at all
    handle = _start(tmp_path)
    try:
        layout = _layout(handle)
        assert layout.dirty, "a daemon whose only copy of an expert is empty started clean"
        assert "layer 1: expert 5 in slot 5 is zero-filled" in (layout.dirty_reason or "")
        content = client.content_check(handle.socket_path).content
        assert content is not None and content.recorded[1][5] == "0" * 64
    finally:
        handle.stop()
