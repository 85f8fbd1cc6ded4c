"""Case 2: a warm standby C attaches; A's begins come back busy and nothing moves; C matches A;
after C exits, A rebalances again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from demo_cases.results import CaseResult, both, per_rank, slots
from demo_cases.workspace import Workspace, matching, query_daemons
from layout_ledger.core.layout import Map
from sglang_integration.testing.cpu_engine import CpuEngine


def run_case2(workspace: Workspace) -> CaseResult:
    """A warm standby C pauses A's rebalancing; after C exits, A rebalances again."""
    config = workspace.config
    result = CaseResult("Case 2: a warm standby pauses rebalancing")
    started = time.monotonic()
    alone = config.case2_rebalances[0]
    expert_dir = workspace.experts("case2")
    daemons = workspace.daemons("case2", experts=expert_dir)
    engine_a = workspace.launch("case2", "A", daemons, expert_dir)
    a_reports = engine_a.rebalance(alone)
    v1 = alone * config.chunks_per_rebalance
    a_map = a_reports[0]["map"]
    result.check(
        f"A alone: {alone} rebalances, version",
        both(v1, config.ep_size),
        per_rank(r["state"]["version"] for r in a_reports),
        all(r["state"]["version"] == v1 for r in a_reports),
    )
    engine_c = _standby_attaches(
        workspace, result, daemons, expert_dir, engine_a=engine_a, a_map=a_map
    )
    paused = _rebalances_pause(
        workspace, result, daemons, expert_dir, engine_a=engine_a, a_map=a_map
    )
    engine_c.exit()
    v2 = _rebalances_resume(workspace, result, engine_a, a_map)
    engine_a.exit()
    result.facts.update(v1=v1, v2=v2, paused=[r["state"]["rebalances_paused"] for r in paused])
    result.seconds = time.monotonic() - started
    return result


def _standby_attaches(
    workspace: Workspace,
    result: CaseResult,
    daemons: list[Any],
    expert_dir: Path,
    *,
    engine_a: CpuEngine,
    a_map: Map,
) -> CpuEngine:
    """C starts beside A: it adopts A's version and map; both are attached to every daemon."""
    config = workspace.config
    v1 = config.case2_rebalances[0] * config.chunks_per_rebalance
    engine_c = workspace.launch("case2", "C", daemons, expert_dir)
    c_reports = engine_c.started
    result.check(
        "C attaches and adopts version",
        both(v1, config.ep_size),
        per_rank(r["session"]["version"] for r in c_reports),
        all(r["session"]["version"] == v1 for r in c_reports),
    )
    result.check(
        "C matches A: C's metadata map = A's map",
        "yes",
        "yes" if all(r["map"] == a_map for r in c_reports) else "no",
        all(r["map"] == a_map for r in c_reports),
    )
    c_correct = sum(r["matching"] for r in c_reports)
    result.check(
        "C: slots holding the expert C's metadata names",
        slots(config.all_slots, config),
        slots(c_correct, config),
        c_correct == config.all_slots,
    )
    if workspace.answers_tokens:
        workspace.answer(result, "C, attached beside A (case 2: A's rebalancing pauses)", engine_c)
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "engines attached to each daemon",
        both("2", config.ep_size),
        per_rank(len(layout.attached) for layout in layouts),
        all(
            sorted(layout.attached) == sorted([str(engine_a.engine_id), str(engine_c.engine_id)])
            for layout in layouts
        ),
    )
    return engine_c


def _rebalances_pause(
    workspace: Workspace,
    result: CaseResult,
    daemons: list[Any],
    expert_dir: Path,
    *,
    engine_a: CpuEngine,
    a_map: Map,
) -> list[dict[str, Any]]:
    """A's rebalances with C attached: each begin is busy, nothing moves; A's reports."""
    config = workspace.config
    with_standby = config.case2_rebalances[1]
    v1 = config.case2_rebalances[0] * config.chunks_per_rebalance
    held_before = workspace.held_map(expert_dir)
    paused = engine_a.rebalance(with_standby)
    held_during = workspace.held_map(expert_dir)
    result.check(
        f"A's {with_standby} rebalances with C attached: busy, paused",
        both(with_standby, config.ep_size),
        per_rank(r["state"]["rebalances_paused"] for r in paused),
        all(r["state"]["rebalances_paused"] == with_standby for r in paused),
    )
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "daemon versions while C is attached (unchanged)",
        both(v1, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == v1 and layout.pending is None for layout in layouts),
    )
    moved = config.all_slots - matching(held_during, held_before)
    result.check(
        "slots moved while C is attached",
        "0",
        str(moved),
        moved == 0 and all(r["map"] == a_map for r in paused),
    )
    paused_line = next(
        (line for _, line in paused[0]["logs"] if line.startswith("EPLB rebalance paused")), None
    )
    if paused_line:
        result.notes.append(f"A's log (rank 0): {paused_line}")
    return paused


def _rebalances_resume(
    workspace: Workspace, result: CaseResult, engine_a: CpuEngine, a_map: Map
) -> int:
    """Once C exited and A is alone again, A's rebalances move experts; the version after."""
    config = workspace.config
    alone, _, after = config.case2_rebalances
    chunks = config.chunks_per_rebalance
    v1 = alone * chunks
    polls = engine_a.wait_alone()
    result.info(
        "A alone again after C exited (daemon polls per rank)", per_rank(p["polls"] for p in polls)
    )
    resumed = engine_a.rebalance(after)
    v2 = v1 + after * chunks
    result.check(
        f"after C: A's {after} rebalances move again, version",
        both(v2, config.ep_size),
        per_rank(r["state"]["version"] for r in resumed),
        all(r["state"]["version"] == v2 for r in resumed)
        and all(r["daemon"]["version"] == v2 for r in resumed),
    )
    a_correct = sum(r["matching"] for r in resumed)
    result.check(
        "A: slots holding the expert A routes to",
        slots(config.all_slots, config),
        slots(a_correct, config),
        a_correct == config.all_slots and resumed[0]["map"] != a_map,
    )
    return v2
