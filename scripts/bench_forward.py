#!/usr/bin/env python3
"""What the plugin adds to an engine's decode step while EPLB rebalances every few steps, and how
long a rebalance chunk holds a forward pass: one run, side by side.

Engines of 2 EP ranks (``testing.cpu_engine``: each rank sglang's real model, greedy decoding
through sglang's ``ModelRunner.forward`` on the CPU, its routed experts mapped from its daemon),
each on its own group of model-backed daemons of the same tiny checkpoint
(``testing.checkpoint``: 8 MoE layers, float32 so the figures are a real model's):

- **on**: the plugin (its hooks applied in the engine ranks; daemons with the plugin, a ledger
  each): every rebalance two-phase through the daemons, the round trips on each rank's agent;
- **off**: the plugin disabled (no hook in the engine ranks; daemons ``--without-plugin``):
  sglang 0.5.23 as it is;
- with ``--handover-ab``, **before**: the plugin with its agent as it was before it slept on its
  queue between jobs (``testing.polling_agent``: it polled every 0.5 ms for a due commit job);
- with ``--aa``, **off2**: a second engine with the plugin off, compared with the first as the
  plugin engines are: the comparison's noise floor in the same run.

Each decodes continuously (``testing.decode_steps``): segment after segment of 16 skewed prompts
(``prompts.load_prompts``, so that real routing asks for new layouts) and ``--new-tokens`` greedy
tokens each, one forward pass per step, with sglang's own EPLB running from
``on_forward_pass_end``: a rebalance every ``--interval`` passes
(``eplb_rebalance_num_iterations``; ``expert_distribution_recorder_buffer_size`` the same),
one layer per chunk (``eplb_rebalance_layers_per_chunk=1``), so each chunk's move lands at the end
of one forward pass. Rounds take the engines in turn, the first engine of a round rotating; every
engine decodes the same segments in a round. Per forward pass: ``ModelRunner.forward``'s seconds
(the slower rank's), the main thread's CPU time and wait for a CPU, and whether a chunk moved at
its end (and that move's own seconds); per round the CPU time of the rank processes, of the
plugin's agent threads and of the daemons.

Printed: per engine the median decode step without a chunk, with one, and over all decode
steps; the plugin's added time per decode step (median on - median off, as % of the off step,
with a 90% interval from resampling the rounds: goal <= 1%); how long a chunk holds a forward
pass (the passes that carried one, median and max, beside the step without one, and the move's
own time); the tokens (on against off, and against a reference from disk that never rebalances,
every segment); the load average. Exit 0 when the goal is met and the tokens are right, else 1.

    .venv/bin/python scripts/bench_forward.py [--model qwen3_moe|deepseek_v3] [--rounds 24]
        [--segments 1] [--new-tokens 64] [--interval 10] [--handover-ab] [--aa]
        [--no-reference] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
# The engines: what each is, and the daemon flags of its group.
ENGINES = {
    "on": "plugin on",
    "off": "plugin off",
    "before": "plugin on, polling agent (before)",
    "off2": "plugin off, a second engine (A/A)",
}
POLLING_AGENT = "sglang_integration.testing.polling_agent:install"
# Seconds every engine rests after its round, so that what a round left running (a daemon's
# checkpoint, an agent finishing its job) ends before the next engine's round.
SETTLE_SECONDS = 0.3
# A reference that never rebalances.
NEVER = 1_000_000_000
# The segment id of the warm-up (never compared, never timed).
WARM_UP_SEGMENT = 1_000_000
MAX_CONTEXT = 96  # cpu_engine.MAX_CONTEXT
PROMPT_TOKENS = 16  # prompts.LOAD_TOKENS
RESAMPLES = 1000  # of the rounds, for the interval of the added time


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench_forward.py",
        description="The plugin's added time per decode step, and a chunk's hold on a forward "
        "pass, against the same engine with the plugin disabled (one run, interleaved rounds).",
    )
    parser.add_argument("--model", choices=MODELS, default="qwen3_moe")
    parser.add_argument("--rounds", type=int, default=24, help="rounds per engine (>= 2)")
    parser.add_argument("--segments", type=int, default=1, help="segments per round")
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
        "--handover-ab",
        action="store_true",
        help="also run the plugin with its agent as before (polling for a due commit job)",
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help="also run a second engine with the plugin off: the noise floor of the comparison",
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the reference engine from disk (the tokens are then compared on/off only)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write every pass's record here")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the engines take turns going first)")
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


def plugin_on(name: str) -> bool:
    """Whether the engine ``name`` runs the plugin (``ENGINES``)."""
    return not name.startswith("off")


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
    # Per round: the decode steps' seconds (the rounds are resampled for the interval).
    round_steps: list[list[float]] = field(default_factory=list)
    tokens: dict[int, list[list[int]]] = field(default_factory=dict)  # by segment id
    state: str = ""  # the plugin's rebalance state after the last round
    # CPU seconds over the timed rounds: both rank processes (every thread), the plugin's agent
    # threads among them, and the engine's daemons; and the times the agents were put on a CPU.
    rank_cpu: float = 0.0
    agent_cpu: float = 0.0
    agent_slices: int = 0
    agent_blocked: int = 0  # forward passes at which a rank's hook waited for its agent
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


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Figures = dict[str, float | int | None]


def engine_figures(record: EngineRecord) -> Figures:
    """One engine's figures (the table's column)."""
    passes = record.passes
    plain = [p for p in passes if p.kind == "decode" and p.moved_layers == 0]
    chunked = [p for p in passes if p.kind == "decode" and p.moved_layers > 0]
    moves = [p.move_seconds for p in passes if p.moved_layers > 0]
    count = max(1, len(passes))
    return {
        "decode steps": len(plain) + len(chunked),
        "median step": median(decode_steps(passes)),
        "steps without a chunk": len(plain),
        "median without a chunk": median([p.seconds for p in plain]),
        "p90 without a chunk": _quantile([p.seconds for p in plain], 0.9),
        "cpu without a chunk": median([p.cpu_seconds for p in plain]),
        "run delay without a chunk": median([p.run_delay for p in plain]),
        "waits without a chunk": median([p.waits for p in plain]),
        "steps with a chunk": len(chunked),
        "median with a chunk": median([p.seconds for p in chunked]),
        "max with a chunk": max((p.seconds for p in chunked), default=None),
        "chunks": len(moves),
        "median move": median(moves),
        "max move": max(moves, default=None),
        "extend passes": sum(1 for p in passes if p.kind == "extend"),
        "median extend": median([p.seconds for p in passes if p.kind == "extend"]),
        "rank cpu per pass": record.rank_cpu / count,
        "agent cpu per pass": record.agent_cpu / count,
        "agent slices per pass": round(record.agent_slices / count, 1),
        "agent blocked": record.agent_blocked,
        "daemon cpu per pass": record.daemon_cpu / count,
    }


@dataclass(frozen=True)
class Comparison:
    """One plugin engine against the plugin disabled, over every decode step."""

    added: float | None  # median - the off median (seconds)
    share: float | None  # of the off median
    share_interval: tuple[float, float] | None  # 90%, from resampling the rounds
    added_no_chunk: float | None  # the same over the steps without a chunk
    chunk_hold: float | None  # a chunk's pass - the step without one, medians
    met: bool


def _pooled_share(
    rounds_on: Sequence[Sequence[float]], rounds_off: Sequence[Sequence[float]]
) -> float:
    on = statistics.median([s for steps in rounds_on for s in steps])
    off = statistics.median([s for steps in rounds_off for s in steps])
    return (on - off) / off


def share_interval(
    on: EngineRecord, off: EngineRecord, resamples: int = RESAMPLES
) -> tuple[float, float] | None:
    """A 90% interval of the added share: the rounds resampled with replacement, each drawn
    round taking both engines' steps of that round (they ran side by side)."""
    pairs = [(a, b) for a, b in zip(on.round_steps, off.round_steps, strict=False) if a and b]
    if len(pairs) < 2:
        return None
    draw = random.Random(SEED)
    shares = sorted(
        _pooled_share(*zip(*(draw.choice(pairs) for _ in pairs), strict=True))
        for _ in range(resamples)
    )
    return shares[int(0.05 * resamples)], shares[int(0.95 * resamples) - 1]


def _difference(a: float | int | None, b: float | int | None) -> float | None:
    if a is None or b is None:
        return None
    return float(a) - float(b)


def compare(on: EngineRecord, off: EngineRecord) -> Comparison:
    mine, theirs = engine_figures(on), engine_figures(off)
    added = _difference(mine["median step"], theirs["median step"])
    off_step = theirs["median step"]
    share = None if added is None or not off_step else added / float(off_step)
    return Comparison(
        added,
        share,
        share_interval(on, off),
        _difference(mine["median without a chunk"], theirs["median without a chunk"]),
        _difference(mine["median with a chunk"], mine["median without a chunk"]),
        share is not None and share <= GOAL_SHARE,
    )


def _ms(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.2f}%"


ROWS = (
    ("decode steps", "decode steps", False),
    ("median, every decode step", "median step", True),
    ("steps without a chunk", "steps without a chunk", False),
    ("median without a chunk", "median without a chunk", True),
    ("p90 without a chunk", "p90 without a chunk", True),
    ("  the main thread's CPU time, median", "cpu without a chunk", True),
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
    ("passes at which a rank waited for its agent (blocked)", "agent blocked", False),
    ("CPU per pass, the engine's daemons", "daemon cpu per pass", True),
)


def report(
    records: dict[str, EngineRecord], tokens: list[str], meta: dict[str, Any]
) -> tuple[str, bool]:
    """The table and the verdicts; whether the goal (on against off) is met."""
    names = list(records)
    figures = {name: engine_figures(records[name]) for name in names}
    lines = [
        f"bench_forward: {meta['model']}, {EP_SIZE} EP ranks, {MOE_LAYERS} MoE layers, float32; "
        f"a rebalance every {meta['interval']} passes, 1 layer per chunk; {meta['rounds']} rounds "
        f"per engine x {meta['segments']} segment(s) x {meta['new_tokens']} tokens (16 prompts), "
        "the engines in turn",
        f"load average before {meta['load_before']}, after {meta['load_after']} "
        f"({os.cpu_count()} CPUs)",
        "",
        "| per decode step (the slower rank's ModelRunner.forward) | "
        + " | ".join(ENGINES[name] for name in names)
        + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for label, key, timed in ROWS:
        cells = [_ms(figures[n][key]) if timed else str(figures[n][key]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    comparisons = {n: compare(records[n], records["off"]) for n in names if n != "off"}
    for name, found in comparisons.items():
        low_high = found.share_interval
        interval = ""
        if low_high is not None:
            low, high = (_percent(share) for share in low_high)
            interval = f" (90% interval over the rounds {low} to {high})"
        lines.append(
            f"{ENGINES[name]}: added time per decode step (median - the off median) "
            f"{_ms(found.added)} = {_percent(found.share)} of a step{interval}; over the steps "
            f"without a chunk {_ms(found.added_no_chunk)}"
        )
    holds = []
    for n in names:
        hold = _difference(figures[n]["median with a chunk"], figures[n]["median without a chunk"])
        holds.append(f"{ENGINES[n]} {_ms(hold)} (max pass {_ms(figures[n]['max with a chunk'])})")
    lines.append(
        "how long a chunk holds a forward pass (a chunk's pass - the step without one, medians): "
        + ", ".join(holds)
    )
    lines.append("")
    met = comparisons["on"].met
    lines.append(
        f"goal: the plugin's added time per decode step <= {GOAL_SHARE * 100:.0f}% of a step, "
        f"median: {_percent(comparisons['on'].share)}: {'met' if met else 'not met'}"
    )
    lines.extend(tokens)
    return "\n".join(lines), met


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


def plugin_state(reply: dict[str, Any]) -> str:
    """What a rank's plugin says of its rebalances (the off engine has no plugin)."""
    state = reply.get("state")
    if state is None:
        return "no plugin"
    return (
        f"{state['rebalances_done']} rebalances done, {state['chunks_committed']} chunks "
        f"committed, version {state['version']}, stopped: {state['stopped_reason']}"
    )


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
            record.agent_blocked += int(reply["agent"][3])
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


def token_lines(
    records: dict[str, EngineRecord], reference: dict[int, list[list[int]]]
) -> tuple[list[str], bool]:
    """The tokens' lines, and whether every plugin engine's tokens are right (equal to the off
    engine's, and to the reference's where it ran)."""
    lines, right = [], True
    for name, record in records.items():
        if not plugin_on(name):
            continue
        against = [("off", records["off"].tokens)]
        if reference:
            against.append(("the reference from disk (R)", reference))
        for label, tokens in against:
            equal, total = compare_tokens(record.tokens, tokens)
            lines.append(f"tokens, {ENGINES[name]} against {label}: {equal}/{total} prompts equal")
            right = right and total > 0 and equal == total
        lines.append(f"  its plugin: {record.state}")
    if reference:
        equal, total = compare_tokens(records["off"].tokens, reference)
        lines.append(f"tokens, plugin off against R: {equal}/{total} prompts equal")
    judged = "the off engine's and R's" if reference else "the off engine's"
    lines.append(
        f"goal: every decode pass of the plugin's engines right (their tokens equal {judged}): "
        f"{'met' if right else 'not met'}"
    )
    return lines, right


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
    names = ["on", "off", *(["before"] if args.handover_ab else []), *(["off2"] if args.aa else [])]
    records = {name: EngineRecord() for name in names}
    groups: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    reference: dict[int, list[list[int]]] = {}
    try:
        started = time.monotonic()
        for name in names:
            flags = [] if plugin_on(name) else ["--without-plugin"]
            groups[name] = start_model_daemons(
                root / f"daemons-{name}",
                checkpoint,
                ep_size=EP_SIZE,
                num_redundant_experts=NUM_REDUNDANT,
                daemon_args=["--dtype", "float32", *flags],
                model=args.model,
            )
        base = EngineSpec(
            name="on",
            model_dir=str(checkpoint),
            expert_dir="",
            sockets=(),
            port=0,
            num_redundant=NUM_REDUNDANT,
            layers_per_chunk=1,
            log_dir=str(root),
            checkpoint=str(checkpoint),
            dtype="float32",
            server_args=eplb_server_args(args.interval),
        )
        for name in names:
            spec = replace(
                base,
                name=name,
                sockets=tuple(groups[name].sockets),
                port=free_port(),
                plugin=plugin_on(name),
                rank_setup=(POLLING_AGENT,) if name == "before" else (),
            )
            engines[name] = CpuEngine.launch(spec)
            if engines[name].failed:
                raise RuntimeError(
                    f"engine {name} did not start: {engines[name].failed[0]['error']}"
                )
        print(f"daemons and engines started in {time.monotonic() - started:.0f} s", flush=True)
        warm_up = [(WARM_UP_SEGMENT, *segments_of(0, 1, args.new_tokens, vocab)[0][1:])]
        for engine in engines.values():
            run_round(engine, warm_up, EngineRecord())
        for index in range(args.rounds):
            segments = segments_of(index, args.segments, args.new_tokens, vocab)
            turn = index % len(names)
            for name in names[turn:] + names[:turn]:
                run_round(engines[name], segments, records[name], groups[name])
                time.sleep(SETTLE_SECONDS)
            print(f"round {index + 1}/{args.rounds} done", flush=True)
        for engine in engines.values():
            engine.exit()
        engines.clear()
        if not args.no_reference:
            engines["R"] = CpuEngine.launch(
                replace(
                    base,
                    name="R",
                    ranks=EP_SIZE,
                    from_disk=True,
                    port=free_port(),
                    server_args=eplb_server_args(NEVER, window=1),
                )
            )
            if engines["R"].failed:
                raise RuntimeError(
                    f"the reference did not start: {engines['R'].failed[0]['error']}"
                )
            decoded = EngineRecord()
            for index in range(args.rounds):
                run_round(
                    engines["R"], segments_of(index, args.segments, args.new_tokens, vocab), decoded
                )
            reference = decoded.tokens
    finally:
        for engine in engines.values():
            engine.kill()
        for group in groups.values():
            group.stop()
    meta = {
        "model": args.model,
        "interval": args.interval,
        "rounds": args.rounds,
        "segments": args.segments,
        "new_tokens": args.new_tokens,
        "load_before": load_before,
        "load_after": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    tokens, right = token_lines(records, reference)
    text, met = report(records, tokens, meta)
    print(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"meta": meta, **{n: [vars(p) for p in r.passes] for n, r in records.items()}}
            )
        )
    print(f"the engines' and daemons' logs: {root}")
    return 0 if met and right else 1


if __name__ == "__main__":
    sys.exit(main())
