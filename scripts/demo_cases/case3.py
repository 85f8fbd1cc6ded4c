"""Case 3: engine A is SIGKILLed between two chunks (B adopts the committed version) and, on
fresh daemons, inside a move after begin (B refuses to start with the dirty reason). Last,
``layout-ledger fleet`` over the two daemons' ledgers reaches B's verdict without an engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demo_cases.config import DemoConfig
from demo_cases.results import CaseResult, both, per_rank, slots
from demo_cases.workspace import Workspace, matching, query_daemons, wait_for_daemons
from layout_ledger.core.layout import Map

# Engine B of (b) starts as engines did before content checks: it does not repair (case 4 does).
CONTENT_CHECK_OFF = (("SGLANG_EXPERT_LAYOUT_CONTENT_CHECK", "off"),)


def run_case3(workspace: Workspace) -> tuple[CaseResult, list[Any], Path]:
    """SIGKILL between chunks, then (fresh daemons) SIGKILL mid-move after begin.

    Returns the result and the second pair of daemons, still running and dirty (for the
    forensics and case 4), and their experts.
    """
    config = workspace.config
    result = CaseResult("Case 3: SIGKILL during a rebalance")
    started = time.monotonic()
    committed = _kill_between_chunks(workspace, result)
    daemons, expert_dir, a_id = _kill_in_move(workspace, result)
    _engine_b_refuses(workspace, result, daemons, expert_dir, a_id)
    fleet = _fleet(result, daemons)
    base = config.case3_rebalances_before_kill * config.chunks_per_rebalance
    result.notes.append(f"engine A of (b) is {a_id}")
    result.facts.update(committed=committed, engine_a=a_id, base=base, layers=_first_chunk(config))
    result.facts["commands"] = [fleet]
    result.seconds = time.monotonic() - started
    return result, daemons, expert_dir


def _first_chunk(config: DemoConfig) -> list[int]:
    """The layers of a rebalance's first chunk: the first MoE layers."""
    return config.moe_layer_ids[: config.layers_per_chunk]


def _kill_between_chunks(workspace: Workspace, result: CaseResult) -> int:
    """(a) A stops with the first chunk of rebalance k+1 committed, the second not begun, and is
    SIGKILLed; B adopts the committed version. The version committed."""
    config = workspace.config
    k = config.case3_rebalances_before_kill
    chunks = config.chunks_per_rebalance
    first_chunk = _first_chunk(config)
    expert_dir = workspace.experts("case3-between-chunks")
    daemons = workspace.daemons("case3-between-chunks", experts=expert_dir)
    engine_a = workspace.launch("case3-between-chunks", "A", daemons, expert_dir)
    stopped = engine_a.stop_between_chunks(k)
    committed = k * chunks + 1
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "(a) stopped between chunks: version, none pending",
        both(committed, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == committed and layout.pending is None for layout in layouts),
    )
    engine_a.kill()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        "(a) SIGKILL: A detached (socket EOF), daemons",
        both("clean", config.ep_size),
        per_rank("dirty" if layout.dirty else "clean" for layout in layouts),
        not any(layout.dirty for layout in layouts),
    )
    half, before = stopped[0]["map"], stopped[0]["map_before"]
    cut = first_chunk[-1] + 1
    moved = _layers_where(half, before, config.moe_layer_ids, moved=True)
    kept = _layers_where(half, before, config.moe_layer_ids, moved=False)
    result.check(
        f"(a) A's map: MoE layers moved / as at version {committed - 1}",
        f"{_layer_list(first_chunk)} / {_layers(cut, config.num_hidden_layers)}",
        f"{moved} / {kept}",
        all(half[layer] != before[layer] for layer in first_chunk) and half[cut:] == before[cut:],
    )
    engine_b = workspace.launch("case3-between-chunks", "B", daemons, expert_dir)
    b_reports = engine_b.started
    result.check(
        "(a) B adopts the committed version",
        both(committed, config.ep_size),
        per_rank(r["session"]["version"] for r in b_reports),
        all(r["session"]["version"] == committed for r in b_reports),
    )
    held = workspace.held_map(expert_dir)
    b_correct = matching(held, config.moe_rows(b_reports[0]["map"]))
    result.check(
        "(a) B: slots holding the expert B's metadata names",
        slots(config.all_slots, config),
        slots(b_correct, config),
        b_correct == config.all_slots and b_reports[0]["map"] == half,
    )
    if workspace.answers_tokens:
        workspace.answer(result, "(a) B after A's SIGKILL between chunks (case 3)", engine_b)
    engine_b.exit()
    return committed


def _kill_in_move(workspace: Workspace, result: CaseResult) -> tuple[list[Any], Path, str | None]:
    """(b) On fresh daemons, A stops inside the move of its first chunk, after begin and after
    the first layer moved, and is SIGKILLed: the daemons are dirty. The daemons (still running,
    dirty), the experts and A's engine id."""
    config = workspace.config
    k = config.case3_rebalances_before_kill
    chunks = config.chunks_per_rebalance
    first_chunk = _first_chunk(config)
    expert_dir = workspace.experts("case3-in-move")
    daemons = workspace.daemons("case3-in-move", experts=expert_dir)
    engine_a = workspace.launch("case3-in-move", "A", daemons, expert_dir)
    base = k * chunks
    engine_a.stop_in_move(k)
    a_id = engine_a.engine_id
    layouts = [reply.layout for reply in query_daemons(daemons)]
    expected_pending = f"layers {_layer_list(first_chunk)}, base {base}"
    result.check(
        "(b) stopped in the move after begin: A's pending",
        both(expected_pending, config.ep_size),
        per_rank(
            "none"
            if layout.pending is None
            else (
                ("" if layout.pending.engine_id == a_id else f"{layout.pending.engine_id}: ")
                + f"layers {_layer_list(layout.pending.layers)}, base "
                f"{layout.pending.base_version}"
            )
            for layout in layouts
        ),
        all(
            layout.pending is not None
            and layout.pending.engine_id == a_id
            and list(layout.pending.layers) == first_chunk
            and layout.pending.base_version == base
            for layout in layouts
        ),
    )
    held = workspace.held_map(expert_dir)
    committed_map = layouts[0].physical_to_logical_map
    result.info(
        "(b) slots already moved (B would misread them)",
        slots(config.all_slots - matching(held, config.moe_rows(committed_map)), config),
    )
    engine_a.kill()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        "(b) after SIGKILL: daemons dirty",
        both("dirty", config.ep_size),
        per_rank("dirty" if layout.dirty else "clean" for layout in layouts),
        all(layout.dirty for layout in layouts),
    )
    return daemons, expert_dir, a_id


def _engine_b_refuses(
    workspace: Workspace, result: CaseResult, daemons: list[Any], expert_dir: Path, a_id: Any
) -> None:
    """(b) B, with the content check off (so no repair: as before case 4), refuses to start on
    the dirty daemons, with a reason naming A, layers and base."""
    config = workspace.config
    base = config.case3_rebalances_before_kill * config.chunks_per_rebalance
    first_chunk = _first_chunk(config)
    engine_b = workspace.launch("case3-in-move", "B", daemons, expert_dir, env=CONTENT_CHECK_OFF)
    refusals = engine_b.failed
    result.check(
        "(b) B (content check off: no repair) refuses to start",
        both("refused", config.ep_size),
        per_rank(
            "refused" if r["error_type"] == "ExpertLayoutStartupError" else r["error_type"]
            for r in refusals
        )
        if refusals
        else "started",
        len(refusals) == config.ep_size
        and all(r["error_type"] == "ExpertLayoutStartupError" for r in refusals),
    )
    reason = refusals[0]["error"] if refusals else ""
    names = [
        "dirty",
        repr(a_id),
        f"layers {first_chunk}",
        f"version {base}",
    ]
    result.check(
        "(b) B's reason names dirty, A, layers, base version",
        "all 4",
        f"{sum(name in reason for name in names)} of 4",
        all(name in reason for name in names),
    )
    if reason:
        result.notes.append(f"B's startup error (rank 0): ExpertLayoutStartupError: {reason}")


def _fleet(result: CaseResult, daemons: list[Any]) -> Any:
    """``layout-ledger fleet`` over the dirty daemons' ledgers: the verdict B reached, from the
    ledgers alone (exit 3: dirty)."""
    from demo_cases.forensics import run_layout_ledger

    fleet = run_layout_ledger(["fleet", *(daemon.ledger_path for daemon in daemons)])
    verdict = next(
        (
            line.split(": ", 1)[1]
            for line in fleet.output.splitlines()
            if line.startswith("verdict")
        ),
        "?",
    )
    result.check(
        "(b) layout-ledger fleet on both ledgers: verdict, exit",
        "fail, 3",
        f"{verdict}, {fleet.exit_code}",
        verdict == "fail" and fleet.exit_code == 3,
    )
    return fleet


def _layers(first: int, end: int) -> str:
    return "none" if end <= first else f"{first}-{end - 1}" if end - first > 1 else str(first)


def _layers_where(after: Map, before: Map, layers: Sequence[int], *, moved: bool) -> str:
    return _layer_list([layer for layer in layers if (after[layer] != before[layer]) == moved])


def _layer_list(layers: Sequence[int]) -> str:
    """``0-3`` for a run of layers, else the layers listed."""
    layers = list(layers)
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return _layers(layers[0], layers[-1] + 1)
    return ",".join(str(layer) for layer in layers)
