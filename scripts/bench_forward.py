#!/usr/bin/env python3
"""What the plugin adds to an engine's decode step while EPLB rebalances every few steps, and how
long a rebalance chunk holds a forward pass: one run, side by side.

Two engines of 2 EP ranks (``testing.cpu_engine``: each rank sglang's real model, greedy decoding
through sglang's ``ModelRunner.forward`` on the CPU, its routed experts mapped from its daemon) on
model-backed daemons of the same tiny checkpoint (``testing.checkpoint``: 8 MoE layers, float32 so
the figures are a real model's):

- **on**: the plugin (its hooks applied in the engine ranks; daemons with the plugin, a ledger
  each): every rebalance two-phase through the daemons, the round trips on each rank's agent;
- **off**: the plugin disabled (no hook in the engine ranks; daemons ``--without-plugin``):
  sglang 0.5.23 as it is.

Both decode continuously (``testing.decode_steps``): segment after segment of 16 skewed prompts
(``prompts.load_prompts``, so that real routing asks for new layouts) and ``--new-tokens`` greedy
tokens each, one forward pass per step, with sglang's own EPLB running from
``on_forward_pass_end``: a rebalance every ``--interval`` passes
(``eplb_rebalance_num_iterations``; ``expert_distribution_recorder_buffer_size`` the same),
one layer per chunk (``eplb_rebalance_layers_per_chunk=1``), so each chunk's move lands at the end
of one forward pass. Rounds alternate on / off (the first engine of a round alternates too); both
engines decode the same segments in a round. Per forward pass: ``ModelRunner.forward``'s seconds
(the slower rank's), and whether a chunk moved at its end (and that move's own seconds).

Printed: per engine the median decode step without a chunk, with one, and over all decode
steps; the plugin's added time per decode step (median on - median off, and as % of the off
step: goal <= 1%); how long a chunk holds a forward pass (the passes that carried one, on and off,
median and max, and the move's own time); the rebalances made; the tokens (on against off, and
against a reference from disk that never rebalances, every segment); the load average. Exit 0
when the goal is met and the tokens are right, 1 otherwise.

    .venv/bin/python scripts/bench_forward.py [--model qwen3_moe|deepseek_v3] [--rounds 10]
        [--segments 2] [--new-tokens 64] [--interval 10] [--no-reference] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MODELS = ("qwen3_moe", "deepseek_v3")
MOE_LAYERS = 8
EP_SIZE = 2
NUM_REDUNDANT = 4
SEED = 11
# The goal: the plugin's added time per decode step, median, as a share of the step.
GOAL_SHARE = 0.01
# Seconds every engine rests after its round, so that what a round left running (a daemon's
# checkpoint, an agent finishing its job) ends before the other engine's round.
SETTLE_SECONDS = 0.3
# A reference that never rebalances.
NEVER = 1_000_000_000
# The segment ids of the warm-up (never compared, never timed).
WARM_UP_SEGMENT = 1_000_000
MAX_CONTEXT = 96  # cpu_engine.MAX_CONTEXT
PROMPT_TOKENS = 16  # prompts.LOAD_TOKENS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench_forward.py",
        description="The plugin's added time per decode step, and a chunk's hold on a forward "
        "pass, against the same engine with the plugin disabled (one run, interleaved rounds).",
    )
    parser.add_argument("--model", choices=MODELS, default="qwen3_moe")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per engine (>= 2)")
    parser.add_argument("--segments", type=int, default=2, help="segments per round")
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=64,
        help=f"tokens each segment decodes (2..{MAX_CONTEXT - PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--interval",
        type=int,
        default=10,
        help="forward passes between rebalances (eplb_rebalance_num_iterations, >= 1)",
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the reference engine from disk (the tokens are then compared on/off only)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write every pass's record here")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (on and off alternate first)")
    if args.segments < 1:
        parser.error("--segments must be at least 1")
    if not 2 <= args.new_tokens <= MAX_CONTEXT - PROMPT_TOKENS:
        parser.error(
            f"--new-tokens must be in 2..{MAX_CONTEXT - PROMPT_TOKENS}: a prompt of "
            f"{PROMPT_TOKENS} tokens and the new ones fit in {MAX_CONTEXT}"
        )
    if args.interval < 1:
        parser.error("--interval must be at least 1")
    return args


def eplb_server_args(interval: int, window: int | None = None) -> tuple[tuple[str, Any], ...]:
    """sglang's EPLB every ``interval`` passes, from the routing of the last ``window`` passes
    (default ``interval``; the recorder's buffer may not be longer than the interval:
    ``EPLBManager.__init__`` asserts it, and sglang allocates it whole)."""
    return (
        ("eplb_rebalance_num_iterations", interval),
        ("expert_distribution_recorder_buffer_size", interval if window is None else window),
    )


# ------------------------------------------------------------------------- the figures ----


@dataclass
class Pass:
    kind: str  # "extend" or "decode"
    seconds: float  # the slower rank's
    cpu_seconds: float  # the ranks' main threads' CPU time, mean
    run_delay: float  # the ranks' main threads' wait for a CPU while runnable, mean
    waits: float  # the rest of the ranks' pass (the GIL, the other rank's collectives), mean
    moved_layers: int
    move_seconds: float  # the slower rank's move


@dataclass
class EngineRecord:
    passes: list[Pass] = field(default_factory=list)
    # Per round: the decode steps' seconds (for the paired, per-round comparison).
    round_steps: list[list[float]] = field(default_factory=list)
    tokens: dict[int, list[list[int]]] = field(default_factory=dict)  # by segment id
    state: str = ""  # the plugin's rebalance state after the last round
    # CPU seconds over the timed rounds: both rank processes (every thread), the plugin's agent
    # threads among them, and the engine's daemons; and the times the agents were put on a CPU.
    rank_cpu: float = 0.0
    agent_cpu: float = 0.0
    agent_slices: int = 0
    daemon_cpu: float = 0.0


def merge_ranks(replies: Sequence[dict[str, Any]]) -> list[Pass]:
    """One ``Pass`` per forward pass from every rank's records: the slower rank's seconds (the
    engine's step), the chunk's layers (the same on every rank: sglang's move is collective)."""
    per_rank = [reply["passes"] for reply in replies]
    if len({len(passes) for passes in per_rank}) != 1:
        raise RuntimeError("the ranks ran different numbers of forward passes")
    merged = []
    for records in zip(*per_rank, strict=True):
        kinds = {r[0] for r in records}
        layers = {r[4] for r in records}
        if len(kinds) != 1 or len(layers) != 1:
            raise RuntimeError(f"the ranks disagree on a pass: {records}")
        merged.append(
            Pass(
                kinds.pop(),
                max(r[1] for r in records),
                statistics.fmean(r[2] for r in records),
                statistics.fmean(r[3] for r in records),
                statistics.fmean(r[1] - r[2] - r[3] for r in records),
                layers.pop(),
                max(r[5] for r in records),
            )
        )
    return merged


def decode_steps(passes: Sequence[Pass], chunk: bool | None = None) -> list[float]:
    """The decode passes' seconds; ``chunk``: only those with (True) or without (False) a move."""
    return [
        p.seconds
        for p in passes
        if p.kind == "decode" and (chunk is None or (p.moved_layers > 0) == chunk)
    ]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class Summary:
    steps: dict[str, dict[str, float | int | None]]  # engine -> figure -> value
    added: float | None  # median on - median off, all decode steps (seconds)
    added_share: float | None  # of the off step
    added_no_chunk: float | None
    paired_added: float | None  # median over rounds of (round median on - round median off)
    paired_range: tuple[float, float] | None
    goal_met: bool


def summarize(on: EngineRecord, off: EngineRecord) -> Summary:
    steps: dict[str, dict[str, float | int | None]] = {}
    for name, record in (("on", on), ("off", off)):
        all_steps = decode_steps(record.passes)
        plain = decode_steps(record.passes, chunk=False)
        chunked = [p for p in record.passes if p.kind == "decode" and p.moved_layers > 0]
        moves = [p.move_seconds for p in record.passes if p.moved_layers > 0]
        plain_passes = [p for p in record.passes if p.kind == "decode" and p.moved_layers == 0]
        steps[name] = {
            "decode steps": len(all_steps),
            "median step": median(all_steps),
            "steps without a chunk": len(plain),
            "median without a chunk": median(plain),
            "p90 without a chunk": _quantile(plain, 0.9),
            "cpu without a chunk": median([p.cpu_seconds for p in plain_passes]),
            "run delay without a chunk": median([p.run_delay for p in plain_passes]),
            "waits without a chunk": median([p.waits for p in plain_passes]),
            "steps with a chunk": len(chunked),
            "median with a chunk": median([p.seconds for p in chunked]),
            "max with a chunk": max((p.seconds for p in chunked), default=None),
            "chunks": sum(1 for p in record.passes if p.moved_layers > 0),
            "median move": median(moves),
            "max move": max(moves, default=None),
            "rank cpu per pass": record.rank_cpu / max(1, len(record.passes)),
            "agent cpu per pass": record.agent_cpu / max(1, len(record.passes)),
            "agent slices per pass": round(record.agent_slices / max(1, len(record.passes)), 1),
            "daemon cpu per pass": record.daemon_cpu / max(1, len(record.passes)),
            "extend passes": sum(1 for p in record.passes if p.kind == "extend"),
            "median extend": median([p.seconds for p in record.passes if p.kind == "extend"]),
        }
    on_step, off_step = steps["on"]["median step"], steps["off"]["median step"]
    added = share = None
    if isinstance(on_step, float) and isinstance(off_step, float):
        added = on_step - off_step
        share = added / off_step
    on_plain = steps["on"]["median without a chunk"]
    off_plain = steps["off"]["median without a chunk"]
    added_plain = (
        on_plain - off_plain
        if isinstance(on_plain, float) and isinstance(off_plain, float)
        else None
    )
    pairs = [
        statistics.median(a) - statistics.median(b)
        for a, b in zip(on.round_steps, off.round_steps, strict=False)
        if a and b
    ]
    return Summary(
        steps,
        added,
        share,
        added_plain,
        statistics.median(pairs) if pairs else None,
        (min(pairs), max(pairs)) if pairs else None,
        share is not None and share <= GOAL_SHARE,
    )


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms"


def report(summary: Summary, tokens: dict[str, str], meta: dict[str, Any]) -> str:
    on, off = summary.steps["on"], summary.steps["off"]
    lines = [
        f"bench_forward: {meta['model']}, {EP_SIZE} EP ranks, {MOE_LAYERS} MoE layers, float32; "
        f"a rebalance every {meta['interval']} passes, 1 layer per chunk; {meta['rounds']} rounds "
        f"per engine x {meta['segments']} segments x {meta['new_tokens']} tokens (16 prompts), "
        "interleaved",
        f"load average before {meta['load_before']}, after {meta['load_after']} "
        f"({os.cpu_count()} CPUs)",
        "",
        "| per decode step (the slower rank's ModelRunner.forward) | plugin on | plugin off |",
        "|---|---|---|",
    ]
    rows = (
        ("decode steps", "decode steps", False),
        ("median, every decode step", "median step", True),
        ("steps without a chunk", "steps without a chunk", False),
        ("median without a chunk", "median without a chunk", True),
        ("p90 without a chunk", "p90 without a chunk", True),
        ("  of which the main thread's CPU time, median", "cpu without a chunk", True),
        ("  its wait for a CPU (run delay), median", "run delay without a chunk", True),
        ("  the rest (GIL, the other rank), median", "waits without a chunk", True),
        ("steps that carried a chunk", "steps with a chunk", False),
        ("a chunk's pass, median", "median with a chunk", True),
        ("a chunk's pass, max", "max with a chunk", True),
        ("chunks moved (every pass)", "chunks", False),
        ("the move itself (sglang's updater), median", "median move", True),
        ("the move itself, max", "max move", True),
        ("prefill (EXTEND) pass, median (not a decode step)", "median extend", True),
        ("CPU per pass, both rank processes (every thread)", "rank cpu per pass", True),
        ("  of which the plugin's agent threads", "agent cpu per pass", True),
        ("  the agents put on a CPU, times per pass", "agent slices per pass", False),
        ("CPU per pass, the engine's daemons", "daemon cpu per pass", True),
    )
    for label, key, timed in rows:
        if timed:
            lines.append(f"| {label} | {_ms(on[key])} | {_ms(off[key])} |")
        else:
            lines.append(f"| {label} | {on[key]} | {off[key]} |")
    lines.append("")
    share = summary.added_share
    lines.append(
        "the plugin's added time per decode step (median on - median off): "
        f"{_ms(summary.added)} = "
        f"{'-' if share is None else f'{share * 100:+.2f}%'} of a step"
    )
    lines.append(f"  the same over steps without a chunk: {_ms(summary.added_no_chunk)}")
    if summary.paired_range is not None:
        low, high = summary.paired_range
        lines.append(
            f"  per round (on - off, round medians): median {_ms(summary.paired_added)}, "
            f"from {_ms(low)} to {_ms(high)}"
        )
    hold_on, hold_off = on["median with a chunk"], off["median with a chunk"]
    plain_on, plain_off = on["median without a chunk"], off["median without a chunk"]
    if all(isinstance(v, float) for v in (hold_on, hold_off, plain_on, plain_off)):
        lines.append(
            "how long a chunk holds a forward pass (a chunk's pass - the step without one, "
            f"medians): on {_ms(hold_on - plain_on)}, off {_ms(hold_off - plain_off)}; "  # type: ignore[operator]
            f"max pass on {_ms(on['max with a chunk'])}, off {_ms(off['max with a chunk'])}"
        )
    lines.append("")
    lines.append(
        f"goal: added time per decode step <= {GOAL_SHARE * 100:.0f}% of a step, median: "
        f"{'met' if summary.goal_met else 'not met'}"
    )
    for name, verdict in tokens.items():
        lines.append(f"tokens, {name}: {verdict}")
    return "\n".join(lines)


# ------------------------------------------------------------------------- the run ----------


def segments_of(round_index: int, per_round: int, new_tokens: int, vocab: int) -> list[Any]:
    from sglang_integration.testing.prompts import load_prompts

    first = round_index * per_round
    return [(first + j, load_prompts(SEED, first + j, vocab), new_tokens) for j in range(per_round)]


def process_cpu_seconds(pid: int) -> float:
    """A process's CPU seconds (user and system, every thread) from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        stat = handle.read(4096)
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command's name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_round(engine: Any, segments: list[Any], record: EngineRecord, daemons: Any = None) -> None:
    pids = [] if daemons is None else [p.pid for p in daemons.processes]
    daemon_cpu = sum(process_cpu_seconds(pid) for pid in pids)
    replies = engine.decode_segments([(prompts, new) for _, prompts, new in segments])
    record.daemon_cpu += sum(process_cpu_seconds(pid) for pid in pids) - daemon_cpu
    record.rank_cpu += sum(reply["process_cpu"] for reply in replies)
    for reply in replies:
        if reply["agent"] is not None:
            record.agent_cpu += reply["agent"][0]
            record.agent_slices += int(reply["agent"][2])
    if replies[0]["tokens"] != replies[1]["tokens"]:
        raise RuntimeError(f"engine {engine.spec.name}: the ranks decoded different tokens")
    passes = merge_ranks(replies)
    record.passes.extend(passes)
    record.round_steps.append(decode_steps(passes))
    record.state = plugin_state(replies[0])
    for (segment, _, _), tokens in zip(segments, replies[0]["tokens"], strict=True):
        record.tokens[segment] = tokens


def compare_tokens(
    first: dict[int, list[list[int]]], second: dict[int, list[list[int]]]
) -> tuple[int, int]:
    """(prompts whose tokens are equal, prompts compared) over the segments both decoded."""
    equal = total = 0
    for segment, rows in first.items():
        for a, b in zip(rows, second.get(segment, []), strict=False):
            total += 1
            equal += a == b
    return equal, total


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    from sglang_integration.testing.checkpoint import CheckpointSpec, read_config, write_checkpoint
    from sglang_integration.testing.cpu_engine import CpuEngine, EngineSpec, free_port
    from sglang_integration.testing.daemons import start_model_daemons

    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="bench-forward-"))
    dense = 1 if args.model == "deepseek_v3" else 0  # DeepSeek-V3's first layer is dense
    checkpoint = write_checkpoint(
        root / "checkpoint",
        CheckpointSpec(model=args.model, num_layers=MOE_LAYERS + dense, seed=SEED),
    )
    vocab = int(read_config(checkpoint)["vocab_size"])
    groups = []
    engines: list[Any] = []
    on, off = EngineRecord(), EngineRecord()
    reference: dict[int, list[list[int]]] = {}
    try:
        started = time.monotonic()
        for name, flags in (("on", []), ("off", ["--without-plugin"])):
            groups.append(
                start_model_daemons(
                    root / f"daemons-{name}",
                    checkpoint,
                    ep_size=EP_SIZE,
                    num_redundant_experts=NUM_REDUNDANT,
                    daemon_args=["--dtype", "float32", *flags],
                    model=args.model,
                )
            )
        spec = EngineSpec(
            name="on",
            model_dir=str(checkpoint),
            expert_dir="",
            sockets=tuple(groups[0].sockets),
            port=free_port(),
            num_redundant=NUM_REDUNDANT,
            layers_per_chunk=1,
            log_dir=str(root),
            checkpoint=str(checkpoint),
            dtype="float32",
            server_args=eplb_server_args(args.interval),
        )
        specs = {
            "on": spec,
            "off": replace(
                spec, name="off", plugin=False, sockets=tuple(groups[1].sockets), port=free_port()
            ),
        }
        handles = {}
        daemons = {"on": groups[0], "off": groups[1]}
        for name, engine_spec in specs.items():
            engine = CpuEngine.launch(engine_spec)
            engines.append(engine)
            if engine.failed:
                raise RuntimeError(f"engine {name} did not start: {engine.failed[0]['error']}")
            handles[name] = engine
        print(f"daemons and engines started in {time.monotonic() - started:.0f} s", flush=True)
        warm_up = [(WARM_UP_SEGMENT, *segments_of(0, 1, args.new_tokens, vocab)[0][1:])]
        for engine in handles.values():
            run_round(engine, warm_up, EngineRecord())
        records = {"on": on, "off": off}
        for round_index in range(args.rounds):
            segments = segments_of(round_index, args.segments, args.new_tokens, vocab)
            order = ("on", "off") if round_index % 2 == 0 else ("off", "on")
            for name in order:
                run_round(handles[name], segments, records[name], daemons[name])
                time.sleep(SETTLE_SECONDS)
            print(f"round {round_index + 1}/{args.rounds} done", flush=True)
        for engine in engines:
            engine.exit()
        engines.clear()
        if not args.no_reference:
            reference_spec = replace(
                spec,
                name="R",
                sockets=(),
                ranks=EP_SIZE,
                from_disk=True,
                port=free_port(),
                server_args=eplb_server_args(NEVER, window=1),
            )
            engine = CpuEngine.launch(reference_spec)
            engines.append(engine)
            if engine.failed:
                raise RuntimeError(f"the reference did not start: {engine.failed[0]['error']}")
            record = EngineRecord()
            for round_index in range(args.rounds):
                run_round(
                    engine, segments_of(round_index, args.segments, args.new_tokens, vocab), record
                )
            reference = record.tokens
    finally:
        for engine in engines:
            engine.kill()
        for group in groups:
            group.stop()
    load_after = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    summary = summarize(on, off)
    tokens: dict[str, str] = {}
    right = True
    pairs = [("on against off", on.tokens, off.tokens)]
    if reference:
        pairs += [("on against the reference from disk (R)", on.tokens, reference)]
        pairs += [("off against R", off.tokens, reference)]
    for label, first, second in pairs:
        equal, total = compare_tokens(first, second)
        tokens[label] = f"{equal}/{total} prompts equal"
        if not label.startswith("off"):
            right = right and equal == total and total > 0
    tokens["rebalances"] = f"the plugin's state: {on.state}"
    meta = {
        "model": args.model,
        "interval": args.interval,
        "rounds": args.rounds,
        "segments": args.segments,
        "new_tokens": args.new_tokens,
        "load_before": load_before,
        "load_after": load_after,
    }
    print(report(summary, tokens, meta))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "on": [vars(p) for p in on.passes],
                    "off": [vars(p) for p in off.passes],
                }
            )
        )
    print(f"the engines' and daemons' logs: {root}")
    return 0 if summary.goal_met and right else 1


def plugin_state(reply: dict[str, Any]) -> str:
    """What a rank's plugin says of its rebalances (the off engine has no plugin)."""
    state = reply.get("state")
    if state is None:
        return "no plugin"
    return (
        f"{state['rebalances_done']} rebalances done, {state['chunks_committed']} chunks "
        f"committed, version {state['version']}, stopped: {state['stopped_reason']}"
    )


if __name__ == "__main__":
    sys.exit(main())
