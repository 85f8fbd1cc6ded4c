"""Case 5: a warm standby without freezing EPLB. C attaches as a standby (no lease): A keeps
rebalancing beside it (contrast with case 2); A is SIGKILLed between chunks and C's first
forward pass takes its lease and routes with A's last version, then C rebalances alone. (b): C
serves a warmup batch while A lives: A's begins are busy until C's lease ends after its idle
time, then A moves again and C's next forward routes with the newest version. (c): A is
SIGKILLed mid-move with C attached: C's first forward repairs the daemons, as an engine starting
on them would (case 4)."""

from __future__ import annotations

import time
from typing import Any

from demo_cases.answers import check_row
from demo_cases.results import CaseResult, both, per_rank, slots
from demo_cases.workspace import Workspace, query_daemons, wait_for_daemons
from sglang_integration.testing.cpu_engine import CpuEngine

# The standby's idle time, shortened for the demo (30 s by default): long enough that A's next
# rebalance begins while C's lease holds. A model-backed A first runs its rebalance's forward
# pass over skewed prompts (0.1 to 0.5 s here, seconds on a machine loaded by other jobs); an A
# of the synthetic stand-in begins at once.
IDLE_SECONDS = {True: 6.0, False: 3.0}  # by whether the engines compute tokens


def idle_seconds(workspace: Workspace) -> float:
    return IDLE_SECONDS[workspace.answers_tokens]


def standby_env(workspace: Workspace) -> tuple[tuple[str, str], ...]:
    """A warm standby's environment, its idle time shortened (``idle_seconds``)."""
    return (
        ("SGLANG_EXPERT_LAYOUT_ROLE", "standby"),
        ("SGLANG_EXPERT_LAYOUT_STANDBY_IDLE", str(idle_seconds(workspace))),
        ("SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT", "60"),
    )


def run_case5(workspace: Workspace) -> tuple[CaseResult, CaseResult]:
    """Cases 5 and 5 (b) on one set of daemons, then 5 (c) on fresh ones."""
    started = time.monotonic()
    result = CaseResult("Case 5: a warm standby that does not freeze EPLB")
    warmup = CaseResult("Case 5 (b) and (c): warmup, idle release, SIGKILL mid-move")
    _follow_then_take_over(workspace, result, warmup)
    result.seconds = time.monotonic() - started  # (b)'s steps included
    started = time.monotonic()
    _killed_mid_move(workspace, warmup)
    warmup.seconds = time.monotonic() - started
    return result, warmup


def _versions(daemons: list[Any]) -> list[int]:
    return [reply.layout.version for reply in query_daemons(daemons)]


def _wait_released(daemons: list[Any], engine: CpuEngine) -> None:
    wait_for_daemons(
        daemons, lambda layout: str(engine.engine_id) not in layout.leases, "the lease released"
    )


def _follow_then_take_over(workspace: Workspace, result: CaseResult, warmup: CaseResult) -> None:
    config = workspace.config
    chunks = config.chunks_per_rebalance
    alone, beside, _ = config.case2_rebalances
    expert_dir = workspace.experts("case5")
    daemons = workspace.daemons("case5", experts=expert_dir)
    engine_a = workspace.launch("case5", "A", daemons, expert_dir)
    engine_a.rebalance(alone)
    v = alone * chunks
    engine_c = workspace.launch("case5", "C", daemons, expert_dir, env=standby_env(workspace))
    c_started = engine_c.started
    result.check(
        "C attaches as a standby and adopts version",
        both(v, config.ep_size),
        per_rank(r["session"]["version"] for r in c_started),
        all(r["session"]["version"] == v for r in c_started),
    )
    _wait_released(daemons, engine_c)
    result.info(
        "C's lease after its idle time (s)", f"released ({idle_seconds(workspace):g} s, shortened)"
    )
    moved = engine_a.rebalance(beside)
    v2 = v + beside * chunks
    result.check(
        f"A's {beside} rebalances with C attached: versions go past {v} (case 2: paused)",
        both(v2, config.ep_size),
        per_rank(_versions(daemons)),
        all(version == v2 for version in _versions(daemons))
        and all(r["state"]["rebalances_paused"] == 0 for r in moved),
    )
    # (b) C serves a warmup batch while A is alive: A's begins are busy until the lease ends.
    standby_label = "C, the warm standby of case 5, while A keeps rebalancing"
    served = (
        workspace.answer(warmup, standby_label, engine_c, check=False)
        if workspace.answers_tokens
        else engine_c.forward()
    )
    warmup.check(
        "(b) C's warmup forward: lease on every daemon, routes with version",
        both(v2, config.ep_size),
        per_rank(r["session"]["version"] for r in served),
        all(r["session"]["version"] == v2 and r["map"] == moved[0]["map"] for r in served),
    )
    paused = engine_a.rebalance(1)
    warmup.check(
        "(b) A's rebalance while C holds its lease: busy, paused",
        both(1, config.ep_size),
        per_rank(r["state"]["rebalances_paused"] for r in paused),
        all(r["state"]["rebalances_paused"] == 1 for r in paused)
        and _versions(daemons) == [v2] * config.ep_size,
    )
    _wait_released(daemons, engine_c)
    again = engine_a.rebalance(1)
    v3 = v2 + chunks
    warmup.check(
        f"(b) after C's lease ended ({idle_seconds(workspace):g} s idle): A moves again, version",
        both(v3, config.ep_size),
        per_rank(_versions(daemons)),
        _versions(daemons) == [v3] * config.ep_size,
    )
    newest = (
        workspace.answer(warmup, standby_label, engine_c, check=False)
        if workspace.answers_tokens
        else engine_c.forward()
    )
    if workspace.answers_tokens:
        check_row(warmup, workspace.answers.row(standby_label, True))
    warmup.check(
        "(b) C's next forward routes with A's newest version",
        both(v3, config.ep_size),
        per_rank(r["session"]["version"] for r in newest),
        all(r["session"]["version"] == v3 and r["map"] == again[0]["map"] for r in newest),
    )
    _wait_released(daemons, engine_c)
    # A is SIGKILLed between chunks; C's first forward takes over.
    stopped = engine_a.stop_between_chunks(1)
    last = v3 + chunks + 1
    engine_a.kill()
    layouts = wait_for_daemons(daemons, lambda layout: len(layout.attached) == 1, "A detached")
    result.check(
        "A SIGKILLed between chunks: daemons clean at A's last version",
        both(last, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == last and not layout.dirty for layout in layouts),
    )
    first = (
        workspace.answer(result, "C, the standby, taking over after A's SIGKILL (case 5)", engine_c)
        if workspace.answers_tokens
        else engine_c.forward()
    )
    right = sum(r["matching"] for r in first)
    result.check(
        "C's first forward: its lease, A's last version, slots right (no daemon restart)",
        f"{both(last, config.ep_size)}; {slots(config.all_slots, config)}",
        f"{per_rank(r['session']['version'] for r in first)}; {slots(right, config)}",
        all(r["session"]["version"] == last for r in first)
        and right == config.all_slots
        and all(r["map"] == stopped[0]["map"] for r in first)
        and all(str(engine_c.engine_id) in r["daemon"]["leases"] for r in first),
    )
    result.info(
        "C's first forward (s, per rank)", per_rank(f"{r['forward_seconds']:.3f}" for r in first)
    )
    _seen_by_the_operator(result, daemons[0].ledger_path, str(engine_c.engine_id))
    alone_again = engine_c.rebalance(1, in_forward=True)
    v4 = last + chunks
    right = sum(r["matching"] for r in alone_again)
    result.check(
        "C rebalances alone: version, slots right",
        f"{both(v4, config.ep_size)}; {slots(config.all_slots, config)}",
        f"{per_rank(_versions(daemons))}; {slots(right, config)}",
        _versions(daemons) == [v4] * config.ep_size and right == config.all_slots,
    )
    engine_c.exit()
    result.facts.update(v=v, v2=v2, v3=v3, last=last, v4=v4)


def _seen_by_the_operator(result: CaseResult, ledger: str, engine_c: str) -> None:
    """``layout-ledger status`` and ``history`` show C's role and its leases (the console
    script, read-only, beside the running daemon)."""
    import json

    from demo_cases.forensics import run_layout_ledger

    status = run_layout_ledger(["status", ledger, "--json"])
    report = json.loads(status.output)["ledgers"][0] if status.output.startswith("{") else {}
    result.check(
        "status (daemon 0's ledger): C's role and lease",
        "standby, lease",
        f"{'standby' if engine_c in report.get('standbys', []) else '?'}, "
        f"{'lease' if engine_c in report.get('leases', []) else 'no lease'}",
        engine_c in report.get("standbys", []) and engine_c in report.get("leases", []),
    )
    history = run_layout_ledger(["history", ledger, "--kind", "lease,release"])
    kinds = [line.split()[3] for line in history.output.splitlines() if "  inc=" in line]
    result.info("history --kind lease,release (daemon 0): events", ", ".join(kinds))
    result.facts["operator"] = [status.command, history.command]


def _killed_mid_move(workspace: Workspace, warmup: CaseResult) -> None:
    config = workspace.config
    chunks = config.chunks_per_rebalance
    expert_dir = workspace.experts("case5c")
    daemons = workspace.daemons("case5c", experts=expert_dir)
    engine_a = workspace.launch("case5c", "A", daemons, expert_dir)
    engine_a.rebalance(1)
    engine_c = workspace.launch("case5c", "C", daemons, expert_dir, env=standby_env(workspace))
    _wait_released(daemons, engine_c)
    engine_a.stop_in_move(1)
    engine_a.kill()
    layouts = wait_for_daemons(daemons, lambda layout: len(layout.attached) == 1, "A detached")
    base = 2 * chunks
    warmup.check(
        "(c) A SIGKILLed mid-move with C attached: daemons",
        both("dirty", config.ep_size),
        per_rank("dirty" if layout.dirty else "clean" for layout in layouts),
        all(layout.dirty for layout in layouts),
    )
    first = engine_c.forward()
    right = sum(r["matching"] for r in first)
    layouts = [reply.layout for reply in query_daemons(daemons)]
    warmup.check(
        "(c) C's first forward repairs them (as a start would, case 4): version, slots right",
        f"{both(base + 1, config.ep_size)}; {slots(config.all_slots, config)}",
        f"{per_rank(layout.version for layout in layouts)}; {slots(right, config)}",
        all(layout.version == base + 1 and not layout.dirty for layout in layouts)
        and all(r["session"]["version"] == base + 1 for r in first)
        and right == config.all_slots,
    )
    engine_c.exit()
