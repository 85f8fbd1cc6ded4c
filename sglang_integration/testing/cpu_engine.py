"""CPU engine ranks for tests and the demo: sglang's model, startup, forward pass and EPLB.

One engine of ``world_size`` ranks is ``world_size`` fresh processes forked from a forkserver
that imported sglang once (``engine_process_context``); each runs ``run_engine_rank``, and
``CpuEngine`` is the parent's handle on them. With a checkpoint (``EngineSpec.checkpoint``) a
rank holds sglang's real model, loaded as ``ModelRunner.load_model`` loads it (its routed
experts the daemon's shared tensors, or from disk: ``engine_model``), decodes through
``ModelRunner.forward`` (``greedy``) and rebalances from its own forward passes
(``engine_forward``), with the GPU stand-ins of ``gpu_stand_ins.install_in_engine``. Without
one, the synthetic stand-in's expert files (``shared_experts``) on synthetic loads. In both, a
namespace stands in for the ``ModelRunner`` where sglang's startup method reads it (a real one
allocates accelerator memory), and the expert distribution recorder's counters live on the CPU
(``_counters_on_the_cpu``). Each rank's output goes to a log file; its plugin log lines also
come back in reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from sglang_integration.testing.sglang_env import QUIET_SGLANG_ENV

logger = logging.getLogger(__name__)

# Seconds a blocked rank sleeps per turn while it waits to be killed.
_BLOCK_SLEEP = 3600.0
# What a rank that computes tokens can decode at once: requests, and tokens per request.
MAX_REQUESTS = 64
MAX_CONTEXT = 96


def engine_process_context() -> ForkServerContext:
    """The forkserver context, its server running (``daemon_control.process_context``)."""
    from sglang_integration.testing.daemon_control import process_context

    return process_context()


def one_result_per_rank(
    world_size: int, target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]]
) -> list[Any]:
    """Run ``target(*args_of(rank), pipe)`` in one forkserver process per rank; each sends one
    result on its pipe. Returns them by rank once every process has exited (0, or raises)."""
    context = engine_process_context()
    pipes, processes = [], []
    for rank in range(world_size):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=target, args=(*args_of(rank), send))
        process.start()
        pipes.append(receive)
        processes.append(process)
    results = [pipe.recv() for pipe in pipes]
    for rank, process in enumerate(processes):
        process.join(60)
        if process.exitcode != 0:
            raise RuntimeError(f"rank {rank} exited with {process.exitcode}")
    return results


def release_forkserver() -> None:
    """In a forkserver child: close its copy of the forkserver's keep-alive pipe.

    multiprocessing hands every forkserver child the write end of that pipe (so the child could
    start processes through the same server), and the server exits only once every copy is
    closed. A child that keeps it, a daemon serving forever say, therefore keeps the server
    alive after the process that started them all was SIGKILLed, and with it every child whose
    parent-death signal waits for the server. Closed here, the server exits with that process
    and ``kill_itself_when_parent_died`` takes the children down. Private to multiprocessing
    (``forkserver._forkserver._forkserver_alive_fd``, CPython 3.10-3.12); a missing attribute is
    ignored. The child can no longer start processes itself.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and isinstance(alive_fd, int):
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_tiny_moe_config(directory: Path, num_layers: int, num_experts: int) -> Path:
    """A Qwen3-MoE ``config.json`` (no weights): enough for ServerArgs, ModelConfig and EPLB; the
    config of the toolkit's Qwen3-MoE checkpoints (``checkpoint.model_config``)."""
    from sglang_integration.testing.checkpoint import CheckpointSpec, model_config

    directory.mkdir(parents=True, exist_ok=True)
    config = model_config(
        CheckpointSpec("qwen3_moe", num_layers=num_layers, num_experts=num_experts)
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def start_cpu_engine_rank(
    rank: int,
    *,
    world_size: int,
    port: int,
    model_dir: str,
    num_redundant: int,
    **server_args: Any,
) -> Any:
    """In a fresh process: publish real ServerArgs for this rank, build sglang's world group on
    gloo, and install the initial (trivial) expert location metadata. Returns the ModelConfig."""
    os.environ.update(QUIET_SGLANG_ENV)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        set_global_expert_location_metadata,
    )

    args = _publish_and_join(
        rank,
        world_size=world_size,
        port=port,
        model_dir=model_dir,
        num_redundant=num_redundant,
        **server_args,
    )
    model_config = ModelConfig.from_server_args(args)
    metadata = ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=rank)
    set_global_expert_location_metadata(metadata)
    return model_config


def _publish_and_join(
    rank: int, *, world_size: int, port: int, model_dir: str, num_redundant: int, **extra: Any
) -> Any:
    """Real ``ServerArgs`` published for this rank, then sglang's world group on gloo."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=world_size,
        ep_size=world_size,
        enable_eplb=True,
        ep_num_redundant_experts=num_redundant,
        skip_tokenizer_init=True,
        **extra,
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    init_distributed_environment(
        backend="gloo",
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
    )
    return args


class ModelLoadError(RuntimeError):
    """The rank's model load raised (``ModelRunner.load_model`` would have): the engine does not
    start; the cause is what it raised (a refused ``fetch_state``, a config mismatch...)."""


class NoDiskReload:
    """The engine's weight updater; only called for experts lost to elastic EP (not here)."""

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no expert may be missing after a move between live ranks")


# Seconds of one forward pass between two steps of a rebalance: a sleep, which frees the GIL
# as an engine's wait for the device does, so the rank's rebalance agent runs beside it.
FORWARD_PASS_SECONDS = 0.001


def run_rebalances(manager: Any, count: int) -> None:
    """Drive ``count`` rebalances the way ``EPLBManager._entrypoint`` does (yield from), one
    forward pass (``FORWARD_PASS_SECONDS``) per step."""
    for _ in range(count):
        for _ in manager.rebalance():
            time.sleep(FORWARD_PASS_SECONDS)


def routed_map() -> list[list[int]]:
    """The map this rank routes with (sglang's global expert location metadata)."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    metadata = get_global_expert_location_metadata()
    if metadata is None:
        raise RuntimeError("no expert location metadata is installed")
    routed: list[list[int]] = metadata.physical_to_logical_map_cpu.tolist()
    return routed


# ---------------------------------------------------------------- the rank process ----------


@dataclass(frozen=True)
class EngineSpec:
    """What every rank of one engine needs; ``sockets[r]`` is rank r's daemon.

    With ``checkpoint`` (model-backed daemons: ``model_dir`` is that checkpoint), each rank holds
    sglang's real model with its daemon's real routed-expert tensors mapped in
    (``engine_model``) and, where the checkpoint's weights run on a CPU (BF16, float32: not FP8
    blocks, whose matmuls need triton), computes tokens (``greedy``) and feeds EPLB from its own
    routing (``engine_forward``); with ``from_disk`` too, the rank loads every weight from the
    checkpoint itself (the weight cache off: ``sockets`` is empty and ``ranks`` gives the world
    size). Without ``checkpoint``, the synthetic stand-in's files in ``expert_dir``, with
    synthetic loads (nothing to route).
    """

    name: str
    model_dir: str
    expert_dir: str
    sockets: tuple[str, ...]
    port: int
    num_redundant: int
    layers_per_chunk: int
    plugin: bool = True
    load_seed: int = 11
    log_dir: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # set in each rank's environment before it starts
    checkpoint: str | None = None
    # Stop each rank right after the converging move (``converge.move_after_load``'s, before its
    # commits): it sends ``stopped`` instead of ``started`` and waits to be killed.
    stop_in_converge: bool = False
    from_disk: bool = False  # with ``checkpoint``: every weight from the checkpoint, no daemon
    ranks: int = 0  # the world size where there are no sockets (``from_disk``)
    dtype: str | None = None  # sglang's --dtype (None: the checkpoint's)
    init_expert_location: str | None = None  # sglang's --init-expert-location
    # More ServerArgs fields every rank publishes, as (name, value) pairs: EPLB's interval, say
    # (``eplb_rebalance_num_iterations``, ``expert_distribution_recorder_buffer_size``).
    server_args: tuple[tuple[str, Any], ...] = ()
    # Functions each rank calls before it starts, as "module:function" (a benchmark's variant
    # of the plugin, say: ``testing.polling_agent:install``).
    rank_setup: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.sockets) or self.ranks

    @property
    def computes(self) -> bool:
        """Whether the ranks compute tokens (the class docstring)."""
        if self.checkpoint is None:
            return False
        from sglang_integration.testing.checkpoint import forward_runs_on_cpu

        return forward_runs_on_cpu(self.checkpoint)

    def log_path(self, rank: int) -> str | None:
        if self.log_dir is None:
            return None
        return str(Path(self.log_dir) / f"engine-{self.name}.rank{rank}.log")


class StoppableUpdater:
    """sglang's ``ExpertLocationUpdater``, able to stop partway through one chosen move.

    ``update`` delegates unchanged until ``stop_after_first_layer`` is set; the next ``update``
    then moves only the first layer of its chunk (sglang's own updater, called for that one
    layer on every rank, so the collectives match), calls the callback and never returns: the
    process waits there to be killed with the chunk's other layers not moved.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stop_after_first_layer: Callable[[list[int]], None] | None = None

    def update(
        self,
        routed_experts_weights_of_layer: Any,
        new_expert_location_metadata: Any,
        *,
        update_layer_ids: list[int],
        nnodes: int,
        rank: int,
        use_flat_topology: bool = False,
    ) -> Any:
        stop = self.stop_after_first_layer
        if stop is None:
            return self.inner.update(
                routed_experts_weights_of_layer,
                new_expert_location_metadata,
                update_layer_ids=update_layer_ids,
                nnodes=nnodes,
                rank=rank,
                use_flat_topology=use_flat_topology,
            )
        self.inner.update(
            routed_experts_weights_of_layer,
            new_expert_location_metadata,
            update_layer_ids=list(update_layer_ids[:1]),
            nnodes=nnodes,
            rank=rank,
            use_flat_topology=use_flat_topology,
        )
        stop(list(update_layer_ids))
        block_until_killed()


def block_until_killed() -> None:
    """Wait forever (the parent SIGKILLs this process)."""
    while True:
        time.sleep(_BLOCK_SLEEP)


class LogCapture(logging.Handler):
    """The plugin's log lines of this rank, handed back with the next report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))

    def take(self) -> list[tuple[str, str]]:
        lines, self.lines = self.lines, []
        return lines


def _counters_on_the_cpu() -> None:
    """The GPU stand-in below the runner: with --enable-eplb, the original method builds sglang's
    expert distribution recorder, whose gatherers allocate their counters on the accelerator
    that ``sglang.srt.utils.get_device`` names (it raises on a machine without one). Here the CPU
    is that accelerator. The recorder is then replaced by ``SyntheticLoadRecorder``."""
    from sglang.srt.eplb import expert_distribution

    expert_distribution.get_device = lambda device_id=None: "cpu"


class _EngineRank:
    """One engine rank: startup, then the commands of ``run_engine_rank``."""

    def __init__(self, spec: EngineSpec, rank: int, capture: LogCapture) -> None:
        self.spec = spec
        self.rank = rank
        self.capture = capture
        self.rebalances_run = 0
        self.startup_seconds = 0.0
        self.manager: Any = None
        self.experts: Any = None
        self.model: Any = None
        self.updater: StoppableUpdater | None = None
        self.decoder: Any = None  # greedy.GreedyDecoder when the ranks compute tokens
        self.load_step = 0  # the skewed prompts' step of the next rebalance
        self.rebalance_passes: list[int] = []  # forward passes each rebalance took

    def start(self) -> None:
        started = time.monotonic()
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.eplb.eplb_manager import EPLBManager
        from sglang.srt.eplb.expert_distribution import set_global_expert_distribution_recorder
        from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.plugins.hook_registry import HookRegistry

        spec, rank = self.spec, self.rank
        _counters_on_the_cpu()
        holds_model = spec.checkpoint is not None
        if holds_model:
            _prepare_model_process()
        weight_cache: dict[str, Any] = {}
        if not spec.from_disk:
            weight_cache = {
                "weight_cache_mode": "client",
                "weight_cache_socket": spec.sockets[rank],
            }
        model_args: dict[str, Any] = {}
        if holds_model:
            model_args = {"dtype": spec.dtype or "auto", "attention_backend": "torch_native"}
            if spec.init_expert_location is not None:
                model_args["init_expert_location"] = spec.init_expert_location
        args = _publish_and_join(
            rank,
            world_size=spec.world_size,
            port=spec.port,
            model_dir=spec.model_dir,
            num_redundant=spec.num_redundant,
            eplb_rebalance_layers_per_chunk=spec.layers_per_chunk,
            **weight_cache,
            **model_args,
            **dict(spec.server_args),
        )
        model_config = ModelConfig.from_server_args(args)
        if holds_model:
            from sglang_integration.testing.engine_forward import prepare_model_parallel

            prepare_model_parallel(args, model_config)
        if spec.plugin:
            from sglang_integration import plugin

            plugin.register()  # what sglang's load_plugins() calls in an engine process
            HookRegistry.apply_hooks()
        runner = _RunnerAttributes(model_config)
        # sglang's real method; with the plugin, the startup hook runs around it. It installs
        # sglang's expert distribution recorder too.
        ModelRunner.maybe_init_expert_location_metadata(runner)
        if holds_model:
            experts, model, (num_layers, num_logical) = _held_model(spec, args, runner)
        else:
            experts, model, (num_layers, num_logical) = _mapped_experts(spec, rank)
            if spec.plugin:
                from sglang_integration.engine.load_check import around_load_model
                from sglang_integration.engine.weight_source import (
                    WeightSource,
                    record_weight_source,
                )

                # What the IPC loader hook records once the daemon served fetch_state; that
                # fetch maps CUDA IPC handles, so here the synthetic experts are mapped from
                # shared memory instead, and the plugin's hook on ModelRunner.load_model runs
                # around that mapping.
                record_weight_source(WeightSource.DAEMON)
                around_load_model(lambda loaded: setattr(loaded, "model", model), runner)
        if not spec.computes:
            from sglang_integration.testing.synthetic_load import SyntheticLoadRecorder

            set_global_expert_distribution_recorder(
                SyntheticLoadRecorder(num_layers, num_logical, seed=spec.load_seed)
            )
        updater = StoppableUpdater(ExpertLocationUpdater())
        self.experts, self.model, self.updater = experts, model, updater
        self.manager = EPLBManager(
            model_config=model_config,
            get_model=lambda: model,
            get_expert_location_updater=lambda: updater,
            get_expert_backup_client=lambda: None,
            get_weight_updater=NoDiskReload,
        )
        if spec.computes:
            from sglang_integration.testing.greedy import GreedyDecoder

            self.decoder = GreedyDecoder(
                model,
                model_config,
                spec.world_size,
                self.manager,
                max_requests=MAX_REQUESTS,
                max_context=MAX_CONTEXT,
            )
        self.startup_seconds = time.monotonic() - started

    # ------------------------------------------------------------ commands

    def report(self) -> dict[str, Any]:
        """What this rank knows now: its metadata's map and the bytes it maps, its session with
        the daemon and its rebalance state (with the plugin), and its daemon's answer."""
        engine_map = routed_map()
        experts = self.experts
        report: dict[str, Any] = {
            "rank": self.rank,
            "engine": self.spec.name,
            "plugin": self.spec.plugin,
            "map": engine_map,
            "matching": experts.count_matching_slots(engine_map),
            "local_slots": experts.slot_count,
            "rebalances_run": self.rebalances_run,
            "startup_seconds": self.startup_seconds,
            "session": None,
            "state": None,
            "daemon": None,
        }
        if self.spec.plugin:
            from sglang_integration.engine import client
            from sglang_integration.engine.rebalance import rebalance_state
            from sglang_integration.engine.startup import current_session

            session = current_session()
            if session is not None:
                report["session"] = {
                    "engine_id": session.engine_id,
                    "finding": session.finding.value,
                    "attached": session.attached,
                    "version": session.version,
                    "digest": session.digest,
                }
            state = rebalance_state(self.manager)
            report["state"] = {
                "mode": None if state.mode is None else state.mode.value,
                "version": state.version,
                "rebalances_done": state.rebalances_done,
                "rebalances_paused": state.rebalances_paused,
                "chunks_committed": state.chunks_committed,
                "stopped_reason": state.stopped_reason,
            }
            layout = (
                None if self.spec.from_disk else client.query(self.spec.sockets[self.rank]).layout
            )
            if layout is not None:
                report["daemon"] = {
                    "version": layout.version,
                    "digest": layout.digest,
                    "map": [list(row) for row in layout.physical_to_logical_map],
                    "attached": list(layout.attached),
                    "leases": list(layout.leases),
                    "pending": None
                    if layout.pending is None
                    else {
                        "engine_id": layout.pending.engine_id,
                        "layers": list(layout.pending.layers),
                        "base_version": layout.pending.base_version,
                    },
                    "dirty": layout.dirty,
                }
        report["logs"] = self.capture.take()
        return report

    def rebalance(self, count: int, in_forward: bool = False) -> dict[str, Any]:
        """``count`` rebalances; ``in_forward``: each inside a forward pass through the plugin's
        hook on ``ModelRunner.forward``, as sglang runs them (``on_forward_pass_end``), so a
        standby takes its lease first. A rank that computes tokens always rebalances inside its
        real forward passes (``_one_rebalance``)."""
        for _ in range(count):
            if in_forward and self.decoder is None:
                self.forward(lambda: run_rebalances(self.manager, 1))
            else:
                self._one_rebalance()
            self.rebalances_run += 1
        report = self.report()
        report["rebalance_passes"] = self.rebalance_passes
        return report

    def _one_rebalance(self) -> None:
        """One rebalance: with a model that computes, from ``on_forward_pass_end`` of real
        forward passes whose routing sglang's recorder counted, the first over this step's
        skewed prompts (``engine_forward.rebalance_in_passes``); else between sleeps standing
        for passes, on synthetic loads (``run_rebalances``)."""
        if self.decoder is None:
            run_rebalances(self.manager, 1)
            return
        from sglang_integration.testing.engine_forward import rebalance_in_passes
        from sglang_integration.testing.prompts import load_prompts

        step = f"{self.spec.name}:{self.load_step}"
        prompts = load_prompts(self.spec.load_seed, step, self.decoder.vocab_size)
        self.load_step += 1
        self.rebalance_passes.append(
            rebalance_in_passes(self.manager, self.decoder.prefill, prompts)
        )

    def generate(
        self, prompts: list[list[int]] | None, new_tokens: int, keep_logits: bool
    ) -> dict[str, Any]:
        """One greedy pass over ``prompts`` (default ``prompts.DEFAULT_PROMPTS``): the tokens,
        the version and digest of the map it routed with, and with ``keep_logits`` the logits."""
        from sglang_integration.testing.prompts import DEFAULT_PROMPTS

        if self.decoder is None:
            raise RuntimeError(f"engine {self.spec.name} holds no model that computes tokens")
        from layout_ledger.core.layout import layout_digest

        chosen = [list(p) for p in DEFAULT_PROMPTS] if prompts is None else prompts
        decoded = self.decoder.generate(
            chosen, new_tokens, keep_logits, routed=lambda: layout_digest(routed_map())
        )
        version, digest = self._routed_version()
        if digest != decoded.routed:
            raise RuntimeError("the rank's layout changed after its greedy pass")
        report = self.report()
        report.update(
            tokens=decoded.tokens,
            logits=decoded.logits,
            step_seconds=decoded.step_seconds,
            forward_seconds=decoded.step_seconds[0],  # the first step's (a standby's lease)
            routed_version=version,
            routed_digest=digest,
        )
        return report

    def decode_segments(self, segments: list[tuple[list[list[int]], int]]) -> dict[str, Any]:
        """Decode the segments one after another with EPLB's own pass generator running
        (``decode_steps``): the report, the tokens, and each pass's seconds and the chunk moved
        in it."""
        from sglang_integration.testing.decode_steps import decode_segments

        if self.decoder is None or self.updater is None:
            raise RuntimeError(f"engine {self.spec.name} holds no model that computes tokens")
        decoded = decode_segments(self.decoder, self.updater, segments)
        return {**self.report(), **decoded}

    def _routed_version(self) -> tuple[int | None, str]:
        """The digest of the map this rank routes with, and the version its daemon gives that
        map (None: weights from disk, or the daemon holds another map)."""
        from layout_ledger.core.layout import layout_digest
        from sglang_integration.engine import client

        digest = layout_digest(routed_map())
        if self.spec.from_disk:
            return None, digest
        layout = client.query(self.spec.sockets[self.rank]).layout
        if layout is None or layout.digest != digest:
            return None, digest
        return int(layout.version), digest

    def forward(self, inside: Callable[[], Any] | None = None) -> dict[str, Any]:
        """One forward pass through the plugin's hook on ``ModelRunner.forward`` (a standby
        takes its lease there): with a model that computes, sglang's ``ModelRunner.forward``
        over the default prompts; else a pass that meets the other ranks in a barrier, as the
        model's collectives would, and runs ``inside`` (a rebalance) at its end."""
        import types

        from sglang.srt.runtime_context import get_parallel

        from sglang_integration.engine import standby

        if self.decoder is not None and inside is None:
            from sglang_integration.testing.prompts import DEFAULT_PROMPTS

            started = time.monotonic()
            self.decoder.prefill(DEFAULT_PROMPTS)
            report = self.report()
            report["forward_seconds"] = time.monotonic() - started
            return report

        def original(runner: Any) -> None:
            get_parallel().world_group.barrier()
            if inside is not None:
                inside()

        started = time.monotonic()
        runner = types.SimpleNamespace(is_draft_worker=False, eplb_manager=self.manager)
        standby.around_forward(original, runner)
        report = self.report()
        report["forward_seconds"] = time.monotonic() - started
        return report

    def stop_between_chunks(self, count: int, channel: Connection) -> None:
        """``count`` whole rebalances, then one more that stops where its first chunk is committed
        and its second not begun (the rank's agent, about to send the second begin); tell the
        parent, wait."""
        from sglang_integration.engine import client

        self.rebalance(count)
        map_before = routed_map()
        begin = client.LayoutConnection.begin
        begins = 0

        def stop_at_second_begin(connection: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal begins
            begins += 1
            if begins == 2:
                report = self.report()
                report["map_before"] = map_before
                channel.send({"event": "stopped", "where": "between chunks", **report})
                block_until_killed()
            return begin(connection, *args, **kwargs)

        client.LayoutConnection.begin = stop_at_second_begin  # type: ignore[method-assign,assignment]
        self._one_rebalance()
        raise RuntimeError("the rebalance ended before its second chunk began")

    def stop_in_move(self, count: int, channel: Connection) -> None:
        """``count`` whole rebalances, then one more that stops inside the move of its first chunk,
        after begin and after the first of its layers moved; tell the parent, wait."""
        self.rebalance(count)

        def stopped(layers: list[int]) -> None:
            report = self.report()
            report["moving_layers"] = layers
            channel.send({"event": "stopped", "where": "in the move", **report})

        if self.updater is None:
            raise RuntimeError("the engine has no updater")
        self.updater.stop_after_first_layer = stopped
        self._one_rebalance()
        raise RuntimeError("the rebalance ended without reaching the move")

    def stop_at_commit(self, count: int, skip_rank: int, channel: Connection) -> None:
        """``count`` whole rebalances, then one more whose first chunk's commit reaches every
        daemon but rank ``skip_rank``'s: that rank stops before it sends its commit, the others
        right after theirs; each tells the parent and waits (a mover killed between two ranks'
        commits)."""
        from sglang_integration.engine import client

        self.rebalance(count)
        commit = client.LayoutConnection.commit

        def stop_at_first_commit(connection: Any, *args: Any, **kwargs: Any) -> Any:
            reply = None if self.rank == skip_rank else commit(connection, *args, **kwargs)
            report = self.report()
            report["committed"] = None if reply is None else bool(reply.ok)
            channel.send({"event": "stopped", "where": "at the commit", **report})
            block_until_killed()

        client.LayoutConnection.commit = stop_at_first_commit  # type: ignore[method-assign,assignment]
        self._one_rebalance()
        raise RuntimeError("the rebalance ended without reaching its first commit")

    def wait_alone(self, timeout: float) -> dict[str, Any]:
        """Poll this rank's daemon until this engine is the only one attached."""
        from sglang_integration.engine import client
        from sglang_integration.engine.startup import current_session

        session = current_session()
        if session is None:
            raise RuntimeError("this engine did not attach to its daemon")
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            polls += 1
            layout = client.query(self.spec.sockets[self.rank]).layout
            if layout is not None and list(layout.attached) == [session.engine_id]:
                return {"rank": self.rank, "polls": polls}
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"still not alone on {self.spec.sockets[self.rank]} after {timeout} s: "
                    f"attached {None if layout is None else list(layout.attached)}"
                )
            time.sleep(0.05)

    def close(self) -> None:
        if self.spec.plugin:
            from sglang_integration.engine.startup import close_session

            close_session()


def _prepare_model_process() -> None:
    """A rank that holds sglang's model: the GPU stand-ins of a forward pass
    (``gpu_stand_ins.install_in_engine``), sglang's compiled helpers run eagerly, one torch thread
    per rank (the engine's ranks share the machine's cores, as a daemon's do)."""
    import torch

    from sglang_integration.testing.engine_model import run_eagerly
    from sglang_integration.testing.gpu_stand_ins import install_in_engine

    install_in_engine()
    run_eagerly()
    torch.set_num_threads(1)


def _held_model(
    spec: EngineSpec, server_args: Any, runner: _RunnerAttributes
) -> tuple[Any, Any, tuple[int, int]]:
    """sglang's model loaded in this rank as ``ModelRunner.load_model`` loads it
    (``engine_model.load_engine_model``: the IPC loader in client mode, the disk otherwise),
    with the plugin's hook on ``ModelRunner.load_model`` around it; the checkpoint judge over its
    routed experts, and the (layers, logical experts) of the loads."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_integration.testing.checkpoint import read_config
    from sglang_integration.testing.checkpoint_experts import ModelExperts, num_routed_experts
    from sglang_integration.testing.engine_model import (
        EngineModel,
        OwnRoutedWeights,
        load_engine_model,
    )

    if spec.checkpoint is None:
        raise ValueError("an engine rank holds a model only with a checkpoint")
    loaded: list[EngineModel] = []

    def load_model(target: _RunnerAttributes) -> None:
        try:
            built = load_engine_model(server_args, target.model_config)
        except Exception as exc:
            raise ModelLoadError(str(exc)) from exc
        target.model = built.model
        loaded.append(built)

    if spec.plugin:
        from sglang_integration.engine.load_check import around_load_model

        around_load_model(load_model, runner)
    else:
        load_model(runner)
    built = loaded[0]
    weights = built.mapped
    if weights is None:
        weights = OwnRoutedWeights(built.model, int(get_parallel().moe_ep_rank))
    experts = ModelExperts(weights, spec.checkpoint)
    config = read_config(spec.checkpoint)
    return experts, built.model, (int(config["num_hidden_layers"]), num_routed_experts(config))


def _mapped_experts(spec: EngineSpec, rank: int) -> tuple[Any, Any, tuple[int, int]]:
    """The synthetic stand-in's experts of this rank (what its report judges), its model (what
    sglang's EPLB reads) and the (layers, logical experts) of the loads: the files in
    ``spec.expert_dir`` (``shared_experts``)."""
    from sglang_integration.testing.shared_experts import (
        SharedExpertsModel,
        attach_shared_experts,
        read_shape,
    )

    shape = read_shape(spec.expert_dir, rank)
    synthetic = attach_shared_experts(spec.expert_dir, rank)
    return synthetic, SharedExpertsModel(synthetic), (shape.num_layers, shape.num_logical_experts)


@dataclass
class _RunnerAttributes:
    """What ``ModelRunner.maybe_init_expert_location_metadata`` and its hook read of the runner
    (a real ``ModelRunner`` allocates accelerator memory when built)."""

    model_config: Any
    is_draft_worker: bool = False
    gpu_id: int = 0
    model: Any = None  # set by the load (``load_model``'s stand-in)


def _log_to(path: str | None) -> None:
    if path is not None:
        from sglang_integration.testing.daemon_control import redirect_output

        redirect_output(path)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
        force=True,
    )


def _stop_after_converging_move(spec: EngineSpec, rank: int, channel: Connection) -> None:
    """Make the converging move (``converge._move``) move, then tell the parent and wait to be
    killed: the moving daemons' begins are recorded, their commits never sent."""
    from sglang_integration.engine import converge

    move = converge._move

    def move_then_stop(model: Any, pending: Any) -> None:
        move(model, pending)
        channel.send({"event": "stopped", "where": "after the converging move", "rank": rank})
        block_until_killed()

    converge._move = move_then_stop  # type: ignore[assignment]


def _run_rank_setup(names: Sequence[str]) -> None:
    """Call each ``"module:function"`` of ``EngineSpec.rank_setup`` in this rank."""
    import importlib

    for name in names:
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function)()


def run_engine_rank(spec: EngineSpec, rank: int, channel: Connection) -> None:
    """Process target: one engine rank. Sends ``started`` (with a report) or ``startup_failed``
    (the startup hook refused: ``error`` is its reason), then answers commands until ``exit``.

    The rank

    1. publishes real ``ServerArgs`` for the checkpoint (or a tiny Qwen3-MoE ``config.json``
       without weights: the synthetic stand-in) with ``--enable-eplb`` and, on daemons,
       ``--weight-cache-mode client`` and its daemon's socket as ``--weight-cache-socket``, and
       joins sglang's world group on torch.distributed gloo (with a checkpoint: its model-parallel
       groups too, ``engine_forward.prepare_model_parallel``);
    2. with the plugin, calls the plugin's real entry point ``sglang_integration.plugin.register()``
       and sglang's ``HookRegistry.apply_hooks()``, as ``load_plugins()`` does in an engine process;
       without it (the plugin disabled), applies no hook at all;
    3. runs sglang's real ``ModelRunner.maybe_init_expert_location_metadata`` (hooked by the plugin:
       attach to its daemon, agree over the world group, repair dirty daemons, adopt the daemon's
       layout or fail) on a namespace holding the attributes the method and the hooks read, because
       building a real ``ModelRunner`` allocates accelerator memory;
    4. loads its weights, the plugin's ``ModelRunner.load_model`` hook around the load (each slot
       must hold the expert the map names): with a checkpoint, sglang's model through sglang's
       own loaders (``engine_model.load_engine_model``: the ``IpcModelLoader`` with the plugin's
       ``fetch_state`` hooks, its routed experts mapped from the daemon's shared file, or every
       weight from disk); on the synthetic stand-in, its expert files mapped read-write, recording
       that the weights came from the daemon as the IPC loader's hook would. An in-place move by
       one engine is seen by every engine on the daemon;
    5. builds sglang's real ``EPLBManager`` with sglang's real ``ExpertLocationUpdater`` (behind
       ``StoppableUpdater``), fed by sglang's expert distribution recorder where the rank computes
       tokens (``greedy.GreedyDecoder`` runs its passes), else by ``SyntheticLoadRecorder``
       (nothing routes tokens: the synthetic stand-in, FP8 blocks);
    6. obeys the parent's commands on a pipe (``CpuEngine`` is the parent's handle): rebalance,
       decode (``generate``), wait until alone on its daemon, stop at a chosen point of a
       rebalance so that the parent can SIGKILL it there, exit.

    Commands are ``(verb, fields)``: ``rebalance`` (count), ``generate`` (prompts, new tokens,
    whether to keep the logits), ``forward``, ``decode_segments`` (segments:
    continuous decoding, EPLB rebalancing on its own, each pass timed), ``wait_alone`` (timeout),
    ``stop_between_chunks`` / ``stop_in_move`` / ``stop_at_commit`` (count of whole rebalances
    first; the rank then sends ``stopped`` and waits to be killed), ``exit``. A failed command
    is answered with ``{"event": "error", "error": traceback}``.
    """
    _log_to(spec.log_path(rank))
    os.environ.update(QUIET_SGLANG_ENV)
    os.environ.update(dict(spec.env))
    from sglang.srt.utils import kill_itself_when_parent_died

    # Die with the forkserver, which exits with the process that started it: a rank stopped
    # for a SIGKILL never outlives a parent that was itself killed before sending it.
    release_forkserver()
    kill_itself_when_parent_died()
    capture = LogCapture()
    logging.getLogger("sglang_integration").addHandler(capture)
    engine = _EngineRank(spec, rank, capture)
    if spec.stop_in_converge:
        _stop_after_converging_move(spec, rank, channel)
    _run_rank_setup(spec.rank_setup)
    try:
        _serve_engine_rank(engine, spec, rank, channel, capture)
    finally:
        if spec.checkpoint is not None:
            from sglang_integration.testing.engine_forward import release_model_parallel

            release_model_parallel()


def _serve_engine_rank(
    engine: _EngineRank, spec: EngineSpec, rank: int, channel: Connection, capture: LogCapture
) -> None:
    """``run_engine_rank`` from the start on: start, report, then obey commands until ``exit``."""
    try:
        engine.start()
    except Exception as exc:
        from layout_ledger.core.startup_verdict import ExpertLayoutStartupError

        logger.exception("engine %s rank %d did not start", spec.name, rank)
        if isinstance(exc, ExpertLayoutStartupError | ModelLoadError):
            cause = exc.__cause__ if isinstance(exc, ModelLoadError) else exc
            channel.send(
                {
                    "event": "startup_failed",
                    "rank": rank,
                    "error_type": type(cause).__name__,
                    "error": str(cause),
                    "logs": capture.take(),
                }
            )
            return
        channel.send({"event": "error", "rank": rank, "error": traceback.format_exc()})
        raise
    channel.send({"event": "started", **engine.report()})
    while True:
        try:
            verb, fields = channel.recv()
        except EOFError:
            return  # the parent is gone
        if verb == "exit":
            engine.close()
            channel.send({"event": "exited", "rank": rank})
            return
        try:
            if verb == "rebalance":
                reply: dict[str, Any] = engine.rebalance(
                    int(fields["count"]), bool(fields.get("in_forward", False))
                )
            elif verb == "forward":
                reply = engine.forward()
            elif verb == "generate":
                reply = engine.generate(
                    fields.get("prompts"),
                    int(fields["new_tokens"]),
                    bool(fields.get("keep_logits", False)),
                )
            elif verb == "decode_segments":
                reply = engine.decode_segments(fields["segments"])
            elif verb == "wait_alone":
                reply = engine.wait_alone(float(fields["timeout"]))
            elif verb == "stop_between_chunks":
                engine.stop_between_chunks(int(fields["count"]), channel)
                continue
            elif verb == "stop_in_move":
                engine.stop_in_move(int(fields["count"]), channel)
                continue
            elif verb == "stop_at_commit":
                engine.stop_at_commit(int(fields["count"]), int(fields["skip_rank"]), channel)
                continue
            else:
                raise ValueError(f"unknown engine command {verb!r}")
        except Exception:
            logger.exception("engine %s rank %d: command %s failed", spec.name, rank, verb)
            channel.send({"event": "error", "rank": rank, "error": traceback.format_exc()})
            continue
        channel.send({"event": "ok", **reply})


# ---------------------------------------------------------------- the parent's handle -------


class EngineRankError(RuntimeError):
    """An engine rank failed, died or did not answer in time (the message has its log's tail)."""


@dataclass
class CpuEngine:
    """The parent's handle on one engine's rank processes (see ``run_engine_rank``)."""

    spec: EngineSpec
    processes: list[BaseProcess]
    channels: list[Connection]
    started: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    stopped: list[dict[str, Any]] = field(default_factory=list)  # ``stop_in_converge``

    @classmethod
    def launch(
        cls, spec: EngineSpec, context: ForkServerContext | None = None, timeout: float = 120.0
    ) -> CpuEngine:
        """Start every rank and wait for each to start or to refuse (``failed`` then holds the
        reasons; the processes have exited)."""
        context = context or engine_process_context()
        processes: list[BaseProcess] = []
        channels: list[Connection] = []
        for rank in range(spec.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_engine_rank, args=(spec, rank, theirs), name=f"engine-{spec.name}-{rank}"
            )
            process.start()
            theirs.close()
            processes.append(process)
            channels.append(ours)
        engine = cls(spec, processes, channels)
        try:
            replies = engine._receive_all(timeout, "start")
        except BaseException:
            engine.kill()
            raise
        engine.started = [r for r in replies if r["event"] == "started"]
        engine.failed = [r for r in replies if r["event"] == "startup_failed"]
        engine.stopped = [r for r in replies if r["event"] == "stopped"]
        if engine.failed:
            engine.join(30)
        return engine

    @property
    def engine_id(self) -> str | None:
        """The id the engine's ranks share (None without the plugin or when it did not start)."""
        if not self.started or self.started[0]["session"] is None:
            return None
        engine_id: str = self.started[0]["session"]["engine_id"]
        return engine_id

    def ask(self, verb: str, wait: float = 120.0, **fields: Any) -> list[dict[str, Any]]:
        """Send one command to every rank; each rank's reply, by rank, within ``wait`` s."""
        for channel in self.channels:
            channel.send((verb, fields))
        return self._receive_all(wait, verb)

    def forward(self, timeout: float = 180.0) -> list[dict[str, Any]]:
        """One forward pass on every rank (a standby takes its lease first)."""
        return self.ask("forward", timeout)

    def generate(
        self,
        prompts: list[list[int]] | None = None,
        new_tokens: int = 32,
        keep_logits: bool = False,
        timeout: float = 300.0,
    ) -> list[dict[str, Any]]:
        """One greedy pass on every rank (``_EngineRank.generate``); each rank's reply."""
        return self.ask(
            "generate", timeout, prompts=prompts, new_tokens=new_tokens, keep_logits=keep_logits
        )

    def rebalance(
        self, count: int, timeout: float = 180.0, in_forward: bool = False
    ) -> list[dict[str, Any]]:
        return self.ask("rebalance", timeout, count=count, in_forward=in_forward)

    def decode_segments(
        self, segments: list[tuple[list[list[int]], int]], timeout: float = 600.0
    ) -> list[dict[str, Any]]:
        """Decode ``(prompts, new_tokens)`` segments on every rank, EPLB rebalancing from its own
        pass generator (``_EngineRank.decode_segments``); each rank's reply."""
        return self.ask("decode_segments", timeout, segments=segments)

    def wait_alone(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        return self.ask("wait_alone", timeout + 10.0, timeout=timeout)

    def stop_between_chunks(self, count: int, timeout: float = 180.0) -> list[dict[str, Any]]:
        """Run ``count`` rebalances, then stop every rank between the next one's two chunks."""
        return self._stop("stop_between_chunks", count, timeout)

    def stop_in_move(self, count: int, timeout: float = 180.0) -> list[dict[str, Any]]:
        """Run ``count`` rebalances, then stop every rank inside the next one's first move."""
        return self._stop("stop_in_move", count, timeout)

    def stop_at_commit(
        self, count: int, skip_rank: int, timeout: float = 180.0
    ) -> list[dict[str, Any]]:
        """Run ``count`` rebalances, then stop every rank at the next one's first commit, which
        every rank but ``skip_rank`` sends (so only their daemons record it)."""
        return self._stop("stop_at_commit", count, timeout, skip_rank=skip_rank)

    def _stop(self, verb: str, count: int, timeout: float, **fields: Any) -> list[dict[str, Any]]:
        replies = self.ask(verb, timeout, count=count, **fields)
        for reply in replies:
            if reply["event"] != "stopped":
                raise EngineRankError(f"rank {reply['rank']} did not stop: {reply}")
        return replies

    def exit(self, timeout: float = 30.0) -> None:
        """A clean stop: every rank closes its attachment and returns."""
        if all(process.is_alive() for process in self.processes):
            self.ask("exit", timeout)
        self.join(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still running (the kernel closes its attach connections)."""
        for process in self.processes:
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        self.join(30)
        for channel in self.channels:
            channel.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))

    def _receive_all(self, timeout: float, what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        replies: dict[int, dict[str, Any]] = {}
        waiting = dict(enumerate(self.channels))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineRankError(
                    f"engine {self.spec.name}: ranks {sorted(waiting)} did not answer {what!r} "
                    f"within {timeout:.0f} s{self._log_tails(sorted(waiting))}"
                )
            ready = multiprocessing.connection.wait(list(waiting.values()), timeout=left)
            for rank, channel in list(waiting.items()):
                if channel not in ready:
                    continue
                try:
                    reply = channel.recv()
                except EOFError:
                    raise EngineRankError(
                        f"engine {self.spec.name} rank {rank} exited during {what!r} "
                        f"(exit code {self.processes[rank].exitcode}){self._log_tails([rank])}"
                    ) from None
                if reply.get("event") == "error":
                    raise EngineRankError(
                        f"engine {self.spec.name} rank {rank} failed during {what!r}:\n"
                        f"{reply['error']}"
                    )
                replies[rank] = reply
                del waiting[rank]
        return [replies[rank] for rank in sorted(replies)]

    def _log_tails(self, ranks: Sequence[int], lines: int = 20) -> str:
        tails = []
        for rank in ranks:
            path = self.spec.log_path(rank)
            if path is None:
                continue
            try:
                text = Path(path).read_text(errors="replace").splitlines()[-lines:]
            except FileNotFoundError:
                continue
            tails.append(f"\n--- last lines of {path}:\n" + "\n".join(text))
        return "".join(tails)
