"""The startup hook on sglang's real ``ModelRunner.maybe_init_expert_location_metadata``.

Engine ranks are fresh processes with real ``ServerArgs`` + ``publish``, a real ``ModelConfig``
from a tiny ``config.json`` (no weights) and sglang's real world group on gloo. The hooks are
installed through sglang's ``HookRegistry`` exactly as the plugin does, and the ranks call the
real (hooked) method. The one stand-in: the ``ModelRunner`` instance itself is a namespace with
the three attributes the method and the hook read (``is_draft_worker``, ``model_config``,
``gpu_id``), because constructing a real ``ModelRunner`` allocates GPU memory; and the expert
distribution recorder that the original method builds allocates its counters on the CPU
instead of the accelerator (see ``_rank_main``).

Processes come from the forkserver of ``sglang_integration.testing.cpu_engine`` that has
imported sglang once (``sglang_context``), so a rank or a daemon starts in about a second
instead of paying sglang's ~12 s import each time; each child still publishes its own config,
and nothing of sglang runs in the pytest process.

The helpers at the top (``sglang_context``, ``EngineRanks``, ``model_less_daemon``,
``scripted_peer``, the config writers) are also used by the other tests/test_engine_*.py,
tests/test_client_*.py and tests/test_loader_*.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.wire import protocol
from sglang_integration.testing.cpu_engine import (
    LogCapture,
    free_port,
    write_tiny_moe_config,
)
from sglang_integration.testing.daemon_control import DaemonProcess
from sglang_integration.testing.sglang_env import QUIET_SGLANG_ENV

NUM_LAYERS = 3
NUM_LOGICAL = 8
NUM_REDUNDANT = 2
NUM_SLOTS = NUM_LOGICAL + NUM_REDUNDANT


def sglang_context() -> Any:
    """The shared forkserver context, its server preloading the daemon and the engine side."""
    from sglang_integration.testing.cpu_engine import engine_process_context

    return engine_process_context()


def write_tiny_dense_config(directory: Path) -> Path:
    """A dense Qwen3 ``config.json``: a model without expert-location metadata."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- daemons and scripted peers ---------------------------------------------------------------


def _serve_daemon_stating(argv: list[str], cache_config: dict[str, Any], log_path: str) -> None:
    """Forkserver child: the model-less daemon's ``main``, stating ``cache_config``."""
    from sglang_integration.testing import daemon, daemon_control

    daemon_control.redirect_output(log_path)
    daemon.model_less_cache_config = lambda geometry: cache_config
    raise SystemExit(daemon.main(argv))


@contextlib.contextmanager
def model_less_daemon(
    directory: Path,
    *,
    record: str = "ledger",
    cache_config: dict[str, Any] | None = None,
    num_physical_experts: int = NUM_SLOTS,
) -> Iterator[DaemonProcess]:
    """A model-less daemon (``testing.daemon``) in ``directory``; stopped when the block ends.

    ``record``: ``ledger``, ``none`` (no ``--enable-eplb``) or ``no-plugin`` (sglang 0.5.23's
    own daemon). With ``cache_config`` it states that ``CacheConfig`` instead of its model-less
    one, so that a real engine's ``fetch_state`` passes the config check.
    """
    from sglang_integration.testing.daemon_control import (
        daemon_argv,
        start_daemon,
        wait_until_serving,
    )

    geometry = {
        "num_layers": NUM_LAYERS,
        "num_logical_experts": NUM_LOGICAL,
        "num_physical_experts": num_physical_experts,
    }
    if cache_config is None:
        handle = start_daemon(directory, record=record, **geometry)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        socket_path = str(directory / "daemon.sock")
        ledger = str(directory / "daemon.sqlite") if record == "ledger" else None
        argv = daemon_argv(socket_path, ledger, record=record, **geometry)
        handle = DaemonProcess(socket_path, ledger, str(directory / "daemon.log"), argv)
        handle.process = sglang_context().Process(
            target=_serve_daemon_stating, args=(argv, cache_config, handle.log_path), daemon=True
        )
        handle.process.start()
        try:
            wait_until_serving(socket_path, handle.is_alive, describe=handle.log)
        except BaseException:
            handle.kill()
            raise
    try:
        yield handle
    finally:
        handle.stop()


@contextlib.contextmanager
def scripted_peer(path: Path, handle: Any) -> Iterator[list[socket.socket]]:
    """A listener on a real Unix socket that runs ``handle(conn)`` for each connection."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    kept: list[socket.socket] = []
    stop = threading.Event()

    def loop() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            kept.append(conn)
            handle(conn)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield kept
    finally:
        stop.set()
        thread.join(5)
        for conn in kept:
            conn.close()
        server.close()


# --- engine ranks -----------------------------------------------------------------------------


def _server_args(scenario: dict[str, Any], rank: int, world_size: int) -> Any:
    from sglang.srt.server_args import ServerArgs

    fields: dict[str, Any] = {
        "model_path": scenario["model_dir"],
        "device": "cpu",
        "tp_size": world_size,
        "ep_size": world_size,
        "enable_eplb": world_size > 1,
        "ep_num_redundant_experts": NUM_REDUNDANT,
        "skip_tokenizer_init": True,
        **scenario.get("args", {}),
    }
    sockets = scenario.get("sockets")
    if sockets is not None:
        fields["weight_cache_socket"] = sockets[rank]
    return ServerArgs(**fields)


class _RecordingDiskLoader:
    """Stands in for DefaultModelLoader on the disk fallback: there are no weights to read."""

    def __init__(self, load_config: Any) -> None:
        pass

    def load_model(self, *, model_config: Any, device_config: Any) -> Any:
        return "loaded-from-disk"


def _fetch(scenario: dict[str, Any], rank: int, model_config: Any) -> dict[str, Any]:
    """The IPC loader (real class, hooked) on this rank's socket.

    ``scenario["fetch"]``: ``fetch`` calls ``_fetch_from_cache``, ``load_model`` the whole
    ``load_model`` (mapping served tensors needs the model-parallel groups, so it is used where
    the fetch is refused or falls back to disk). ``older_fetch`` / ``older_load_model`` do the
    same with a loader without the plugin's fetch hook (sglang 0.5.23's own
    ``_fetch_from_cache``, kept by the hook as ``__wrapped__``; the send/recv hooks then pass
    everything through, as without the plugin).
    """
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.weight_cache.ipc_loader import IpcModelLoader

    from sglang_integration.engine.weight_source import weight_source

    how = scenario["fetch"]
    loader_class = IpcModelLoader
    if how.startswith("older_"):
        loader_class = type(
            "OlderIpcModelLoader",
            (IpcModelLoader,),
            {"_fetch_from_cache": IpcModelLoader._fetch_from_cache.__wrapped__},
        )
    loader = loader_class(
        LoadConfig(),
        socket_path=scenario["sockets"][rank],
        fallback_loader_cls=_RecordingDiskLoader,
        weight_cache_mode="client",
    )
    device_config = DeviceConfig("cpu", 0)
    outcome: dict[str, Any] = {}
    try:
        if how.endswith("load_model"):
            outcome["result"] = repr(
                loader.load_model(model_config=model_config, device_config=device_config)
            )
        else:
            served = loader._fetch_from_cache(model_config, device_config)
            outcome["result"] = None if served is None else served.get("status")
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    source = weight_source()
    outcome["weight_source"] = None if source is None else source.value
    return outcome


def _run_scenario(scenario: dict[str, Any], rank: int, world_size: int, capture: LogCapture) -> Any:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_resources, publish

    from sglang_integration.engine import rebalance_agent, weight_source
    from sglang_integration.engine import startup as engine_startup
    from sglang_integration.engine.metadata import map_of

    if scenario.get("continue"):  # a later phase of the same start (tests/test_standby_engine.py)
        report = {"rank": rank, "error": None}
        _then(scenario, rank, report)
        report["logs"] = capture.take()
        return report
    engine_startup.close_session()
    weight_source._ThisRank.source = None
    get_resources().expert_location_metadata = None
    for key, value in scenario.get("env", {}).items():
        os.environ[key] = value
    capture.take()  # drop the lines of an earlier scenario
    args = _server_args(scenario, rank, world_size)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    model_config = ModelConfig.from_server_args(args)
    runner = types.SimpleNamespace(
        is_draft_worker=scenario.get("is_draft_worker", False),
        model_config=model_config,
        gpu_id=0,
    )
    report: dict[str, Any] = {"rank": rank}
    started = time.monotonic()
    method = ModelRunner.maybe_init_expert_location_metadata
    if scenario.get("startup") == "original":
        method = method.__wrapped__  # sglang's own method, without the startup hook
    gathers: list[tuple[Any, list[Any]]] = []
    if scenario.get("record_gathers"):
        _record_gathers(gathers)
    try:
        method(runner)
        report["error"] = None
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    finally:
        if scenario.get("record_gathers"):
            report["gathers"] = gathers
            _record_gathers(None)
    report["seconds"] = time.monotonic() - started
    metadata = get_global_expert_location_metadata()
    report["map"] = None if metadata is None else map_of(metadata)
    session = engine_startup.current_session()
    report["session"] = (
        None
        if session is None
        else {
            "engine_id": session.engine_id,
            "finding": session.finding.value,
            "attached": session.attached,
            "version": session.version,
            "digest": session.digest,
            # whether this rank made the rebalance agents' gloo group (``create_group``)
            "agents_group": rebalance_agent.current_group() is not None,
            # the version a convergence moves the daemons to once the weights are loaded
            "converging_to": None if session.converge is None else session.converge.plan.version,
        }
    )
    if scenario.get("fetch") and report["error"] is None:
        report["fetch"] = _fetch(scenario, rank, model_config)
    if report["error"] is None:
        _then(scenario, rank, report)
    report["logs"] = capture.take()
    for key in scenario.get("env", {}):
        os.environ.pop(key, None)
    return report


# ``reply_gather.all_gather_small`` itself, while ``_record_gathers`` wraps it.
_ROOT_GATHER: list[Any] = []


def _record_gathers(into: list[tuple[Any, list[Any]]] | None) -> None:
    """With a list: every small all-gather of sglang's world group (``reply_gather``: the
    start's findings) appends (the value this rank sent, the values it received); None: stop."""
    from sglang_integration.engine import reply_gather

    if not _ROOT_GATHER:
        _ROOT_GATHER.append(reply_gather.all_gather_small)
    original = _ROOT_GATHER[0]
    if into is None:
        reply_gather.all_gather_small = original
        return

    def recorded(group: Any, value: Any) -> list[Any]:
        received: list[Any] = original(group, value)
        into.append((value, list(received)))
        return received

    reply_gather.all_gather_small = recorded


def _then(scenario: dict[str, Any], rank: int, report: dict[str, Any]) -> None:
    """``scenario["then"]``: steps run after the startup (``testing.standby_steps``)."""
    if scenario.get("then") is None:
        return
    from sglang_integration.testing.standby_steps import run_steps

    try:
        run_steps(scenario["then"], rank, report)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()


def _rank_main(
    rank: int, world_size: int, port: int, base: dict[str, Any], commands: Any, results: Any
) -> None:
    os.environ.update(QUIET_SGLANG_ENV)
    from sglang.srt.distributed.parallel_state import init_distributed_environment

    # The one GPU stand-in below the ModelRunner: with --enable-eplb, the original method builds
    # sglang's expert distribution recorder, whose gatherers allocate their counters on the
    # accelerator that sglang.srt.utils.get_device names (it raises "No accelerator ..." on a
    # machine without one). Here the CPU is that accelerator.
    from sglang.srt.eplb import expert_distribution
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.runtime_context import SpawnRanks, publish

    from sglang_integration.engine import ipc_loader as loader_hooks
    from sglang_integration.engine import startup as engine_startup

    expert_distribution.get_device = lambda device_id=None: "cpu"
    capture = LogCapture()
    logging.getLogger("sglang_integration").addHandler(capture)
    logging.getLogger("sglang_integration").setLevel(logging.INFO)
    base_args = _server_args(base, rank, world_size)
    publish(base_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    init_distributed_environment(
        backend="gloo",
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
    )
    HookRegistry.register(
        engine_startup.HOOK_TARGET,
        engine_startup.around_maybe_init_expert_location_metadata,
        HookType.AROUND,
    )
    for target, hook in loader_hooks.HOOKS:
        HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    results.put(("ready", rank))
    while True:
        scenario = commands.get()
        if scenario is None:
            return
        results.put(("report", _run_scenario(scenario, rank, world_size, capture)))


class EngineRanks:
    """``world_size`` engine rank processes that run scenarios on command, all at once."""

    def __init__(self, world_size: int, model_dir: Path, **args: Any) -> None:
        self.world_size = world_size
        base = {"model_dir": str(model_dir), "args": args}
        context = sglang_context()
        self._results = context.Queue()
        self._commands = [context.Queue() for _ in range(world_size)]
        port = free_port()
        self._processes = [
            context.Process(
                target=_rank_main,
                args=(rank, world_size, port, base, self._commands[rank], self._results),
            )
            for rank in range(world_size)
        ]

    def __enter__(self) -> EngineRanks:
        for process in self._processes:
            process.start()
        ready = [self._get(90) for _ in range(self.world_size)]
        assert sorted(rank for _, rank in ready) == list(range(self.world_size))
        return self

    def __exit__(self, *exc: Any) -> None:
        for command in self._commands:
            command.put(None)
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()

    def _get(self, timeout: float) -> Any:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            dead = [p.exitcode for p in self._processes]
            raise AssertionError(f"an engine rank did not answer (exit codes {dead})") from None

    def start(self, scenario: dict[str, Any]) -> None:
        """Start ``scenario`` on every rank; ``collect`` the reports."""
        for command in self._commands:
            command.put(scenario)

    def collect(self, timeout: float = 120) -> list[dict[str, Any]]:
        reports = [self._get(timeout)[1] for _ in range(self.world_size)]
        return sorted(reports, key=lambda report: report["rank"])

    def run(self, scenario: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
        """Run ``scenario`` on every rank; return each rank's report, by rank."""
        self.start(scenario)
        return self.collect(timeout)


def warnings_of(report: dict[str, Any]) -> list[str]:
    return [text for level, text in report["logs"] if level == "WARNING"]


# --- single-rank tests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "moe": write_tiny_moe_config(root / "moe", NUM_LAYERS, NUM_LOGICAL),
        "dense": write_tiny_dense_config(root / "dense"),
    }


@pytest.fixture(scope="module")
def one_rank(models: dict[str, Path]) -> Iterator[EngineRanks]:
    with EngineRanks(1, models["moe"]) as ranks:
        yield ranks


INITIAL = trivial_map(NUM_LAYERS, NUM_SLOTS, NUM_LOGICAL)


def _counting_peer(path: Path) -> Any:
    connections: list[int] = []
    return connections, scripted_peer(path, lambda conn: connections.append(1))


@pytest.mark.timeout(180)
def test_weight_cache_off_runs_the_original_untouched(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    connections, peer = _counting_peer(tmp_path / "d.sock")
    with peer:
        (report,) = one_rank.run(
            {
                "model_dir": str(models["moe"]),
                "args": {"weight_cache_mode": "off"},
                "sockets": [str(tmp_path / "d.sock")],
            }
        )
    assert report["error"] is None
    assert report["map"] == INITIAL
    assert report["session"] is None
    assert connections == []


@pytest.mark.timeout(180)
def test_a_dense_model_with_the_weight_cache_on_is_untouched(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    connections, peer = _counting_peer(tmp_path / "d.sock")
    with peer:
        (report,) = one_rank.run(
            {
                "model_dir": str(models["dense"]),
                "args": {"weight_cache_mode": "client", "ep_num_redundant_experts": 0},
                "sockets": [str(tmp_path / "d.sock")],
            }
        )
    assert report["error"] is None
    assert report["map"] is None
    assert report["session"] is None
    assert connections == []


@pytest.mark.timeout(180)
def test_a_draft_worker_is_untouched(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    connections, peer = _counting_peer(tmp_path / "d.sock")
    with peer:
        (report,) = one_rank.run(
            {
                "model_dir": str(models["moe"]),
                "args": {"weight_cache_mode": "client"},
                "sockets": [str(tmp_path / "d.sock")],
                "is_draft_worker": True,
            }
        )
    assert report["error"] is None
    assert report["session"] is None
    assert connections == []


@pytest.mark.timeout(180)
def test_without_a_daemon_socket_the_engine_keeps_its_initial_layout(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    (report,) = one_rank.run(
        {
            "model_dir": str(models["moe"]),
            "args": {"weight_cache_mode": "client"},
            "sockets": [str(tmp_path / "absent.sock")],
        }
    )
    assert report["error"] is None
    assert report["map"] == INITIAL
    assert report["session"]["finding"] == "no_daemon"
    assert report["session"]["attached"] is False
    assert report["session"]["version"] == 0
    assert report["session"]["digest"] == layout_digest(INITIAL)
    assert warnings_of(report) == []


@pytest.mark.timeout(180)
def test_an_older_daemon_starts_the_engine_on_its_own_layout_with_one_warning(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    with model_less_daemon(tmp_path, record="no-plugin") as older:
        (report,) = one_rank.run(
            {
                "model_dir": str(models["moe"]),
                "args": {"weight_cache_mode": "client"},
                "sockets": [older.socket_path],
            }
        )
    assert report["error"] is None
    assert report["map"] == INITIAL
    assert report["session"]["finding"] == "older_daemon"
    assert report["session"]["attached"] is False
    (warning,) = warnings_of(report)
    assert "keep no expert layout record" in warning
    assert "older_daemon: Unknown request type: expert_layout_attach" in warning
    assert "will not be rebalanced" in warning


def _attach_ok_with(layout: dict[str, Any]) -> Any:
    def handle(conn: socket.socket) -> None:
        from sglang.srt.weight_cache.protocol import recv_msg, send_msg

        recv_msg(conn)
        send_msg(conn, {"status": protocol.OK, "layout": layout})

    return handle


@pytest.mark.timeout(180)
def test_a_daemon_whose_map_does_not_hash_to_its_digest_fails_the_start(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    wrong = {
        "version": 1,
        "digest": layout_digest(INITIAL),  # the digest of another map than the one sent
        "physical_to_logical_map": [list(reversed(row)) for row in INITIAL],
        "dirty": False,
        "dirty_reason": None,
        "pending": None,
        "attached": [],
        "non_following_fetch": False,
    }
    with scripted_peer(tmp_path / "d.sock", _attach_ok_with(wrong)):
        (report,) = one_rank.run(
            {
                "model_dir": str(models["moe"]),
                "args": {"weight_cache_mode": "client"},
                "sockets": [str(tmp_path / "d.sock")],
            }
        )
    assert report["error"].startswith(
        "ExpertLayoutStartupError: a rank could not read its weight cache daemon's expert layout"
    )
    assert "unreadable: the daemon's map hashes to" in report["error"]
    assert report["map"] == INITIAL
    assert report["session"] is None


@pytest.mark.timeout(180)
def test_a_wait_timeout_that_is_not_a_number_fails_the_start_naming_the_variable(
    one_rank: EngineRanks, models: dict[str, Path], tmp_path: Path
) -> None:
    (report,) = one_rank.run(
        {
            "model_dir": str(models["moe"]),
            "args": {"weight_cache_mode": "client"},
            "sockets": [str(tmp_path / "absent.sock")],
            "env": {"SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT": "five minutes"},
        }
    )
    assert "SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT='five minutes' is not a finite number" in (
        report["error"] or ""
    )
