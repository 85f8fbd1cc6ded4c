"""Case 1: engine A rebalances N times and stops; engine B starts on the same daemons.

With the plugin B adopts the ledger's version and every slot holds the expert B's metadata
names. The same run with the plugin disabled (sglang's own daemon and engines, no hook) shows
the bug: B routes with the initial layout over moved experts.

Measured by outputs too (a model-backed demo): R, an engine from disk that never rebalances,
gives the reference tokens; A answers before its first rebalance and after each; B answers
after A stopped (R's tokens and A's last pass's); D, from disk with ``--init-expert-location``
set to the daemons' map, answers as R; with the plugin disabled B's tokens differ from R's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from demo_cases.answers import check_row, equal_prompts, tokens_of
from demo_cases.results import CaseResult, both, per_rank, slots, yes
from demo_cases.workspace import (
    Workspace,
    content_checks,
    matching,
    query_daemons,
    wait_for_daemons,
)
from layout_ledger.core.layout import Map, layout_digest


def run_case1(workspace: Workspace) -> CaseResult:
    """A rebalances N times and stops; B starts on the same daemons (plugin on)."""
    config = workspace.config
    result = CaseResult("Case 1: restart on the same daemons (plugin on)")
    started = time.monotonic()
    versions = config.case1_rebalances * config.chunks_per_rebalance
    if workspace.answers_tokens:
        workspace.reference("case1")
    expert_dir = workspace.experts("case1")
    daemons = workspace.daemons("case1", experts=expert_dir)
    a_reports, layouts = _engine_a_rebalances(workspace, result, daemons, expert_dir)
    b_reports = _engine_b_adopts(workspace, result, daemons, expert_dir, a_reports[0]["map"])
    if workspace.answers_tokens:
        _engine_d_from_disk(workspace, result, a_reports[0]["map"])
    result.facts.update(
        a_map=a_reports[0]["map"],
        versions=versions,
        b_correct=sum(r["matching"] for r in b_reports),
        b_versions=[r["session"]["version"] for r in b_reports],
        a_rebalances=[r["state"]["rebalances_done"] for r in a_reports],
        daemon_versions=[layout.version for layout in layouts],
    )
    result.seconds = time.monotonic() - started
    return result


def _engine_a_rebalances(
    workspace: Workspace, result: CaseResult, daemons: list[Any], expert_dir: Path
) -> tuple[list[dict[str, Any]], list[Any]]:
    """A starts, rebalances N times and exits; its reports and the daemons' layouts after."""
    config = workspace.config
    n = config.case1_rebalances
    versions = n * config.chunks_per_rebalance
    engine_a = workspace.launch("case1", "A", daemons, expert_dir)
    result.check(
        "A starts on the daemons at version",
        both("0", config.ep_size),
        per_rank(r["session"]["version"] for r in engine_a.started),
        all(r["session"]["version"] == 0 for r in engine_a.started),
    )
    if workspace.answers_tokens:
        workspace.answer(result, "A on the daemons, before its first rebalance", engine_a)
        label = "A after each of its rebalances"
        for _ in range(n):
            a_reports = engine_a.rebalance(1)
            final = workspace.answer(result, label, engine_a, check=False)
        check_row(result, workspace.answers.row(label, True))
        result.facts["a_final_tokens"] = tokens_of(final)
    else:
        a_reports = engine_a.rebalance(n)
    a_map = a_reports[0]["map"]
    result.check(
        f"A: rebalances done ({config.chunks_per_rebalance} chunks each)",
        both(n, config.ep_size),
        per_rank(r["state"]["rebalances_done"] for r in a_reports),
        all(r["state"]["rebalances_done"] == n for r in a_reports),
    )
    result.check(
        "A: its layout version (rebalance_state)",
        both(versions, config.ep_size),
        per_rank(r["state"]["version"] for r in a_reports),
        all(r["state"]["version"] == versions for r in a_reports),
    )
    result.check(
        "A: every slot holds the expert A routes to",
        slots(config.all_slots, config),
        slots(sum(r["matching"] for r in a_reports), config),
        sum(r["matching"] for r in a_reports) == config.all_slots,
    )
    result.info(
        "A: slots that moved away from the initial layout",
        slots(
            config.all_slots
            - matching(config.moe_rows(a_map), config.moe_rows(config.initial_map())),
            config,
        ),
    )
    engine_a.exit()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        "daemon version after A stopped (rebalances x chunks)",
        both(versions, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == versions for layout in layouts),
    )
    prints = content_checks(daemons)
    result.check(
        "daemons' fingerprints at commit = the slots' bytes now",
        both(
            f"{config.all_slots // config.ep_size}/{config.all_slots // config.ep_size}",
            config.ep_size,
        ),
        per_rank(prints),
        all(text.split("/")[0] == text.split("/")[1] for text in prints),
    )
    result.check(
        "daemons' map = A's last map; digest = sha256 of it",
        both("yes", config.ep_size),
        per_rank("yes" if layout.physical_to_logical_map == a_map else "no" for layout in layouts),
        all(
            layout.physical_to_logical_map == a_map and layout.digest == layout_digest(a_map)
            for layout in layouts
        ),
    )
    return a_reports, layouts


def _engine_b_adopts(
    workspace: Workspace, result: CaseResult, daemons: list[Any], expert_dir: Path, a_map: Map
) -> list[dict[str, Any]]:
    """B starts on the daemons A left, adopts their version and reads every slot right."""
    config = workspace.config
    versions = config.case1_rebalances * config.chunks_per_rebalance
    engine_b = workspace.launch("case1", "B", daemons, expert_dir)
    b_reports = engine_b.started
    b_map = b_reports[0]["map"]
    if workspace.answers_tokens:
        replies = workspace.answer(
            result, "B, started on the same daemons after A stopped (plugin on)", engine_b
        )
        a_final = result.facts["a_final_tokens"]
        same = equal_prompts(tokens_of(replies), a_final)
        result.check(
            "B: prompts whose greedy tokens equal A's final pass",
            f"{len(a_final)}/{len(a_final)}",
            f"{same}/{len(a_final)}",
            same == len(a_final),
        )
    result.check(
        "B adopts the ledger's version at startup",
        both(versions, config.ep_size),
        per_rank(r["session"]["version"] for r in b_reports),
        all(r["session"]["version"] == versions for r in b_reports),
    )
    line = startup_line(b_reports[0])
    logged = [f"at version {versions} " in (startup_line(r) or "") for r in b_reports]
    result.check(
        "B logs: routes with the daemon's layout at it",
        both("yes", config.ep_size),
        per_rank(yes(value) for value in logged),
        all(logged),
    )
    result.check(
        "B's metadata map = A's last map",
        "yes",
        "yes" if all(r["map"] == a_map for r in b_reports) else "no",
        all(r["map"] == a_map for r in b_reports),
    )
    b_correct = sum(r["matching"] for r in b_reports)
    result.check(
        "B: slots holding the expert B's map names (B's view)",
        slots(config.all_slots, config),
        slots(b_correct, config),
        b_correct == config.all_slots,
    )
    checked = [any(line.startswith(LOADED_CHECK) for _, line in r["logs"]) for r in b_reports]
    result.check(
        "B: each loaded slot's fingerprint = its expert's",
        both("yes", config.ep_size),
        per_rank(yes(value) for value in checked),
        all(checked),
    )
    held = workspace.held_map(expert_dir)
    right = matching(held, config.moe_rows(b_map))
    result.check(
        "B: the same, read from shared memory by this process",
        slots(config.all_slots, config),
        slots(right, config),
        right == config.all_slots,
    )
    engine_b.exit()
    if line:
        result.notes.append(f"B's startup log (rank 0): {line}")
    return b_reports


def _engine_d_from_disk(workspace: Workspace, result: CaseResult, a_map: Map) -> None:
    """D loads everything from disk with ``--init-expert-location`` = the daemons' map (A's
    last): the control of the proposal's case 1; its tokens are R's."""
    config = workspace.config
    engine_d = workspace.launch_from_disk("case1", "D", init_expert_location=a_map)
    try:
        d_right = sum(r["matching"] for r in engine_d.started)
        result.check(
            "D (from disk, --init-expert-location = the daemons' map): slots holding the "
            "expert D's map names",
            slots(config.all_slots, config),
            slots(d_right, config),
            d_right == config.all_slots,
        )
        workspace.answer(
            result,
            "D from disk, --init-expert-location = the daemons' map",
            engine_d,
            routes=f"v{config.case1_rebalances * config.chunks_per_rebalance}'s map, from disk",
        )
    finally:
        engine_d.exit()


LOADED_CHECK = "Every loaded expert slot holds the expert the layout names"


def startup_line(report: dict[str, Any]) -> str | None:
    for _, line in report.get("logs", []):
        if line.startswith("Routing with the weight cache daemon's expert layout"):
            return str(line)
    return None


def run_case1_without_plugin(workspace: Workspace, plugin_a_map: Map | None) -> CaseResult:
    """The same run with the plugin disabled: sglang's own daemon and engines, no hook."""
    from sglang_integration.engine import client

    config = workspace.config
    result = CaseResult("Case 1, plugin disabled: the bug (sglang 0.5.23's own behaviour)")
    started = time.monotonic()
    n = config.case1_rebalances
    expert_dir = workspace.experts("case1-no-plugin")
    daemons = workspace.daemons("case1-no-plugin", record="no-plugin", experts=expert_dir)
    replies = query_daemons(daemons)
    result.check(
        "sglang's own daemon answers expert_layout_query",
        both("older_daemon", config.ep_size),
        per_rank(reply.outcome.value for reply in replies),
        all(reply.outcome is client.Outcome.OLDER_DAEMON for reply in replies),
    )
    engine_a = workspace.launch("case1-no-plugin", "A", daemons, expert_dir, plugin=False)
    a_reports = engine_a.rebalance(n)
    a_map = a_reports[0]["map"]
    if workspace.answers_tokens:
        workspace.answer(
            result,
            "A, plugin disabled, after its rebalances",
            engine_a,
            routes="its own map (no record)",
        )
    result.check(
        "A (no plugin): rebalances run",
        both(n, config.ep_size),
        per_rank(r["rebalances_run"] for r in a_reports),
        all(r["rebalances_run"] == n for r in a_reports),
    )
    result.check(
        "A: slots holding the expert A routes to (A is right)",
        slots(config.all_slots, config),
        slots(sum(r["matching"] for r in a_reports), config),
        sum(r["matching"] for r in a_reports) == config.all_slots,
    )
    if plugin_a_map is not None and not workspace.answers_tokens:
        # Synthetic loads are the same sequence in both runs; real routing counts every pass
        # an engine ran (the plugin's run answered between its rebalances), so they differ.
        result.info(
            "A's moves = the plugin run's (same loads)", "yes" if a_map == plugin_a_map else "no"
        )
    engine_a.exit()
    engine_b = workspace.launch("case1-no-plugin", "B", daemons, expert_dir, plugin=False)
    b_map = engine_b.started[0]["map"]
    if workspace.answers_tokens:
        workspace.answer(
            result,
            "B, plugin disabled (sglang 0.5.23's own daemons and engines)",
            engine_b,
            expect_equal=False,
        )
    result.check(
        "B (no plugin) routes with",
        "the initial layout",
        "the initial layout" if b_map == config.initial_map() else "another layout",
        b_map == config.initial_map(),
    )
    held = workspace.held_map(expert_dir)
    wrong = config.all_slots - matching(held, config.moe_rows(b_map))
    result.check(
        "B: slots read wrongly (not the expert B's map names)",
        "> 0 (the bug)",
        slots(wrong, config),
        wrong > 0,
    )
    result.info(
        "shared memory holds A's last layout",
        slots(matching(held, config.moe_rows(a_map)), config),
    )
    engine_b.exit()
    result.facts.update(
        wrong=wrong,
        b_correct=config.all_slots - wrong,
        a_rebalances=[r["rebalances_run"] for r in a_reports],
    )
    result.seconds = time.monotonic() - started
    return result
