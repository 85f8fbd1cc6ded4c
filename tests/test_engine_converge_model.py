"""Converging on model-backed daemons: the reload way and the move way, judged against the
checkpoint.

Real processes, as in the demo (``demo_cases.workspace``, model-backed): one group of two
daemons (sglang's own ``WeightCacheDaemon`` loading a tiny Qwen3-MoE checkpoint, able to reload
slots from it) and engines of 2 gloo ranks running sglang's real startup method and expert move
with the plugin's hooks. Daemon 0 is brought ahead alone by engine A (a stand-in attached to it
only) with ``expert_layout_reload``: its slots then hold the checkpoint's experts in A's map, and
daemon 1 is clean at version 0 in the initial layout.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest

from demo_cases import DemoConfig, Workspace
from demo_cases.workspace import matching, query_daemons, started_workspace
from layout_ledger.core.layout import Map, layout_digest
from sglang_integration.testing.daemon_control import EngineStandIn, request

pytestmark = pytest.mark.timeout(600)

CONFIG = DemoConfig(model="qwen3_moe")
INITIAL = CONFIG.initial_map()
# Layer 0: rank 0 swaps experts 0 and 1, rank 1 takes experts 4 and 5 in slots 8 and 9.
MOVED = [1, 0, 2, 3, 4, 5, 6, 7, 4, 5, 2, 3]
# Layer 1: rank 1 swaps experts 6 and 7.
SWAPPED = [0, 1, 2, 3, 4, 5, 7, 6, 0, 1, 2, 3]


def with_rows(rows: dict[int, list[int]]) -> Map:
    the_map = [list(row) for row in INITIAL]
    for layer, row in rows.items():
        the_map[layer] = list(row)
    return the_map


@pytest.fixture(scope="module")
def workspace() -> Iterator[Workspace]:
    with started_workspace(CONFIG) as space:
        yield space


def ahead_on_daemon_zero(daemon: Any, version: int, the_map: Map) -> None:
    """Engine A, attached to daemon 0 alone, has it reload into ``the_map`` as ``version``."""
    engine_a = EngineStandIn.start(daemon.socket_path, "engine-a")
    try:
        reply = request(
            daemon.socket_path,
            {
                "type": "expert_layout_reload",
                "engine_id": "engine-a",
                "base_version": 0,
                "version": version,
                "digest": layout_digest(the_map),
                "physical_to_logical_map": the_map,
            },
            timeout=60,
        )
        assert reply["status"] == "ok", reply
    finally:
        engine_a.exit()
    deadline = time.monotonic() + 30
    while client_attached(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)


def client_attached(daemon: Any) -> bool:
    (reply,) = query_daemons([daemon])
    return bool(reply.layout.attached)


def events(ledger: str) -> list[tuple[str, int | None, int | None, str | None]]:
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as conn:
        return list(
            conn.execute(
                "SELECT kind, base_version, new_version, engine_id FROM ledger_events "
                "ORDER BY event_id"
            )
        )


def converged(workspace: Workspace, case: str, version: int, the_map: Map) -> str:
    """Engine B starts on the daemons; every rank on ``version`` and ``the_map``, every slot
    right against the checkpoint, both daemons at that version and digest. B's id."""
    run_dir = workspace.experts(case)
    daemons = workspace.daemons(case, experts=run_dir)
    ahead_on_daemon_zero(daemons[0], version, the_map)
    assert [reply.layout.version for reply in query_daemons(daemons)] == [version, 0]
    engine_b = workspace.launch(case, "B", daemons, run_dir)
    try:
        assert not engine_b.failed, engine_b.failed
        started = engine_b.started
        digest = layout_digest(the_map)
        assert [(r["session"]["version"], r["session"]["digest"]) for r in started] == [
            (version, digest)
        ] * 2
        assert all(r["map"] == the_map for r in started)
        assert sum(r["matching"] for r in started) == CONFIG.all_slots
        held = workspace.held_map(run_dir)
        assert matching(held, CONFIG.moe_rows(the_map)) == CONFIG.all_slots
        layouts = [reply.layout for reply in query_daemons(daemons)]
        assert [(x.version, x.digest, x.dirty) for x in layouts] == [(version, digest, False)] * 2
        engine_id = str(started[0]["session"]["engine_id"])
        kinds = [
            (kind, base, new)
            for kind, base, new, who in events(daemons[1].ledger_path)
            if who == engine_id
        ]
        engine_b.exit()
    finally:
        engine_b.kill()
    return repr(kinds)


def test_converge_a_daemon_two_versions_behind_reloads_from_its_checkpoint(
    workspace: Workspace,
) -> None:
    newest = with_rows({0: MOVED, 1: SWAPPED})
    kinds = converged(workspace, "converge-reload", 2, newest)
    assert "('reload', 0, 2)" in kinds and "commit" not in kinds


def test_converge_a_daemon_one_version_behind_moves_by_begin_and_commit(
    workspace: Workspace,
) -> None:
    newest = with_rows({0: MOVED})
    kinds = converged(workspace, "converge-move", 1, newest)
    assert "('begin', 0, None)" in kinds and "('commit', 0, 1)" in kinds
    assert "reload" not in kinds
