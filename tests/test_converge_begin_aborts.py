"""Converging: when one rank's begin is refused, the ranks whose begin was granted abort it.

Two real engine-rank processes in a real gloo group (torch's own group under the names of
sglang's ``GroupCoordinator`` that ``converge.begin_moves`` uses), each attached to its own
model-less daemon (sglang's serve loop with the plugin, a real ledger) with its kept connection,
run the convergence's begin step of one plan in which both daemons move layer 0 to a newer
layout (held by a third daemon of the engine, not needed here). Daemon 1 refuses the begin (an
engine that does not follow the layout fetched its weights), daemon 0 grants it. Every rank
fails with the reason, and daemon 0's move is aborted: when the engine's processes exit, daemon
0 is clean, not dirty with a move nobody finishes.
"""

from __future__ import annotations

import sqlite3
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from gloo_world import WorldGroup

from layout_ledger.core.layout import Geometry, layout_digest, trivial_map
from sglang_integration.testing.cpu_engine import free_port, one_result_per_rank
from sglang_integration.testing.daemon import model_less_cache_config
from sglang_integration.testing.daemon_control import request, start_daemon
from sglang_integration.testing.sglang_env import set_quiet_sglang_env

LAYERS, LOGICAL, PHYSICAL = 2, 6, 8
GEOMETRY = Geometry(LAYERS, PHYSICAL, LOGICAL)
INITIAL = trivial_map(LAYERS, PHYSICAL, LOGICAL)
TARGET = [[1, 0, *INITIAL[0][2:]], INITIAL[1]]


def _plan(sockets: list[str]) -> Any:
    from sglang_integration.engine.converge_decisions import ConvergePlan, DaemonStep, Way

    steps = tuple(
        DaemonStep(rank, socket, Way.MOVE, 0, layout_digest(INITIAL), (0,))
        for rank, socket in enumerate(sockets)
    )
    return ConvergePlan(1, layout_digest(TARGET), TARGET, INITIAL, steps)


def _rank(rank: int, port: int, sockets: list[str], out: Connection) -> None:
    import torch.distributed as dist

    from sglang_integration.engine import client
    from sglang_integration.engine.converge import begin_moves

    set_quiet_sglang_env()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    attachment = client.attach(sockets[rank], "engine-b")
    connection = client.LayoutConnection(sockets[rank], "engine-b")
    try:
        begin_moves(WorldGroup(), _plan(sockets), rank, connection)
        out.send("started")
    except Exception as exc:
        out.send(f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()
        attachment.close()
        dist.destroy_process_group()


def _events(ledger: str) -> list[str]:
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as conn:
        return [kind for (kind,) in conn.execute("SELECT kind FROM events ORDER BY event_id")]


def test_converge_aborts_the_granted_begins_when_one_ranks_begin_is_refused(tmp_path: Path) -> None:
    daemons = [
        start_daemon(
            tmp_path,
            f"daemon{rank}",
            num_layers=LAYERS,
            num_logical_experts=LOGICAL,
            num_physical_experts=PHYSICAL,
        )
        for rank in range(2)
    ]
    try:
        served = request(
            daemons[1].socket_path,
            {"type": "fetch_state", "config": model_less_cache_config(GEOMETRY)},
        )
        assert served["status"] == "ok"  # a non-following fetch: daemon 1 refuses every begin
        sockets = [daemon.socket_path for daemon in daemons]
        port = free_port()
        results = one_result_per_rank(2, _rank, lambda rank: (rank, port, sockets))
        assert all(result.startswith("ExpertLayoutStartupError: ") for result in results), results
        assert len(set(results)) == 1
        assert "rank 1 (daemon " in results[0] and "begin refused: " in results[0]
        layouts = [
            request(daemon.socket_path, {"type": "expert_layout_query"})["layout"]
            for daemon in daemons
        ]
        assert [(x["version"], x["dirty"], x["pending"]) for x in layouts] == [(0, False, None)] * 2
        ledgers = [str(daemon.ledger_path) for daemon in daemons]
        assert _events(ledgers[0])[-4:] == ["attach", "begin", "abort", "detach"]
        assert _events(ledgers[1])[-3:] == ["attach", "begin_refused", "detach"]
    finally:
        for daemon in daemons:
            daemon.stop()
