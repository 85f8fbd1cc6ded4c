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

the group stopped after each. Medians of the rounds, per rank the slower rank's:

- **build + load + record**, the target's: from sglang's "Distributed backend initialized"
  (the ranks' groups are made; from there a rank waits for no other until its readiness
  barrier) to the end of the load: sglang's "Exported ... tensors" without the plugin, the
  ledger's "incarnation ... started" with it (the model build, the load, and with the plugin
  the load hook's fingerprints of every local slot, the ledger created and version 0 recorded);
- **the whole start**: from the first rank's start to every rank answering ``ping`` (what a
  person waits for). It adds the plugin's hook installation: sglang's ``HookRegistry`` walks
  every loaded module once per hooked target (5 for a daemon), and in a child of the warm
  forkserver (about 6,900 modules loaded) that walk also copies every page it touches
  (copy-on-write); a rank that installs its hooks later holds the other at their first
  collective;
- the plugin's parts, from the logs: installing its hooks, and its record (from "Exported" to
  "incarnation ... started"), also as a share of (b)'s build + load (the same work without
  the noise between two runs on a loaded machine).

Then (c): the hook installation as a spawned daemon does it, in a fresh interpreter: sglang's
daemon module imported, then ``install_daemon_hooks()``, each timed.

Target: the plugin adds at most 20% to build + load + record at the demo's size (median (a) /
median (b) <= 1.2). Exit 0 when met, 1 when missed.
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


# The log lines the spans run between (model_daemon's, sglang's, the plugin's).
MARKS = {
    "start": "model-backed daemon rank",
    "hooks": "expert layout hooks installed",
    "groups": "Distributed backend initialized",
    "exported": "tensors as IPC handles",
    "recorded": "started at version",
    "listening": "Listening on",
}


def marks(log: str) -> dict[str, float]:
    """The time of each mark's first line in a rank's log."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        for name, text in MARKS.items():
            stamp = _stamp(line) if text in line and name not in found else None
            if stamp is not None:
                found[name] = stamp
    return found


def span(found: dict[str, float], first: str, last: str) -> float | None:
    if first in found and last in found:
        return found[last] - found[first]
    return None


def one_start(run_dir: Path, checkpoint: Path, plugin: bool) -> dict[str, float]:
    """One group's start: its whole start and, the slower rank's, each span of the logs."""
    from sglang_integration.testing.daemons import start_model_daemons

    started = time.monotonic()
    group = start_model_daemons(
        run_dir, checkpoint, ep_size=2, daemon_args=[] if plugin else ["--without-plugin"]
    )
    figures = {"whole": time.monotonic() - started}
    logs = [marks(group.log(rank)) for rank in range(group.ep_size)]
    group.stop()
    loaded = "recorded" if plugin else "exported"
    for name, first, last in (
        ("load", "groups", loaded),
        ("hooks", "start", "hooks"),
        ("record", "exported", "recorded"),
    ):
        spans = [s for s in (span(found, first, last) for found in logs) if s is not None]
        if spans:
            figures[name] = max(spans)
    return figures


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
                runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
                for round_ in range(args.rounds):
                    for plugin in (True, False) if round_ % 2 == 0 else (False, True):
                        run_dir = workdir / f"run-{model}-{index}-{round_}-{int(plugin)}"
                        runs[plugin].append(one_start(run_dir, checkpoint, plugin))
                        shutil.rmtree(run_dir, ignore_errors=True)

                def median(plugin: bool, name: str, values: dict = runs) -> float:
                    return statistics.median(r[name] for r in values[plugin] if name in r)

                load_ratio = median(True, "load") / median(False, "load")
                demo_size = index == 0
                print(f"{describe(spec)}: checkpoint {size / 2**20:.1f} MiB, {args.rounds} rounds")
                print("                                 plugin on   plugin disabled   ratio")
                for name, what in (("load", "build + load + record"), ("whole", "the whole start")):
                    on, off = median(True, name), median(False, name)
                    print(f"  {what:<30} {on:8.2f} s  {off:8.2f} s      {on / off:6.2f}")
                record = median(True, "record")
                print(
                    f"  the plugin's parts: hooks {median(True, 'hooks'):.2f} s, record "
                    f"{record:.2f} s (record / (b)'s build + load: "
                    f"{record / median(False, 'load'):.0%})",
                )
                verdict = "met" if load_ratio <= RATIO_TARGET else "MISSED"
                label = f"target {RATIO_TARGET} ({verdict})" if demo_size else "(scaling)"
                print(f"  build + load + record, (a) / (b): {load_ratio:.2f}  {label}", flush=True)
                if demo_size:
                    verdicts.append(load_ratio <= RATIO_TARGET)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    imported, installed = fresh_hook_installation()
    print(
        f"(c) in a fresh interpreter: import of sglang's daemon module {imported:.2f} s, then "
        f"install_daemon_hooks() {installed:.2f} s"
    )
    return 0 if all(verdicts) else 1


FRESH = """
import time
started = time.perf_counter()
import sglang.srt.weight_cache.daemon
imported = time.perf_counter()
from sglang_integration.daemon.hooks import install_daemon_hooks
install_daemon_hooks()
print(imported - started, time.perf_counter() - imported)
"""


def fresh_hook_installation() -> tuple[float, float]:
    """(c): seconds of the import and of the hooks' installation in a new interpreter."""
    import subprocess

    completed = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, check=True, timeout=300
    )
    imported, installed = (float(v) for v in completed.stdout.split()[-2:])
    return imported, installed


if __name__ == "__main__":
    sys.exit(main())
