"""Case 6: a restart keeps the balance.

Engine A rebalances (version N) and exits; every daemon stops and starts again on its ledger.
With the plugin the daemons agree, before they load, on the last committed version and load the
checkpoint into it: they start at version N with A's map, every slot holds the expert that map
names (judged against the checkpoint), and engine B starts on version N with no rebalance of its
own. The same with the plugin disabled: the restarted daemons load sglang's initial layout (no
version: B routes with the initial layout and must rebalance again). Then the restore's
fallbacks, each on the same daemons' ledgers: rows edited in the file, ``--expert-layout-restore
initial``, another geometry: each loads the initial layout at version 0 and says why.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demo_cases.results import CaseResult, both, per_rank, slots, yes
from demo_cases.workspace import Workspace, matching, query_daemons, wait_for_daemons
from layout_ledger.core.layout import Map

# What a daemon logs when it loads the initial layout instead of restoring (daemon.restore).
FALLBACK = "loading sglang's initial layout at version 0: "


def run_case6(workspace: Workspace) -> CaseResult:
    """A rebalances, the daemons restart and restore; B starts balanced; then the fallbacks."""
    result = CaseResult("Case 6: a restart keeps the balance")
    started = time.monotonic()
    expert_dir = workspace.experts("case6")
    daemons = workspace.daemons("case6", experts=expert_dir)
    a_map, versions = _engine_a_rebalances(workspace, result, daemons, expert_dir)
    _stop(daemons)
    daemons = workspace.daemons("case6", experts=expert_dir)  # on the same ledgers
    _restored(workspace, result, daemons, expert_dir, (a_map, versions))
    b_versions = _engine_b_starts_balanced(
        workspace, result, daemons, expert_dir, (a_map, versions)
    )
    _stop(daemons)
    _without_plugin(workspace, result)
    fallbacks = _fallbacks(workspace, result, expert_dir)
    result.facts.update(a_map=a_map, versions=versions, b_versions=b_versions, fallbacks=fallbacks)
    result.seconds = time.monotonic() - started
    return result


def _stop(daemons: Sequence[Any]) -> None:
    for daemon in daemons:
        daemon.stop()


def _engine_a_rebalances(
    workspace: Workspace, result: CaseResult, daemons: list[Any], expert_dir: Path
) -> tuple[Map, int]:
    config = workspace.config
    n = config.case6_rebalances
    versions = n * config.chunks_per_rebalance
    engine_a = workspace.launch("case6", "A", daemons, expert_dir)
    a_reports = engine_a.rebalance(n)
    a_map = a_reports[0]["map"]
    engine_a.exit()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        f"A rebalanced {n} times: daemons at version",
        both(versions, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == versions for layout in layouts),
    )
    moved = config.all_slots - matching(
        config.moe_rows(a_map), config.moe_rows(config.initial_map())
    )
    result.info("A: slots away from the initial layout (the balance)", slots(moved, config))
    result.facts["moved"] = moved
    return a_map, versions


def _restored(
    workspace: Workspace,
    result: CaseResult,
    daemons: list[Any],
    expert_dir: Path,
    balance: tuple[Map, int],
) -> None:
    config = workspace.config
    a_map, versions = balance
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "all daemons stopped and started again: version",
        both(versions, config.ep_size),
        per_rank(layout.version if layout else "none" for layout in layouts),
        all(layout is not None and layout.version == versions for layout in layouts),
    )
    restored = [
        layout.restored_from.version if layout and layout.restored_from else "none"
        for layout in layouts
    ]
    result.check(
        "restored_from (the layout field)",
        both(f"version {versions}", config.ep_size),
        per_rank(f"version {value}" if value != "none" else value for value in restored),
        all(value == versions for value in restored),
    )
    result.check(
        "the daemons' map = A's last map",
        both("yes", config.ep_size),
        per_rank(
            yes(layout is not None and layout.physical_to_logical_map == a_map)
            for layout in layouts
        ),
        all(layout is not None and layout.physical_to_logical_map == a_map for layout in layouts),
    )
    workspace.check_slots_hold(result, expert_dir, a_map, "A's")
    clean = [layout is not None and not layout.dirty for layout in layouts]
    result.check(
        "each slot checked against its ledger at load: clean",
        both("yes", config.ep_size),
        per_rank(yes(value) for value in clean),
        all(clean),
    )


def _engine_b_starts_balanced(
    workspace: Workspace,
    result: CaseResult,
    daemons: list[Any],
    expert_dir: Path,
    balance: tuple[Map, int],
) -> list[int]:
    config = workspace.config
    a_map, versions = balance
    engine_b = workspace.launch("case6", "B", daemons, expert_dir)
    b_reports = engine_b.started
    b_versions = [int(r["session"]["version"]) for r in b_reports]
    result.check(
        "B starts on version",
        both(versions, config.ep_size),
        per_rank(b_versions),
        all(version == versions for version in b_versions),
    )
    result.check(
        "B routes with A's balanced map, no rebalance of its own",
        "yes",
        yes(all(r["map"] == a_map for r in b_reports)),
        all(r["map"] == a_map for r in b_reports),
    )
    b_correct = sum(r["matching"] for r in b_reports)
    result.check(
        "B: slots holding the expert B's map names",
        slots(config.all_slots, config),
        slots(b_correct, config),
        b_correct == config.all_slots,
    )
    if workspace.answers_tokens:
        workspace.answer(result, "B after the daemons restarted, restored (case 6)", engine_b)
    engine_b.exit()
    return b_versions


def _without_plugin(workspace: Workspace, result: CaseResult) -> None:
    """Plugin disabled: the restarted daemons load sglang's initial layout, whatever A moved."""
    config = workspace.config
    expert_dir = workspace.experts("case6-no-plugin")
    daemons = workspace.daemons("case6-no-plugin", record="no-plugin", experts=expert_dir)
    engine_a = workspace.launch("case6-no-plugin", "A", daemons, expert_dir, plugin=False)
    engine_a.rebalance(config.case6_rebalances)
    engine_a.exit()
    _stop(daemons)
    expert_dir = workspace.experts("case6-no-plugin")  # the restart reloads the weights
    daemons = workspace.daemons("case6-no-plugin", record="no-plugin", experts=expert_dir)
    engine_b = workspace.launch("case6-no-plugin", "B", daemons, expert_dir, plugin=False)
    b_map = engine_b.started[0]["map"]
    held = workspace.held_map(expert_dir)
    initial = config.moe_rows(config.initial_map())
    result.check(
        "plugin disabled, restarted: the daemons hold",
        "the initial layout",
        "the initial layout" if held == initial else "another layout",
        held == initial,
    )
    result.check(
        "plugin disabled: B routes with (rebalances again to get back)",
        "the initial layout",
        "the initial layout" if b_map == config.initial_map() else "another layout",
        b_map == config.initial_map(),
    )
    engine_b.exit()
    _stop(daemons)


def _fallbacks(workspace: Workspace, result: CaseResult, expert_dir: Path) -> list[str]:
    """On case 6's ledgers: each fallback loads the initial layout at version 0, saying why."""
    config = workspace.config
    reasons = []
    cases = (
        ("rows edited in the file", {}, "its rows do not verify"),
        (
            "--expert-layout-restore initial",
            {"flags": ["--expert-layout-restore", "initial"]},
            ("--expert-layout-restore initial on rank 0"),
        ),
        (
            "another geometry",
            {"num_redundant_experts": config.num_redundant_experts + config.ep_size},
            "has another geometry",
        ),
    )
    for what, options, expected in cases:
        if what == "rows edited in the file":
            _edit_newest_row(workspace, "case6")
        expert_dir = workspace.experts("case6")  # a restart that falls back reloads as it was
        daemons = workspace.daemons("case6", experts=None if options else expert_dir, **options)
        layouts = [reply.layout for reply in query_daemons(daemons)]
        logs = [daemon.log() for daemon in daemons]
        said = [_reason(log) for log in logs]
        reasons.append(said[0])
        result.check(
            f"fallback, {what}: version; says why",
            both(f"0; {expected}", config.ep_size),
            per_rank(
                f"{layout.version if layout else 'none'}; "
                + (expected if expected in reason else reason[:60])
                for layout, reason in zip(layouts, said, strict=True)
            ),
            all(
                layout is not None and layout.version == 0 and layout.restored_from is None
                for layout in layouts
            )
            and all(expected in reason for reason in said),
        )
        _stop(daemons)
    return reasons


def _reason(log: str) -> str:
    """The fallback's reason, from the last warning of a daemon's log ("" when it has none)."""
    lines = [line for line in log.splitlines() if FALLBACK in line]
    return lines[-1].split(FALLBACK, 1)[1] if lines else ""


def _edit_newest_row(workspace: Workspace, case: str) -> None:
    """Change one slot of layer 1's newest row in rank 0's ledger (the daemons are stopped):
    model-backed daemons agree, so rank 0's alone makes both load the initial layout; the
    model-less daemons of the synthetic stand-in decide alone, so each ledger is edited."""
    ranks = [0] if workspace.model_backed else range(workspace.config.ep_size)
    for rank in ranks:
        _edit_row(_ledger_path(workspace, case, rank), workspace)


def _edit_row(path: Path, workspace: Workspace) -> None:
    with sqlite3.connect(path) as conn:
        row_id, slots_text = conn.execute(
            "SELECT row_id, slots FROM layout_rows WHERE layer = ? ORDER BY row_id DESC LIMIT 1",
            (workspace.config.first_moe_layer + 1,),
        ).fetchone()
        values = [int(v) for v in slots_text.strip("[]").split(",")]
        values[0] = (values[0] + 1) % workspace.config.num_logical_experts
        conn.execute(
            "UPDATE layout_rows SET slots = ? WHERE row_id = ?",
            ("[" + ",".join(map(str, values)) + "]", row_id),
        )


def _ledger_path(workspace: Workspace, case: str, rank: int) -> Path:
    if workspace.model_backed:
        return workspace.experts(case) / f"rank{rank}.sqlite"
    return workspace.case_dir(case) / f"daemon{rank}.sqlite"
