"""A group of model-backed daemons: one per EP rank of one engine, in one gloo group.

    python -m sglang_integration.testing.daemons --model {qwen3_moe,deepseek_v3} \\
        --checkpoint DIR --ep-size N --dir RUN [--num-redundant-experts K] [daemon flags...]

starts one model-backed daemon per EP rank (``model_daemon``: sglang's own ``WeightCacheDaemon``
building the model from the checkpoint and loading it with sglang's loader), the ranks in one
torch.distributed gloo group as sglang's daemons of one engine are, serving ``RUN/rank{R}.sock``
with ledgers ``RUN/rank{R}.sqlite``. It prints one line per rank once every daemon serves
(``rank R: pid P socket RUN/rankR.sock ledger RUN/rankR.sqlite``), then stays in the foreground
until SIGTERM or SIGINT, which stop every daemon (a clean end of each ledger incarnation); a
SIGKILL of one rank's process is that daemon's crash, and the others keep serving. Each daemon
records its slot fingerprints at load, as every daemon with the plugin does. ``--model`` must
name the checkpoint's architecture (``checkpoint write`` made it). Exit 0 after SIGTERM/SIGINT,
2 when the arguments or the checkpoint are refused, 1 when the group did not start.

``start_model_daemons`` does the same from Python (tests, the demo, the benchmark) in the
caller's warm forkserver and returns a ``ModelDaemonGroup``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from sglang_integration import settings
from sglang_integration.testing.checkpoint import MODELS, read_config
from sglang_integration.testing.model_daemon import (
    ModelDaemonSpec,
    add_daemon_flags,
    daemon_environment,
    flags_of,
)
from sglang_integration.testing.model_errors import (
    CheckpointError,
    DaemonGroupError,
    ModelToolkitError,
)

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
DEFAULT_REDUNDANT = 4
START_TIMEOUT = 240.0


@dataclass
class ModelDaemonGroup:
    """The processes of one group and where each rank's files are."""

    spec: ModelDaemonSpec
    processes: list[BaseProcess]

    @property
    def ep_size(self) -> int:
        return self.spec.ep_size

    def socket(self, rank: int) -> str:
        return self.spec.path(rank, ".sock")

    def ledger(self, rank: int) -> str:
        return self.spec.path(rank, ".sqlite")

    def log_path(self, rank: int) -> str:
        return self.spec.path(rank, ".log")

    @property
    def sockets(self) -> list[str]:
        return [self.socket(rank) for rank in range(self.ep_size)]

    def pid(self, rank: int) -> int:
        pid = self.processes[rank].pid
        if pid is None:
            raise DaemonGroupError(f"rank {rank}'s daemon has not started")
        return pid

    def is_alive(self, rank: int) -> bool:
        return self.processes[rank].is_alive()

    def log(self, rank: int) -> str:
        try:
            return Path(self.log_path(rank)).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self, rank: int) -> None:
        """SIGKILL rank ``rank``'s daemon: its crash (no clean end of its incarnation)."""
        process = self.processes[rank]
        if process.pid is not None and process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        process.join(30)

    def terminate(self, rank: int) -> None:
        """SIGTERM rank ``rank``'s daemon (sglang's handler ends serve; the hook ends the
        incarnation cleanly); the others keep serving."""
        from sglang_integration.testing.daemon_control import request

        process = self.processes[rank]
        if process.pid is not None and process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            # serve sees the flag after accept() returns; a connection makes it return now.
            with contextlib.suppress(OSError, EOFError, ValueError):
                request(self.socket(rank), {"type": "ping"}, timeout=2.0)

    def stop(self, timeout: float = 60.0) -> list[int | None]:
        """SIGTERM every daemon, then wait; SIGKILL what still runs after ``timeout``. Each
        rank's exit code."""
        for rank in range(self.ep_size):
            self.terminate(rank)
        deadline = time.monotonic() + timeout
        for rank, process in enumerate(self.processes):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                self.kill(rank)
        return [process.exitcode for process in self.processes]

    def daemon(self, rank: int) -> RankDaemon:
        """Rank ``rank``'s daemon with the model-less daemon's handle (``DaemonProcess``)."""
        return RankDaemon(self, rank)


@dataclass(frozen=True)
class RankDaemon:
    """One daemon of a group, handled as ``daemon_control.DaemonProcess`` handles a model-less
    one (what the demo's cases and the tests use either way)."""

    group: ModelDaemonGroup
    rank: int

    @property
    def socket_path(self) -> str:
        return self.group.socket(self.rank)

    @property
    def ledger_path(self) -> str | None:
        keeps = self.group.spec.record and self.group.spec.plugin
        return self.group.ledger(self.rank) if keeps else None

    @property
    def log_path(self) -> str:
        return self.group.log_path(self.rank)

    @property
    def pid(self) -> int:
        return self.group.pid(self.rank)

    def is_alive(self) -> bool:
        return self.group.is_alive(self.rank)

    def wait(self, timeout: float) -> int | None:
        process = self.group.processes[self.rank]
        process.join(timeout)
        return process.exitcode

    def stop(self, timeout: float = 30.0) -> int | None:
        self.group.terminate(self.rank)
        code = self.wait(timeout)
        if self.is_alive():
            self.kill()
            return None
        return code

    def kill(self) -> None:
        self.group.kill(self.rank)

    def log(self) -> str:
        return self.group.log(self.rank)


def check_checkpoint(model: str, checkpoint: str | os.PathLike[str]) -> None:
    """The checkpoint's ``config.json`` names ``model``'s architecture."""
    config = read_config(checkpoint)
    architectures = config.get("architectures")
    if model not in ARCHITECTURES or architectures != [ARCHITECTURES[model]]:
        raise CheckpointError(
            f"{checkpoint} holds {architectures!r}, not --model {model} "
            f"({ARCHITECTURES.get(model)}); write one with python -m "
            f"sglang_integration.testing.checkpoint write DIR --model {model}"
        )


def start_model_daemons(
    run_dir: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    *,
    ep_size: int = 2,
    num_redundant_experts: int = DEFAULT_REDUNDANT,
    daemon_args: Sequence[str] = (),
    model: str | None = None,
    timeout: float = START_TIMEOUT,
) -> ModelDaemonGroup:
    """Start one model-backed daemon per EP rank and wait until each serves.

    ``daemon_args`` are the command's daemon flags (``model_daemon.add_daemon_flags``). Each rank
    is a fresh process forked from the caller's forkserver (``daemon_control.process_context``).
    """
    return start_with_flags(
        run_dir,
        checkpoint,
        flags_of(daemon_args),
        ep_size=ep_size,
        num_redundant_experts=num_redundant_experts,
        model=model,
        timeout=timeout,
    )


def start_with_flags(
    run_dir: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    flags: argparse.Namespace,
    *,
    ep_size: int,
    num_redundant_experts: int,
    model: str | None,
    timeout: float = START_TIMEOUT,
) -> ModelDaemonGroup:
    """``start_model_daemons`` with the daemon flags parsed (``model_daemon.add_daemon_flags``)."""
    spec = spec_with_flags(
        run_dir,
        checkpoint,
        flags,
        ep_size=ep_size,
        num_redundant_experts=num_redundant_experts,
        model=model,
    )
    return launch(spec, timeout)


def spec_with_flags(
    run_dir: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    flags: argparse.Namespace,
    *,
    ep_size: int,
    num_redundant_experts: int,
    model: str | None,
) -> ModelDaemonSpec:
    """The spec of a group with these daemon flags (the run directory made, a free port)."""
    from sglang_integration.testing.cpu_engine import free_port

    if model is not None:
        check_checkpoint(model, checkpoint)
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    return ModelDaemonSpec(
        run_dir=str(run.resolve()),
        checkpoint=str(Path(checkpoint).resolve()),
        ep_size=ep_size,
        port=free_port(),
        num_redundant_experts=num_redundant_experts,
        record=not flags.no_record,
        plugin=not flags.without_plugin,
        init_expert_location=flags.init_expert_location,
        log_level=flags.log_level,
        post_load_rescale=flags.post_load_rescale,
        dtype=flags.dtype,
        env=tuple(sorted(daemon_environment(flags).items())),
    )


def launch(
    spec: ModelDaemonSpec, timeout: float = START_TIMEOUT, target: Any = None
) -> ModelDaemonGroup:
    """Start ``spec``'s daemons (forkserver children) and wait until every one serves.

    ``target``: each rank's process target, called as ``run_model_daemon`` is (the default;
    a benchmark wraps it to count what the load reads)."""
    from sglang_integration.testing.daemon_control import process_context, wait_until_serving
    from sglang_integration.testing.model_daemon import run_model_daemon

    context = process_context()
    group = ModelDaemonGroup(spec, [])
    for rank in range(spec.ep_size):
        process = context.Process(
            target=run_model_daemon if target is None else target,
            args=(spec, rank, spec.path(rank, ".log")),
            name=f"model-daemon-rank{rank}",
            daemon=True,
        )
        process.start()
        group.processes.append(process)
    try:
        deadline = time.monotonic() + timeout
        for rank in range(spec.ep_size):
            wait_until_serving(
                group.socket(rank),
                lambda: all(process.is_alive() for process in group.processes),
                max(1.0, deadline - time.monotonic()),
                lambda: _tails(group),
            )
    except (RuntimeError, TimeoutError) as exc:
        group.stop(10.0)
        raise DaemonGroupError(str(exc)) from None
    except BaseException:
        group.stop(10.0)
        raise
    return group


def _tails(group: ModelDaemonGroup, lines: int = 15) -> str:
    return "".join(
        f"\n--- last lines of {group.log_path(rank)}:\n"
        + "\n".join(group.log(rank).splitlines()[-lines:])
        for rank in range(group.ep_size)
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--checkpoint`` and ``--ep-size``: this command's and ``generate``'s."""
    parser.add_argument("--model", required=True, choices=MODELS)
    parser.add_argument("--checkpoint", required=True, metavar="DIR")
    parser.add_argument("--ep-size", type=int, required=True, metavar="N")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's arguments (its daemon flags among them)."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_integration.testing.daemons",
        description="One model-backed weight cache daemon per EP rank, in one gloo group, until "
        "SIGTERM.",
    )
    add_model_arguments(parser)
    parser.add_argument("--dir", required=True, metavar="RUN", help="the run directory")
    parser.add_argument("--num-redundant-experts", type=int, default=DEFAULT_REDUNDANT, metavar="K")
    add_daemon_flags(parser)
    args = parser.parse_args(argv)
    if args.ep_size < 2:
        parser.error("--ep-size must be at least 2 (sglang's EPLB needs ep_size > 1)")
    if args.num_redundant_experts < 0:
        parser.error("--num-redundant-experts must be at least 0")
    try:
        daemon_environment(args)
    except settings.SettingError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        group = start_with_flags(
            args.dir,
            args.checkpoint,
            args,
            ep_size=args.ep_size,
            num_redundant_experts=args.num_redundant_experts,
            model=args.model,
        )
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModelToolkitError as exc:
        print(f"error: the daemon group did not start: {exc}", file=sys.stderr)
        return 1
    for rank in range(group.ep_size):
        print(
            f"rank {rank}: pid {group.pid(rank)} socket {group.socket(rank)} "
            f"ledger {group.ledger(rank)}",
            flush=True,
        )
    while not stop.wait(0.5):
        pass
    codes = group.stop()
    print(f"stopped: exit codes {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
