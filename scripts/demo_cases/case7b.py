"""Case 7 (b): daemons at different versions converge on the newest when B starts.

Engine A rebalances, then is SIGKILLed between its ranks' commits of the next chunk: rank 0's
daemon recorded it (version N + 1), rank 1's never got the commit, so A's exit leaves it dirty
at version N. It comes back clean at version N without any engine: a model-backed daemon heals
itself from its checkpoint (case 7); the synthetic stand-in's daemon, which cannot, is restarted
alone on its ledger and restores version N. Two clean daemons at two versions: B starts, and
instead of failing ("the daemons disagree") brings rank 1's daemon to version N + 1 (a two-phase
move by B, or a reload from its checkpoint) and starts on it on both ranks, shown by the ledgers
(versions, digests, B's events) and every slot judged against the checkpoint.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from demo_cases.results import CaseResult, both, per_rank, slots
from demo_cases.workspace import Workspace, query_daemons, wait_for_daemons


def run_case7b(workspace: Workspace) -> CaseResult:
    """A killed between its ranks' commits, rank 1's daemon back clean a version behind; B
    starts on the newest version on every daemon."""
    result = CaseResult("Case 7 (b): daemons at different versions converge")
    started = time.monotonic()
    config = workspace.config
    experts = workspace.experts("case7b")
    # Model-backed: rank 1's daemon heals itself (the earlier cases run theirs with heal off).
    heal = ["--expert-layout-heal", "auto"] if workspace.model_backed else []
    daemons = workspace.daemons("case7b", experts=experts, flags=heal)
    n = config.case7b_rebalances
    version = n * config.chunks_per_rebalance
    engine_a = workspace.launch("case7b", "A", daemons, experts)
    stopped = engine_a.stop_at_commit(n, skip_rank=1)
    engine_a.kill()
    # A's exit: rank 1's daemon, its move pending, marks itself dirty (a model-backed one then
    # heals by itself, maybe before this looks).
    layouts = wait_for_daemons(
        daemons,
        lambda layout: not layout.attached and (layout.dirty or layout.pending is None),
        "A gone",
    )
    result.check(
        "A SIGKILLed between its ranks' commits: versions (rank 0 committed, rank 1 did not)",
        f"{version + 1}, {version}",
        per_rank(layout.version for layout in layouts),
        [x.version for x in layouts] == [version + 1, version] and not layouts[0].dirty,
    )
    newest = layouts[0].physical_to_logical_map
    how = _back_clean(workspace, daemons, experts, layouts[1].physical_to_logical_map)
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        f"rank 1's daemon {how}: both clean, versions",
        f"{version + 1}, {version}",
        per_rank(f"{x.version}{' dirty' if x.dirty else ''}" for x in layouts),
        [(x.version, x.dirty) for x in layouts] == [(version + 1, False), (version, False)],
    )
    before = [x.digest for x in layouts]
    kinds = _events_of(daemons[1].ledger_path, None)[-3:]
    back = "heal" if workspace.model_backed else "restore"
    result.check(
        "rank 1's ledger before B: its last events",
        f"... {back} ...",
        ", ".join(kinds),
        back in kinds,
    )
    b_versions, way = _engine_b_converges(
        workspace, result, daemons, experts, (version + 1, newest)
    )
    result.facts.update(
        versions=[version + 1, version],
        b_versions=b_versions,
        way=way,
        back_clean=how,
        digests_before=before,
        stopped=[r.get("committed") for r in stopped],
    )
    for daemon in daemons:
        daemon.stop()
    result.seconds = time.monotonic() - started
    return result


def _back_clean(workspace: Workspace, daemons: list[Any], experts: Path, its_map: Any) -> str:
    """Rank 1's daemon clean again at its version: healed (model-backed) or restarted alone."""
    if workspace.model_backed:
        wait_for_daemons(daemons[1:], lambda layout: not layout.dirty, "healed", timeout=120)
        return "healed itself from its checkpoint"
    daemons[1] = workspace.restart_alone("case7b", daemons[1], 1, experts, its_map)
    return "restarted alone (restores its last commit)"


def _engine_b_converges(
    workspace: Workspace,
    result: CaseResult,
    daemons: list[Any],
    experts: Path,
    target: tuple[int, Any],
) -> tuple[list[int], str]:
    config = workspace.config
    version, newest = target
    engine_b = workspace.launch("case7b", "B", daemons, experts)
    reports = engine_b.started
    if engine_b.failed:
        result.check("B starts", "yes", engine_b.failed[0]["error"], False)
        return [], "failed"
    b_versions = [int(r["session"]["version"]) for r in reports]
    result.check(
        "B starts on the newest version, with rank 0's map",
        both(version, config.ep_size),
        per_rank(b_versions),
        b_versions == [version] * config.ep_size and all(r["map"] == newest for r in reports),
    )
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "the daemons now: version, digest",
        both(f"{version}, {layouts[0].digest[:12]}", config.ep_size),
        per_rank(f"{x.version}, {x.digest[:12]}" for x in layouts),
        len({(x.version, x.digest) for x in layouts}) == 1 and not any(x.dirty for x in layouts),
    )
    engine_id = str(reports[0]["session"]["engine_id"])
    kinds = _events_of(daemons[1].ledger_path, engine_id)
    way = "reload" if "reload" in kinds else "move"
    result.check(
        "rank 1's ledger: B's events",
        "begin, commit (a move) or reload",
        ", ".join(kinds),
        kinds[-2:] == ["begin", "commit"] or kinds[-1:] == ["reload"],
    )
    workspace.check_slots_hold(result, experts, newest, "the newest")
    b_right = sum(r["matching"] for r in reports)
    result.check(
        "B: slots holding the expert B's map names",
        slots(config.all_slots, config),
        slots(b_right, config),
        b_right == config.all_slots,
    )
    result.info("B's way for rank 1's daemon", way)
    result.info("B's start (seconds, rank 0)", f"{reports[0]['startup_seconds']:.2f}")
    if workspace.answers_tokens:
        workspace.answer(result, "B after its daemons converged (case 7 (b))", engine_b)
    engine_b.exit()
    return b_versions, way


def _events_of(ledger: str, engine_id: str | None) -> list[str]:
    """The kinds of an engine's events in a ledger (every event: None), in order."""
    query = "SELECT kind FROM ledger_events WHERE ? IS NULL OR engine_id = ? ORDER BY event_id"
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as conn:
        rows = conn.execute(query, (engine_id, engine_id)).fetchall()
    return [str(kind) for (kind,) in rows]
