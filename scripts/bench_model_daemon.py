"""Benchmark a model-backed daemon group's start with the plugin against sglang's own.

    .venv/bin/python scripts/bench_model_daemon.py [--rounds 3] [--models qwen3_moe,deepseek_v3]
        [--sizes 8x8,16x32]

Per model and size (``LAYERSxEXPERTS``: MoE layers and routed experts; the first size is the
demo's, 8 MoE layers of 8 experts), a checkpoint is written once (Qwen3-MoE in BF16, DeepSeek-V3
in FP8 blocks, as the demo runs them); then, alternating round by round, a group of 2 model-backed
daemons (EP 2, 4 redundant experts) starts in a fresh run directory

- (a) with the plugin: the placement hook, the load hook's fingerprints of every local slot,
  the ledger created and version 0 recorded;
- (b) with ``--without-plugin``: sglang's own daemon with no hook (the same GPU stand-ins,
  model build and loader);

measured from the first rank's start to every rank answering ``ping`` (what a person waits for:
process groups, the model build, the load, and with the plugin its record), the group stopped
after each. From each rank's log, the plugin's own share: from sglang's "Exported ... tensors"
line (the end of its load) to the ledger's "incarnation ... started" line (fingerprints,
ledger, record), the larger of the two ranks.

Target: the plugin adds at most 20% to the start at the demo's size (median (a) / median (b) <=
1.2). Exit 0 when met, 1 when missed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_integration.testing.sglang_env import set_quiet_sglang_env

RATIO_TARGET = 1.2
MODELS = {"qwen3_moe": "bf16", "deepseek_v3": "fp8_block"}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench_model_daemon.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default="8x8,16x32", help="MoE LAYERSxEXPERTS, demo's first")
    args = parser.parse_args(argv)
    args.models = [name for name in args.models.split(",") if name]
    if any(name not in MODELS for name in args.models):
        parser.error(f"--models: one of {', '.join(MODELS)}")
    args.sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")]
    return args


def _stamp(line: str) -> float | None:
    found = _STAMP.match(line)
    if found is None:
        return None
    parsed = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return parsed.timestamp()


def plugin_share(log: str) -> float | None:
    """Seconds from sglang's end of load ("Exported") to the record ("incarnation ... started")."""
    exported = started = None
    for line in log.splitlines():
        if "Exported" in line and "tensors as IPC handles" in line:
            exported = _stamp(line)
        elif "incarnation" in line and "started at version" in line:
            started = _stamp(line)
    if exported is None or started is None:
        return None
    return started - exported


def one_start(run_dir: Path, checkpoint: Path, plugin: bool) -> tuple[float, float | None]:
    from sglang_integration.testing.daemons import start_model_daemons

    started = time.monotonic()
    group = start_model_daemons(
        run_dir, checkpoint, ep_size=2, daemon_args=[] if plugin else ["--without-plugin"]
    )
    seconds = time.monotonic() - started
    shares = [plugin_share(group.log(rank)) for rank in range(group.ep_size)]
    group.stop()
    known = [share for share in shares if share is not None]
    return seconds, (max(known) if known else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_quiet_sglang_env()
    from sglang_integration.testing.checkpoint import CheckpointSpec, describe, write_checkpoint
    from sglang_integration.testing.daemon_control import process_context

    workdir = Path(tempfile.mkdtemp(prefix="bench-model-daemon-"))
    warm = process_context().Process(target=print, args=("forkserver warm",))
    warm.start()
    warm.join()
    verdicts = []
    try:
        for model in args.models:
            for index, (moe_layers, experts) in enumerate(args.sizes):
                first_moe = 1 if model == "deepseek_v3" else 0
                spec = CheckpointSpec(
                    model, MODELS[model], num_layers=first_moe + moe_layers, num_experts=experts
                )
                checkpoint = write_checkpoint(workdir / f"{model}-{moe_layers}x{experts}", spec)
                size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
                timings: dict[bool, list[float]] = {True: [], False: []}
                shares: list[float] = []
                for round_ in range(args.rounds):
                    for plugin in (True, False) if round_ % 2 == 0 else (False, True):
                        run_dir = workdir / f"run-{model}-{index}-{round_}-{int(plugin)}"
                        seconds, share = one_start(run_dir, checkpoint, plugin)
                        timings[plugin].append(seconds)
                        if plugin and share is not None:
                            shares.append(share)
                        shutil.rmtree(run_dir, ignore_errors=True)
                with_plugin = statistics.median(timings[True])
                without = statistics.median(timings[False])
                ratio = with_plugin / without
                demo_size = index == 0
                print(f"{describe(spec)}: checkpoint {size / 2**20:.1f} MiB")
                print(f"  (a) with the plugin        median {with_plugin:6.2f} s  {timings[True]}")
                print(f"  (b) plugin disabled        median {without:6.2f} s  {timings[False]}")
                if shares:
                    print(f"  the plugin's own share     median {statistics.median(shares):6.2f} s")
                verdict = "met" if ratio <= RATIO_TARGET else "MISSED"
                label = f"target {RATIO_TARGET} ({verdict})" if demo_size else "(scaling)"
                print(f"  (a) / (b): {ratio:.2f}  {label}", flush=True)
                if demo_size:
                    verdicts.append(ratio <= RATIO_TARGET)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
