"""The one-GPU check: ``scripts/gpu_check_single.sh [--device cuda|cpu] ...`` runs this.

Prints what it runs with, then one table per stage (expected and measured values), then the
benchmark's own output; exits 0 when every check held, 1 when a check failed, 2 when a stage
could not run to its end (a process failed or timed out). See the wrapper's header for the
stages, the options and the GPU machine's command.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from types import FrameType

from gpu_single import daemons, results, versions
from gpu_single.results import Stage

STAGES = ("ipc", "fingerprints", "bench")
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check_single.sh", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--daemon", choices=daemons.KINDS, default=daemons.AUTO)
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset")
    parser.add_argument(
        "--scale", type=int, help="divide DeepSeek-V3's sizes by this (default: cuda 1, cpu 16)"
    )
    parser.add_argument("--fingerprint-layers", type=int, help="default: cuda 58, cpu 4")
    parser.add_argument("--copy-bytes", type=int, help="default: cuda 4 GiB, cpu 64 MiB")
    parser.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        help="how engine and holder processes start (default: cuda spawn, cpu forkserver)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, ledgers)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.stages = [s for s in args.stages.split(",") if s]
    if unknown := set(args.stages) - set(STAGES):
        parser.error(f"unknown stages {sorted(unknown)}; choose from {list(STAGES)}")
    args.scale = args.scale or (1 if cuda else 16)
    args.fingerprint_layers = args.fingerprint_layers or (58 if cuda else 4)
    args.copy_bytes = args.copy_bytes or (4 * GIB if cuda else 64 * 2**20)
    args.start_method = args.start_method or ("spawn" if cuda else "forkserver")
    return args


# What the CPU path's forkserver imports once for every process it forks.
FORKSERVER_PRELOAD = [
    "torch",
    "gpu_single.engines",
    "gpu_single.holder",
    "gpu_single.daemons",
    "sglang_integration.engine.startup",
    "sglang_integration.daemon.hooks",
    "layout_ledger.store.ledger",
    "layout_ledger.store.migrate",
]
PRELOAD_BY_DAEMON = {
    daemons.SGLANG: ["sglang.srt.weight_cache.daemon", "sglang_integration.testing.daemon"],
    daemons.LEDGER_SERVICE: ["gpu_single.standin_daemon"],
}


def process_context(start_method: str, daemon_kind: str) -> BaseContext:
    """spawn on CUDA (no process inherits a CUDA-initialized parent; daemons are started as
    commands); on the CPU a forkserver that imports torch, the check, the ledger and (with the
    real daemon) sglang once, and forks the holder, the engines and the daemons."""
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        preload = FORKSERVER_PRELOAD + PRELOAD_BY_DAEMON[daemon_kind]
        context.set_forkserver_preload(preload)  # type: ignore[attr-defined]
    return context


def device_available(device: str) -> str | None:
    """None when the device can be used, else why not."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def run_stages(args: argparse.Namespace, kind: str, work: Path, python: str) -> list[Stage]:
    from gpu_single.bench_stage import run_bench_stage
    from gpu_single.ipc_stage import IpcSettings, run_ipc_stage

    context = process_context(args.start_method, kind)
    settings = IpcSettings(args.device, args.scale, kind, work / "ipc", python, context)
    settings.work.mkdir(parents=True)
    runs: dict[str, Callable[[], list[Stage]]] = {
        "ipc": lambda: run_ipc_stage(settings),
        "fingerprints": lambda: [fingerprint_stage(args, context)],
        "bench": lambda: [run_bench_stage(python, work / "bench")],
    }
    stages: list[Stage] = []
    for name in STAGES:
        if name in args.stages:
            stages += show(guarded(name, runs[name]))
    return stages


def guarded(name: str, run: Callable[[], list[Stage]]) -> list[Stage]:
    """The stage's tables, or one failed stage naming the error that stopped it."""
    try:
        return run()
    except Exception:
        stage = Stage(name, f"Stage {name}", status="failed: an error stopped the stage")
        stage.notes.append(traceback.format_exc())
        return [stage]


def fingerprint_stage(args: argparse.Namespace, context: BaseContext) -> Stage:
    from gpu_single.fingerprint_stage import (
        NOT_AVAILABLE,
        find_fingerprint_function,
        fingerprint_rows,
        run_measurement,
    )
    from gpu_single.ipc_stage import StageFailure, receive

    stage = Stage(
        "2 fingerprints",
        f"Stage 2: slot fingerprints on the device ({args.fingerprint_layers} layers)",
    )
    if find_fingerprint_function() is None:
        stage.status = NOT_AVAILABLE
        return stage
    started = time.monotonic()
    ours, theirs = context.Pipe()
    child = context.Process(
        target=run_measurement,
        args=(args.device, args.fingerprint_layers, args.scale, args.copy_bytes, theirs),
    )
    child.start()
    theirs.close()
    try:
        fingerprint_rows(stage, receive(ours, child, 400.0, "the fingerprint process"))
    except StageFailure as exc:
        stage.status = "failed: the fingerprint process failed"
        stage.notes.append(str(exc))
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    stage.seconds = time.monotonic() - started
    return stage


def show(stages: list[Stage]) -> list[Stage]:
    for stage in stages:
        print("\n" + results.render_stage(stage), flush=True)
    return stages


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()  # the daemons and engines inherit it
    unavailable = device_available(args.device)
    if unavailable is not None:
        print(f"gpu_check_single: {unavailable}; --device cpu runs the CPU path", flush=True)
        return 2
    python = sys.executable
    kind, why = daemons.choose_kind(args.daemon, python)
    header = versions.collect(args.device, kind, why)
    print(f"One-GPU check, device {args.device}; running with:\n{versions.render(header)}")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-single-"))
    stages: list[Stage] = []
    try:
        stages = run_stages(args, kind, work, python)
    finally:
        if args.keep:
            print(f"\nwork dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for stage in stages:
        if stage.output:
            print(f"\n--- {stage.title}: its own output\n{stage.output.rstrip()}")
    code = results.exit_code(stages)
    print(f"\n{results.summary(stages)}; exit {code}", flush=True)
    if args.json is not None:
        results.write_json(args.json, header, stages, code)
    return code


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(2)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)  # timeout: clean up on the way out, exit 2
    sys.exit(main())
