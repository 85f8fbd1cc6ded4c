"""Case 4: the daemons case 3 (b) left dirty (a mover SIGKILLed mid-move) are repaired by the
next engine, without a restart; (b) content that is not a whole expert is refused: a slot left
half-written after a mover was killed, and a load that left a replica unfilled and an expert's
only copy empty."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from demo_cases.forensics import CommandOutput, layout_ledger_command
from demo_cases.results import CaseResult, both, per_rank, slots, yes
from demo_cases.workspace import (
    Workspace,
    content_checks,
    matching,
    query_daemons,
    wait_for_daemons,
)

REPAIR_LINE = "Repaired the expert layout"


def run_case4(
    workspace: Workspace, daemons: list[Any], expert_dir: Path, case3: CaseResult
) -> tuple[CaseResult, CaseResult]:
    """B repairs case 3 (b)'s daemons; then (b) on the same daemons and on a fresh one."""
    result = CaseResult("Case 4: repair instead of restart (case 3 (b)'s dirty daemons)")
    started = time.monotonic()
    engine_b = _engine_b_repairs(workspace, result, daemons, expert_dir, case3)
    _repaired_daemons_move_again(workspace, result, daemons, engine_b)
    result.seconds = time.monotonic() - started
    refused = CaseResult("Case 4 (b): content that is not a whole expert is refused")
    started = time.monotonic()
    _half_written_slot(workspace, refused, daemons, expert_dir, engine_b)
    _unfilled_replica(workspace, refused)
    refused.seconds = time.monotonic() - started
    return result, refused


def _engine_b_repairs(
    workspace: Workspace, result: CaseResult, daemons: list[Any], expert_dir: Path, case3: Any
) -> Any:
    config, ep = workspace.config, workspace.config.ep_size
    base, layers = case3.facts["base"], case3.facts["layers"]
    pids = [daemon.pid for daemon in daemons]
    result.check(
        "daemons as case 3 (b) left them",
        both("dirty", ep),
        per_rank("dirty" if r.layout.dirty else "clean" for r in query_daemons(daemons)),
        all(r.layout.dirty for r in query_daemons(daemons)),
    )
    engine_b = workspace.launch("case4", "B", daemons, expert_dir)
    reports = engine_b.started
    result.check(
        "B starts: repairs, routes with version",
        both(base + 1, ep),
        per_rank(r["session"]["version"] for r in reports) if reports else "refused",
        len(reports) == ep and all(r["session"]["version"] == base + 1 for r in reports),
    )
    line = next((text for _, text in reports[0]["logs"] if text.startswith(REPAIR_LINE)), "")
    named = str(case3.facts["engine_a"]) in line and f"layers {layers}" in line
    result.check(f"B logs the repair of layers {layers} A left", "yes", yes(named), named)
    correct = matching(workspace.held_map(expert_dir), config.moe_rows(reports[0]["map"]))
    result.check(
        "B: slots holding the expert B's map names",
        slots(config.all_slots, config),
        slots(correct, config),
        correct == config.all_slots,
    )
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "daemons after: clean, at version",
        both(f"clean, {base + 1}", ep),
        per_rank(f"{'dirty' if x.dirty else 'clean'}, {x.version}" for x in layouts),
        all(not x.dirty and x.version == base + 1 for x in layouts),
    )
    same = [
        daemon.pid == pid and daemon.is_alive() for daemon, pid in zip(daemons, pids, strict=True)
    ]
    result.check(
        "daemons not restarted (same processes)",
        both("yes", ep),
        per_rank(map(yes, same)),
        all(same),
    )
    if workspace.answers_tokens:
        workspace.answer(
            result, "B on the daemons it repaired after a SIGKILL mid-move (case 4)", engine_b
        )
    local = config.num_physical_slots // ep
    _ledger_checks(
        result,
        daemons[0].ledger_path,
        b_id=engine_b.engine_id,
        layers=layers,
        base=base,
        local=local,
    )
    if line:
        result.notes.append(f"B's log (rank 0): {line}")
    return engine_b


def _ledger_checks(
    result: CaseResult, ledger: str, *, b_id: Any, layers: list[int], base: int, local: int
) -> None:
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as conn:
        repair = conn.execute(
            "SELECT engine_id, layers, new_version FROM ledger_events WHERE kind = 'repair'"
        ).fetchall()
        (rows,) = conn.execute(
            "SELECT count(*) FROM ledger_slot_fingerprints WHERE version = ?", (base + 1,)
        ).fetchone()
    expected = [(b_id, str(layers), base + 1)]
    result.check(
        "ledger: a repair event (engine, layers, version)",
        f"B, {layers}, {base + 1}",
        ", ".join(str(v) for v in repair[0]).replace(str(b_id), "B") if repair else "none",
        repair == expected,
    )
    per_daemon = len(layers) * local
    result.check(
        "ledger: slot fingerprints recorded at the repair",
        str(per_daemon),
        str(rows),
        rows == per_daemon,
    )
    show = _show_fingerprints(ledger, base + 1, layers[0])
    result.facts["commands"] = [show]
    result.check(
        "layout-ledger show --fingerprints: exit code",
        "0",
        str(show.exit_code),
        show.exit_code == 0,
    )


def _show_fingerprints(ledger: str, version: int, layer: int) -> CommandOutput:
    import subprocess

    args = ["show", ledger, "--version", str(version), "--layers", str(layer), "--ep-size", "2"]
    args.append("--fingerprints")
    completed = subprocess.run(
        [layout_ledger_command(), *args], capture_output=True, text=True, timeout=60, check=False
    )
    output = (completed.stdout + completed.stderr).rstrip()
    return CommandOutput(" ".join(["layout-ledger", *args]), completed.returncode, output)


def _repaired_daemons_move_again(
    workspace: Workspace, result: CaseResult, daemons: list[Any], engine_b: Any
) -> None:
    config = workspace.config
    before = engine_b.started[0]["session"]["version"]
    after = engine_b.rebalance(1)
    version = before + config.chunks_per_rebalance
    correct = sum(r["matching"] for r in after)
    result.check(
        "B rebalances the repaired daemons: version",
        both(version, config.ep_size),
        per_rank(r["state"]["version"] for r in after),
        all(r["state"]["version"] == version for r in after) and correct == config.all_slots,
    )
    prints = content_checks(daemons)
    local = config.all_slots // config.ep_size
    result.check(
        "daemons' fingerprints = the slots' bytes",
        both(f"{local}/{local}", config.ep_size),
        per_rank(prints),
        all(text == f"{local}/{local}" for text in prints),
    )


def _half_written_slot(
    workspace: Workspace, result: CaseResult, daemons: list[Any], expert_dir: Path, engine_b: Any
) -> None:
    """B is SIGKILLed inside its next move; one slot of a pending layer is half overwritten
    with another expert's bytes; C refuses to start, naming it; nothing is recorded."""
    config = workspace.config
    engine_b.stop_in_move(0)
    engine_b.kill()
    wait_for_daemons(daemons, lambda layout: layout.dirty, "dirty")
    layer = config.first_moe_layer
    held, other = workspace.overwrite_half(expert_dir, layer, 1)
    result.info(
        f"(b) B SIGKILLed mid-move; slot 1 of layer {layer} then half-written",
        f"expert {other} over {held}",
    )
    versions = [reply.layout.version for reply in query_daemons(daemons)]
    engine_c = workspace.launch("case4", "C", daemons, expert_dir)
    reason = engine_c.failed[0]["error"] if engine_c.failed else ""
    result.check(
        "(b) C refuses to start (ExpertLayoutStartupError)",
        both("refused", config.ep_size),
        per_rank(r["error_type"] for r in engine_c.failed) if engine_c.failed else "started",
        len(engine_c.failed) == config.ep_size,
    )
    named = (
        f"rank 0 layer {layer} slot 1 holds partial: parts 0-1 of expert {other}, parts 2-3 of "
        f"expert {held}"
    )
    result.check(
        "(b) C's reason names the half-written slot", "yes", yes(named in reason), named in reason
    )
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "(b) daemons still dirty, nothing recorded",
        both("dirty", config.ep_size),
        per_rank("dirty" if x.dirty else "clean" for x in layouts),
        all(x.dirty for x in layouts) and [x.version for x in layouts] == versions,
    )
    if reason:
        result.notes.append(f"C's startup error (rank 0): ExpertLayoutStartupError: {reason}")


def _unfilled_replica(workspace: Workspace, result: CaseResult) -> None:
    """A daemon holding every slot (EP 1: two copies of experts 0-3) loads with one replica's
    bytes zero and expert 5's only copy of layer 1 all -0.0 (no replica to differ from): it
    refuses fetch_state and begin, naming layers and slots.

    On the synthetic stand-in whatever the model: sglang's loader, with the plugin, fills every
    replica (docs/daemon.md "Every replica filled"), so no real load here leaves one unfilled;
    the model-less daemon fingerprints the bytes it is given exactly as a model-backed one."""
    from sglang_integration.engine import client
    from sglang_integration.testing.daemon_control import request
    from sglang_integration.testing.shared_experts import attach_shared_experts

    expert_dir = workspace.experts("case4-unfilled", ep_size=1, synthetic=True)
    for tensor in attach_shared_experts(expert_dir, 0).tensors:
        tensor[5, 10].zero_()  # slot 10 of layer 5: the second copy of expert 2, never filled
        tensor[1, 5] = -0.0  # slot 5 of layer 1: expert 5's only copy, every value -0.0
    (daemon,) = workspace.daemons("case4-unfilled", experts=expert_dir, count=1, synthetic=True)
    layout = client.query(daemon.socket_path).layout
    reason = (layout.dirty_reason or "") if layout is not None else ""
    named = (
        "layer 5: expert 2 in slots that differ (slot 2 " in reason
        and "slot 10 zero-filled" in reason
    )
    result.check(
        "(c) unfilled replica at load: daemon dirty, names layer 5 slots 2, 10",
        "yes",
        yes(named),
        named,
    )
    only_copy = "layer 1: expert 5 in slot 5 is zero-filled" in reason
    result.check(
        "(c) empty only copy (all -0.0) at load: named too",
        "yes",
        yes(only_copy),
        only_copy,
    )
    config = request(daemon.socket_path, {"type": "query_config"})["config"]
    field = {"engine_id": None, "version": 0, "digest": layout.digest if layout else ""}
    fetch = request(
        daemon.socket_path, {"type": "fetch_state", "config": config, "expert_layout": field}
    )
    attachment = client.attach(daemon.socket_path, "engine-D")
    begin = client.begin(daemon.socket_path, "engine-D", 0, [1])
    attachment.close()
    result.check(
        "(c) fetch_state, begin",
        "layout_refused, refused",
        f"{fetch.get('status')}, {begin.outcome.value}",
        fetch.get("status") == "layout_refused" and begin.outcome.value == "refused",
    )
    if reason:
        result.notes.append(f"the unfilled-replica daemon's dirty reason: {reason}")
