"""An engine whose clean daemons hold different layouts starts on the newest one (issue 32, 4).

Real processes, as in the demo (``demo_cases.workspace``): per EP rank a model-less daemon
serving its rank's shared-memory expert files (it fingerprints them at load, at each commit and
on request) and engines of 2 gloo ranks running sglang's real startup method, EPLB code and
expert move with the plugin's hooks. The daemons come to disagree the way a mover killed
between two ranks' commits leaves them: engine A (a stand-in attached to daemon 0 alone)
begins, moves daemon 0's slots and commits there; daemon 1 never sees the move.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo_cases import DemoConfig, Workspace
from demo_cases.workspace import (
    held_map,
    matching,
    query_daemons,
    started_workspace,
    wait_for_daemons,
)
from layout_ledger.core.layout import layout_digest, trivial_map
from sglang_integration.testing.daemon_control import EngineStandIn
from sglang_integration.testing.shared_experts import attach_shared_experts, expert_values

pytestmark = pytest.mark.timeout(600)

CONFIG = DemoConfig()
INITIAL = trivial_map(CONFIG.num_layers, CONFIG.num_physical_slots, CONFIG.num_logical_experts)
LOCAL = CONFIG.num_physical_slots // CONFIG.ep_size
# A's move of layer 0: rank 0 swaps experts 0 and 1, rank 1 takes experts 4 and 5 (held by rank
# 0) in slots 8 and 9. Every expert keeps a slot.
MOVED_ROW = [1, 0, 2, 3, 4, 5, 6, 7, 4, 5, 2, 3]
NEWEST = [MOVED_ROW, *INITIAL[1:]]


@pytest.fixture(scope="module")
def workspace() -> Iterator[Workspace]:
    with started_workspace(CONFIG) as space:
        yield space


def commit_on_rank_zero_only(expert_dir: Path, daemons: list[Any]) -> None:
    """Engine A's move of layer 0, begun, moved and committed on daemon 0 only; A exits."""
    engine_a = EngineStandIn.start(daemons[0].socket_path, "engine-a")
    assert engine_a.begin(0, [0]).ok
    experts = attach_shared_experts(expert_dir, 0)
    for index, tensor in enumerate(experts.tensors):
        width = experts.shape.widths[index]
        for slot in range(LOCAL):
            tensor[0, slot] = expert_values(0, MOVED_ROW[slot], index, width)
    assert engine_a.commit({0: MOVED_ROW}).ok
    engine_a.exit()
    wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")


def events(ledger: str) -> list[tuple[str, int | None, int | None, str | None]]:
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as conn:
        return list(
            conn.execute(
                "SELECT kind, base_version, new_version, engine_id FROM ledger_events "
                "ORDER BY event_id"
            )
        )


def test_converge_an_engine_moves_the_daemon_a_commit_missed_to_the_newest_layout(
    workspace: Workspace,
) -> None:
    expert_dir = workspace.experts("converge-move")
    daemons = workspace.daemons("converge-move", experts=expert_dir)
    commit_on_rank_zero_only(expert_dir, daemons)
    before = [reply.layout for reply in query_daemons(daemons)]
    assert [layout.version for layout in before] == [1, 0]
    engine_b = workspace.launch("converge-move", "B", daemons, expert_dir)
    assert not engine_b.failed, engine_b.failed
    started = engine_b.started
    digest = layout_digest(NEWEST)
    assert [(r["session"]["version"], r["session"]["digest"]) for r in started] == [(1, digest)] * 2
    assert all(r["map"] == NEWEST for r in started)
    assert sum(r["matching"] for r in started) == CONFIG.all_slots
    assert matching(held_map(expert_dir), NEWEST) == CONFIG.all_slots
    layouts = [reply.layout for reply in query_daemons(daemons)]
    assert [(layout.version, layout.digest, layout.dirty) for layout in layouts] == [
        (1, digest, False)
    ] * 2
    warnings = [line for level, line in started[0]["logs"] if level == "WARNING"]
    assert any(
        line.startswith("Converged the weight cache daemons on version 1") for line in warnings
    ), warnings
    engine_id = started[0]["session"]["engine_id"]
    assert events(daemons[1].ledger_path)[-2:] == [
        ("begin", 0, None, engine_id),
        ("commit", 0, 1, engine_id),
    ]
    assert [kind for kind, *_ in events(daemons[0].ledger_path)].count("commit") == 1
    again = engine_b.rebalance(1)  # the converged daemons move experts together again
    assert [r["state"]["version"] for r in again] == [1 + CONFIG.chunks_per_rebalance] * 2
    assert sum(r["matching"] for r in again) == CONFIG.all_slots
    engine_b.exit()


def test_converge_one_mover_rule_an_engine_not_alone_changes_no_daemon(
    workspace: Workspace,
) -> None:
    expert_dir = workspace.experts("converge-crowded")
    daemons = workspace.daemons("converge-crowded", experts=expert_dir)
    commit_on_rank_zero_only(expert_dir, daemons)
    other = EngineStandIn.start(daemons[1].socket_path, "engine-c")
    try:
        engine_b = workspace.launch("converge-crowded", "B", daemons, expert_dir)
        assert [r["error_type"] for r in engine_b.failed] == ["ExpertLayoutStartupError"] * 2
        reason = engine_b.failed[0]["error"]
        assert engine_b.failed[1]["error"] == reason
        assert (
            f"rank 1 (daemon {daemons[1].socket_path}) at version 0, digest "
            f"{layout_digest(INITIAL)[:12]} has other engines attached ('engine-c'). An engine "
            "that is not alone on a daemon never changes it."
        ) in reason
    finally:
        other.exit()
    layouts = [reply.layout for reply in query_daemons(daemons)]
    assert [layout.version for layout in layouts] == [1, 0]
    assert [kind for kind, *_ in events(daemons[1].ledger_path)].count("begin") == 0


def test_converge_an_engine_killed_in_its_converging_move_loses_no_commit_and_leaves_it_dirty(
    workspace: Workspace,
) -> None:
    """B SIGKILLed after its converging move, before the commit: daemon 0 keeps A's commit
    (version 1), daemon 1 is dirty (B's move pending), never clean at a version its slots do not
    hold. Healed by hand from its (synthetic) checkpoint, it is clean at version 0 again, and C
    converges the daemons as B would have."""
    from sglang_integration.testing.daemon_control import request

    expert_dir = workspace.experts("converge-kill")
    daemons = workspace.daemons("converge-kill", experts=expert_dir)
    commit_on_rank_zero_only(expert_dir, daemons)
    engine_b = workspace.launch("converge-kill", "B", daemons, expert_dir, stop_in_converge=True)
    assert [r["event"] for r in engine_b.stopped] == ["stopped"] * 2, engine_b.failed
    engine_b.kill()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "B gone")
    assert [(x.version, x.dirty) for x in layouts] == [(1, False), (0, True)]
    assert layouts[0].digest == layout_digest(NEWEST)
    assert "detached while its move" in str(layouts[1].dirty_reason)
    healed = request(daemons[1].socket_path, {"type": "expert_layout_heal"}, timeout=60)
    assert healed["status"] == "ok", healed
    assert matching(
        held_map(expert_dir), [MOVED_ROW[:LOCAL] + INITIAL[0][LOCAL:], *INITIAL[1:]]
    ) == (CONFIG.all_slots)
    engine_c = workspace.launch("converge-kill", "C", daemons, expert_dir)
    assert not engine_c.failed, engine_c.failed
    assert [r["session"]["version"] for r in engine_c.started] == [1, 1]
    assert sum(r["matching"] for r in engine_c.started) == CONFIG.all_slots
    assert matching(held_map(expert_dir), NEWEST) == CONFIG.all_slots
    layouts = [reply.layout for reply in query_daemons(daemons)]
    assert [(x.version, x.digest, x.dirty) for x in layouts] == [
        (1, layout_digest(NEWEST), False)
    ] * 2
    engine_c.exit()
