"""The IPC loader hooks: the ``expert_layout`` field, refusals without disk fallback, the source.

sglang's real ``IpcModelLoader`` (hooked through ``HookRegistry``) runs in an engine rank process
of ``EngineRanks`` (tests/test_engine_startup_hook.py) after the real startup hook. Daemons:

- the model-less daemon with the plugin (``sglang_integration.testing.daemon``), stating the
  ``CacheConfig`` this engine sends so that its config check passes and the layout check decides
  (``daemon_stating``; the config is captured from the loader's own first request);
- sglang 0.5.23's own daemon without the plugin (the same, ``--without-plugin``);
- a scripted peer on a real Unix socket where the reply must be one no daemon here would send
  to this engine (a refusal of a layout the engine does follow).

"An older engine" is ``IpcModelLoader`` with sglang's own ``_fetch_from_cache`` (the hook's
``__wrapped__``): it sends no field and shows sglang's own error on a refusal.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_engine_startup_hook import (
    NUM_LAYERS,
    NUM_LOGICAL,
    NUM_SLOTS,
    EngineRanks,
    model_less_daemon,
    scripted_peer,
)

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.wire import protocol
from layout_ledger.wire.protocol import Outcome
from sglang_integration.engine import client
from sglang_integration.testing.cpu_engine import write_tiny_moe_config
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
)

INITIAL = trivial_map(NUM_LAYERS, NUM_SLOTS, NUM_LOGICAL)
MOVE = {1: [7, 6, 5, 4, 3, 2, 1, 0, 0, 1]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_config(tmp_path_factory.mktemp("model") / "moe", NUM_LAYERS, NUM_LOGICAL)


@pytest.fixture(scope="module")
def one_rank(model_dir: Path) -> Iterator[EngineRanks]:
    with EngineRanks(1, model_dir) as ranks:
        yield ranks


def run(ranks: EngineRanks, model_dir: Path, socket_path: str | Path, **extra: Any) -> Any:
    (report,) = ranks.run(
        {
            "model_dir": str(model_dir),
            "args": {"weight_cache_mode": "client"},
            "sockets": [str(socket_path)],
            **extra,
        }
    )
    return report


def _refusing_daemon(requests: list[dict[str, Any]], reason: str) -> Any:
    """Answers attach as sglang's own daemon does (unknown type), refuses the weights' fetch."""

    def handle(conn: socket.socket) -> None:
        from sglang.srt.weight_cache.protocol import recv_msg, send_msg

        request_ = recv_msg(conn)
        requests.append(request_)
        if request_.get("type") == protocol.FETCH_STATE:
            send_msg(conn, {"status": protocol.LAYOUT_REFUSED, "reason": reason})
        else:
            unknown = f"Unknown request type: {request_['type']}"
            send_msg(conn, {"status": "error", "message": unknown})

    return handle


@pytest.fixture(scope="module")
def engine_cache_config(
    one_rank: EngineRanks, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The CacheConfig this engine rank's loader sends, captured from its fetch_state."""
    requests: list[dict[str, Any]] = []
    path = tmp_path_factory.mktemp("capture") / "capture.sock"
    with scripted_peer(path, _refusing_daemon(requests, "capture")):
        run(one_rank, model_dir, path, fetch="fetch")
    (fetch,) = [r for r in requests if r.get("type") == protocol.FETCH_STATE]
    return dict(fetch["config"])


def daemon_stating(directory: Path, cache_config: dict[str, Any], record: str = "ledger") -> Any:
    """A model-less daemon whose ``CacheConfig`` is this engine's (so the layout check decides)."""
    return model_less_daemon(directory, record=record, cache_config=cache_config)


def moved_by_another_engine(daemon: DaemonProcess) -> None:
    mover = EngineStandIn.start(daemon.socket_path, "mover")
    try:
        assert mover.begin(0, sorted(MOVE)).ok
        assert mover.commit(MOVE).ok
    finally:
        mover.exit()


# --- the field and the daemon's verdict -------------------------------------------------------


@pytest.mark.timeout(180)
def test_an_attached_engine_declares_its_layout_and_the_daemon_serves_it_as_following(
    one_rank: EngineRanks, model_dir: Path, engine_cache_config: dict[str, Any], tmp_path: Path
) -> None:
    with daemon_stating(tmp_path, engine_cache_config) as daemon:
        report = run(one_rank, model_dir, daemon.socket_path, fetch="fetch")
        after = client.query(daemon.socket_path).layout
    assert report["error"] is None
    assert report["session"]["attached"] is True
    assert report["fetch"] == {"result": "ok", "weight_source": "daemon"}
    # The daemon took the field as this attached engine's, at its digest: moves stay allowed.
    assert after is not None
    assert after.non_following_fetch is False
    assert report["session"]["engine_id"] in after.attached


@pytest.mark.timeout(180)
def test_the_loader_sends_engine_id_version_and_the_digest_it_routes_with(
    one_rank: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    requests: list[dict[str, Any]] = []
    path = tmp_path / "refusing.sock"
    reason = "the daemon's experts have moved; upgrade the engine or restart the daemon"
    with scripted_peer(path, _refusing_daemon(requests, reason)):
        report = run(one_rank, model_dir, path, fetch="load_model")
    assert report["error"] is None
    (fetch,) = [r for r in requests if r.get("type") == protocol.FETCH_STATE]
    assert fetch[protocol.FETCH_LAYOUT_FIELD] == {
        "engine_id": None,  # this daemon did not accept an attach
        "version": 0,
        "digest": layout_digest(INITIAL),
    }
    assert report["fetch"] == {
        "error": (
            f"LayoutRefusedError: [IpcModelLoader] The weight cache daemon at {path} refused to "
            f"serve its weights to this engine's expert layout: {reason}"
        ),
        "weight_source": None,  # neither daemon nor disk: _RecordingDiskLoader never ran
    }


@pytest.mark.timeout(180)
def test_a_layout_refusal_from_the_daemon_raises_its_reason_and_never_loads_from_disk(
    one_rank: EngineRanks, model_dir: Path, engine_cache_config: dict[str, Any], tmp_path: Path
) -> None:
    # An engine whose loader has the plugin but whose startup did not run the hook (so it
    # declares no layout) on a daemon whose experts moved: the daemon refuses, with its reason.
    with daemon_stating(tmp_path, engine_cache_config) as daemon:
        moved_by_another_engine(daemon)
        report = run(
            one_rank, model_dir, daemon.socket_path, startup="original", fetch="load_model"
        )
    assert report["session"] is None
    error = report["fetch"]["error"]
    assert error.startswith(
        f"LayoutRefusedError: [IpcModelLoader] The weight cache daemon at {daemon.socket_path} "
        "refused to serve its weights to this engine's expert layout: this daemon's experts "
        "have moved (layout version 1)"
    )
    assert error.endswith(
        "upgrade the engine (install the expert layout plugin) or restart the daemon"
    )
    assert report["fetch"]["weight_source"] is None


@pytest.mark.timeout(180)
def test_the_loader_records_disk_when_no_daemon_socket_exists(
    one_rank: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    report = run(one_rank, model_dir, tmp_path / "absent.sock", fetch="load_model")
    assert report["fetch"] == {"result": "'loaded-from-disk'", "weight_source": "disk"}


# --- compatibility ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_new_engine_on_an_older_daemon_starts_on_its_own_layout_and_is_served(
    one_rank: EngineRanks, model_dir: Path, engine_cache_config: dict[str, Any], tmp_path: Path
) -> None:
    with daemon_stating(tmp_path, engine_cache_config, record="no-plugin") as older:
        report = run(one_rank, model_dir, older.socket_path, fetch="fetch")
    assert report["error"] is None
    assert report["map"] == INITIAL
    assert report["session"]["finding"] == "older_daemon"
    warnings = [text for level, text in report["logs"] if level == "WARNING"]
    assert len(warnings) == 1 and "will not be rebalanced" in warnings[0]
    # The older daemon ignores the extra field and serves the weights.
    assert report["fetch"] == {"result": "ok", "weight_source": "daemon"}


@pytest.mark.timeout(180)
def test_older_engine_on_a_new_daemon_is_served_at_version_zero_and_then_moves_are_off(
    one_rank: EngineRanks, model_dir: Path, engine_cache_config: dict[str, Any], tmp_path: Path
) -> None:
    with daemon_stating(tmp_path, engine_cache_config) as daemon:
        report = run(
            one_rank,
            model_dir,
            daemon.socket_path,
            startup="original",
            fetch="older_fetch",
        )
        assert report["fetch"] == {"result": "ok", "weight_source": None}  # served
        state = client.query(daemon.socket_path).layout
        mover = EngineStandIn.start(daemon.socket_path, "mover")
        try:
            begin = mover.begin(0, [1])
        finally:
            mover.exit()
    assert state is not None and state.non_following_fetch is True
    assert begin.outcome is Outcome.REFUSED


@pytest.mark.timeout(180)
def test_older_engine_on_a_new_daemon_after_a_move_is_refused_and_does_not_fall_back(
    one_rank: EngineRanks, model_dir: Path, engine_cache_config: dict[str, Any], tmp_path: Path
) -> None:
    with daemon_stating(tmp_path, engine_cache_config) as daemon:
        moved_by_another_engine(daemon)
        report = run(
            one_rank,
            model_dir,
            daemon.socket_path,
            startup="original",
            fetch="older_load_model",
        )
        # What sglang's own loader received (it prints a config mismatch, not the reason).
        reply = request(daemon.socket_path, {"type": "fetch_state", "config": engine_cache_config})
    assert report["fetch"]["error"].startswith(
        "RuntimeError: [IpcModelLoader] Daemon config mismatch!"
    )
    assert "result" not in report["fetch"]  # no disk fallback
    assert reply["status"] == protocol.LAYOUT_REFUSED
    assert reply["reason"].endswith(
        "upgrade the engine (install the expert layout plugin) or restart the daemon"
    )
