"""The plugin's registration, the load hook on real sglang state, and engine-spawned daemons.

Each check runs in a fresh process (forked from the warm forkserver of ``daemon_control``), so
sglang's process-wide state (``publish``, the hook registry, the environment) never leaks into
the test runner:

- importing ``sglang_integration.plugin`` registers nothing; ``register()`` declares every hook
  of the package on the targets its modules name;
- ``around_load`` around sglang's real EPLB initialisation (``publish`` of real ``ServerArgs``,
  ``WeightCacheDaemon._initialize_eplb_expert_location_metadata``) records exactly sglang's
  global ``ExpertLocationMetadata.physical_to_logical_map`` as version 0, in the ledger at the
  path the template gives; without ``--enable-eplb`` it keeps no record and opens no file;
- a daemon started through the hooked ``spawn_weight_cache_daemon`` (what an engine does in
  ``--weight-cache-mode daemon``) runs ``WeightCacheDaemon.load`` through the hook.

What needs a GPU is replaced, and only that: ``load()``'s CUDA part (the platform check, model
loading, IPC export) is not run in the load-hook check, which calls only its CPU-capable steps;
the device UUID comes from sglang's own CPU platform (``CpuSRTPlatform``, what
``SGLANG_USE_CPU_ENGINE=1`` selects), since the generic platform has none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from sglang_integration.testing.cpu_engine import write_tiny_moe_config
from sglang_integration.testing.daemon_control import process_context, redirect_output

pytestmark = pytest.mark.timeout(180)

NUM_LAYERS, NUM_LOGICAL, NUM_REDUNDANT = 3, 8, 2
NUM_SLOTS = NUM_LOGICAL + NUM_REDUNDANT
# A non-trivial initial layout (--init-expert-location), so the record must be sglang's.
INITIAL = [
    [(slot * 3 + layer) % NUM_LOGICAL for slot in range(NUM_LOGICAL)] + [layer, layer + 1]
    for layer in range(NUM_LAYERS)
]


def run_isolated(target: Any, directory: Path, *args: Any) -> dict[str, Any]:
    """Run ``target(directory, *args)`` in a fresh process; return the JSON it wrote."""
    process = process_context().Process(target=target, args=(str(directory), *args))
    process.start()
    process.join(150)
    log = (directory / "child.log").read_text() if (directory / "child.log").exists() else ""
    assert process.exitcode == 0, f"the isolated check failed (exit {process.exitcode}):\n{log}"
    result: dict[str, Any] = json.loads((directory / "result.json").read_text())
    result["log"] = log
    return result


def _use_sglangs_cpu_platform() -> None:
    # The device UUID needs a GPU (CUDA device properties); sglang's CPU platform gives the
    # machine's architecture instead, as it does under SGLANG_USE_CPU_ENGINE=1.
    import sglang.srt.platforms as platforms
    from sglang.srt.platforms.cpu import CpuSRTPlatform

    platforms._current_platform = CpuSRTPlatform()


def _server_args(directory: Path, enable_eplb: bool) -> Any:
    from sglang.srt.server_args import ServerArgs

    model_dir = write_tiny_moe_config(directory / "model", NUM_LAYERS, NUM_LOGICAL)
    extra: dict[str, Any] = {}
    if enable_eplb:
        extra = {
            "enable_eplb": True,
            "ep_num_redundant_experts": NUM_REDUNDANT,
            "init_expert_location": json.dumps({"physical_to_logical_map": INITIAL}),
        }
    return ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        tp_size=2,
        ep_size=2,
        skip_tokenizer_init=True,
        **extra,
    )


def _cpu_part_of_load(server_args: Any) -> Any:
    """The steps of ``WeightCacheDaemon.load`` a CPU can run: from its ``server_args =
    self.server_args`` to its ``_initialize_eplb_expert_location_metadata`` call."""

    def load(daemon: Any) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.runtime_context import SpawnRanks, publish

        publish(
            server_args,
            role="weight_cache_daemon",
            ranks=SpawnRanks(world_rank=0, gpu_id=0),
        )
        initialize_moe_config()
        model_config = ModelConfig(model_path=server_args.model_path, dtype="auto")
        daemon._initialize_eplb_expert_location_metadata(model_config)

    return load


# --- the checks, each in its own process ------------------------------------------------------


def _registration_check(directory: str) -> None:
    redirect_output(str(Path(directory) / "child.log"))
    from sglang.srt.plugins.hook_registry import HookRegistry

    import sglang_integration.plugin as plugin

    after_import = sorted(HookRegistry._hooks)
    plugin.register()
    registered = {
        target: [(kind.value, getattr(hook, "__qualname__", repr(hook))) for kind, hook, _ in hooks]
        for target, hooks in HookRegistry._hooks.items()
    }
    from importlib.metadata import entry_points

    points = [f"{ep.name}={ep.value}" for ep in entry_points(group="sglang.srt.plugins")]
    (Path(directory) / "result.json").write_text(
        json.dumps({"after_import": after_import, "registered": registered, "entry_points": points})
    )


def test_importing_the_plugin_registers_nothing_and_register_declares_every_hook(
    tmp_path: Path,
) -> None:
    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.engine import ipc_loader as loader_hooks
    from sglang_integration.engine import load_check as loaded_content
    from sglang_integration.engine import rebalance, standby
    from sglang_integration.engine import startup as engine_startup

    result = run_isolated(_registration_check, tmp_path)
    assert result["after_import"] == []
    assert "expert_layout_ledger=sglang_integration.plugin:register" in result["entry_points"]
    assert result["registered"] == {
        engine_startup.HOOK_TARGET: [["around", "around_maybe_init_expert_location_metadata"]],
        loaded_content.HOOK_TARGET: [["around", "around_load_model"]],
        loader_hooks.FETCH_TARGET: [["around", "around_fetch_from_cache"]],
        loader_hooks.SEND_TARGET: [["around", "around_send_msg"]],
        loader_hooks.RECV_TARGET: [["around", "around_recv_msg"]],
        rebalance.HOOK_TARGET: [["around", "rebalance_around"]],
        standby.HOOK_TARGET: [["around", "around_forward"]],
        daemon_hooks.SPAWN_TARGET: [["around", "around_spawn_weight_cache_daemon"]],
    }


def _load_and_spawn_check(directory: str) -> None:
    root = Path(directory)
    redirect_output(str(root / "child.log"))
    _use_sglangs_cpu_platform()
    os.environ["SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"] = (
        f"{directory}/ledger-{{device_uuid}}.sqlite"
    )
    from sglang.srt.plugins.hook_registry import HookRegistry

    from layout_ledger.core.layout import Geometry
    from layout_ledger.history.reader import LedgerReader
    from layout_ledger.store.rows import incarnation
    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.daemon import layout_side
    from sglang_integration.testing.daemon import build_model_less_daemon, model_less_cache_config

    server_args = _server_args(root, enable_eplb=True)

    # An engine in --weight-cache-mode daemon: its plugin hooked spawn_weight_cache_daemon.
    # The spawned daemon is a fresh interpreter; give it sglang's CPU platform by environment.
    daemon_hooks.register_spawn_hook()
    HookRegistry.apply_hooks()
    from sglang.srt.weight_cache import daemon as sglang_daemon

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    spawned = sglang_daemon.spawn_weight_cache_daemon(
        server_args, gpu_id=0, tp_rank=0, pp_rank=0, dist_init_method="tcp://127.0.0.1:1"
    )

    # Meanwhile, the load hook around sglang's real EPLB initialisation.
    daemon = build_model_less_daemon(
        str(root / "d.sock"), model_less_cache_config(Geometry(1, 1, 1))
    )
    daemon.server_args = server_args
    daemon_hooks.around_load(_cpu_part_of_load(server_args), daemon)
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    metadata = get_global_expert_location_metadata()
    layout = layout_side.daemon_layout(daemon)
    assert layout is not None and layout.service.record is not None
    attach = layout.service.handle({"type": "expert_layout_attach", "engine_id": "engine-A"})
    ledger_files = sorted(p.name for p in root.glob("ledger-*.sqlite"))
    layout_side.close_daemon_layout(daemon)
    with LedgerReader(root / ledger_files[0]) as reader:
        state = reader.state()
        with reader.connect() as conn:
            origin = incarnation(conn).origin.to_json()
    spawned.join(120)
    (root / "result.json").write_text(
        json.dumps(
            {
                "sglang_map": metadata.physical_to_logical_map.tolist(),
                "record_version": attach["layout"]["version"],
                "record_map": attach["layout"]["physical_to_logical_map"],
                "ledger_files": ledger_files,
                "ledger_version": state.version,
                "ledger_map": state.physical_to_logical_map,
                "ledger_geometry": [
                    state.geometry.num_layers,
                    state.geometry.num_physical_slots,
                    state.geometry.num_logical_experts,
                ],
                "spawned_exitcode": spawned.exitcode,
                "origin": origin,
                "pid": os.getpid(),
            }
        )
    )


@pytest.fixture(scope="module")
def load_and_spawn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_isolated(_load_and_spawn_check, tmp_path_factory.mktemp("load"))


def test_the_load_hook_records_sglangs_initial_layout_and_spawned_daemons_run_the_hooks(
    load_and_spawn: dict[str, Any],
) -> None:
    result = load_and_spawn
    # The record is sglang's own initial layout (here from --init-expert-location), version 0.
    assert result["sglang_map"] == INITIAL
    assert (result["record_version"], result["record_map"]) == (0, INITIAL)
    uuid = os.uname().machine  # CpuSRTPlatform's device UUID
    assert result["ledger_files"] == [f"ledger-{uuid}.sqlite"]
    assert (result["ledger_version"], result["ledger_map"]) == (0, INITIAL)
    assert result["ledger_geometry"] == [NUM_LAYERS, NUM_SLOTS, NUM_LOGICAL]

    # The spawned daemon ran sglang's entry point with the hooks installed: its load() went
    # through around_load, where sglang's own CUDA check stopped it on this CPU.
    assert result["spawned_exitcode"] == 1
    log = result["log"]
    assert "in run_hooked_weight_cache_daemon" in log
    assert "in around_load" in log
    assert "requires a CUDA-alike" in log


def test_the_load_hook_records_where_the_daemon_runs(load_and_spawn: dict[str, Any]) -> None:
    import socket

    origin = load_and_spawn["origin"]
    socket_path = origin.pop("socket_path")
    assert socket_path.endswith("d.sock")
    assert origin == {
        "host": socket.gethostname(),
        "device_uuid": os.uname().machine,  # CpuSRTPlatform's device UUID
        "gpu_id": 0,
        "tp_rank": 0,
        "pp_rank": 0,
        "ep_rank": 0,  # the daemon's CacheConfig.moe_ep_rank
        "pid": load_and_spawn["pid"],
        "sglang_version": "0.5.23",
        "plugin_version": origin["plugin_version"],
    }
    assert origin["plugin_version"]


def _no_eplb_check(directory: str) -> None:
    root = Path(directory)
    redirect_output(str(root / "child.log"))
    _use_sglangs_cpu_platform()
    os.environ["SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE"] = (
        f"{directory}/ledger-{{device_uuid}}.sqlite"
    )
    from layout_ledger.core.layout import Geometry
    from sglang_integration.daemon import hooks as daemon_hooks
    from sglang_integration.daemon import layout_side
    from sglang_integration.testing.daemon import build_model_less_daemon, model_less_cache_config

    server_args = _server_args(root, enable_eplb=False)
    daemon = build_model_less_daemon(
        str(root / "d.sock"), model_less_cache_config(Geometry(1, 1, 1))
    )
    daemon_hooks.around_load(_cpu_part_of_load(server_args), daemon)
    layout = layout_side.daemon_layout(daemon)
    assert layout is not None
    replies = [
        layout.service.handle({"type": "expert_layout_attach", "engine_id": "engine-A"}),
        layout.service.handle({"type": "expert_layout_query"}),
    ]
    layout_side.close_daemon_layout(daemon)
    (root / "result.json").write_text(
        json.dumps(
            {
                "statuses": [reply["status"] for reply in replies],
                "files": sorted(p.name for p in root.iterdir()),
            }
        )
    )


def test_a_daemon_without_enable_eplb_keeps_no_record_and_opens_no_ledger(tmp_path: Path) -> None:
    result = run_isolated(_no_eplb_check, tmp_path)
    assert result["statuses"] == ["no_record", "no_record"]
    assert result["files"] == ["child.log", "model"]
