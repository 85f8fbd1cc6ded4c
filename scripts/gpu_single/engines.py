"""The engine processes of stage 1: each maps the holder's memory from its IPC handles.

- ``A`` attaches to each daemon with this package's startup code (``engine_startup.read_daemon``,
  ``agreement.decide``), then replays its commits: ``client.begin``, ``agreement.decide_begin``,
  the move in place on its own mapping of the memory, a device synchronize, ``client.commit``,
  ``agreement.check_commits`` against the digest of its own whole map (the steps and decisions
  of the plugin's rebalance hook, for one rank). It then reads every slot and exits, closing its
  attach connections.
- ``B``, started after A exited: the same startup code; it adopts what the ledger holds and
  reads every slot against the map it adopted.
- ``ignored``: B with the plugin's record ignored (sglang 0.5.23 alone): it routes with the
  initial layout without asking the daemon, and reads every slot against it.

Each sends one report (``{"event": "report", ...}`` or ``{"event": "error", ...}``) and exits.
In ``ledger-service`` mode the engines first install the stand-in framing (``standin_framing``).
"""

from __future__ import annotations

import importlib.metadata
import pickle
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from gpu_single.expert_bytes import (
    HOLDS_NO_EXPERT,
    bases_for,
    count_matching,
    held_experts,
    move_layer,
    synchronize,
)
from gpu_single.geometry import ExpertGeometry
from gpu_single.moves import MovePlan
from layout_ledger.core.layout import Map, layout_digest

ROLES = ("A", "B", "ignored")


class EngineCheckError(RuntimeError):
    """The engine could not do what the check asks (refused begin, failed commit check...)."""


@dataclass(frozen=True)
class GeometryPlan:
    geometry: ExpertGeometry
    socket_path: str
    moves: MovePlan


@dataclass(frozen=True)
class EngineOrder:
    role: str
    device: str
    blob: bytes
    plans: tuple[GeometryPlan, ...]
    standin_framing: bool


def map_tensors(blob: bytes) -> dict[str, list[torch.Tensor]]:
    """This process's mapping of the holder's tensors (torch rebuilds each from its handle)."""
    tensors: dict[str, list[torch.Tensor]] = pickle.loads(blob)
    return tensors


def read_slots(geometry: ExpertGeometry, tensors: list[torch.Tensor]) -> list[list[int]]:
    bases = bases_for([t[0] for t in tensors])
    return [
        held_experts([t[layer] for t in tensors], layer, geometry.num_logical_experts, bases)
        for layer in range(geometry.num_layers)
    ]


def slot_counts(geometry: ExpertGeometry, held: list[list[int]], the_map: Map) -> dict[str, int]:
    right = count_matching(held, geometry.local_rows(the_map))
    torn = sum(row.count(HOLDS_NO_EXPERT) for row in held)
    return {"right": right, "wrong": geometry.total_local_slots - right, "torn": torn}


def start_layout(plan: GeometryPlan, engine_id: str) -> tuple[Any, Any]:
    """This package's engine startup for one rank: attach, read, decide."""
    from layout_ledger.core.startup_verdict import decide
    from sglang_integration.engine.startup import read_daemon

    initial = plan.geometry.initial_map()
    finding, attachment = read_daemon(
        plan.socket_path, engine_id, rank=0, initial_digest=layout_digest(initial)
    )
    return decide([finding]), attachment


def adopted(decision: Any, plan: GeometryPlan) -> tuple[int, Map]:
    from layout_ledger.core.startup_verdict import AdoptLayout

    if not isinstance(decision, AdoptLayout):
        raise EngineCheckError(f"{plan.geometry.name}: the engine did not adopt: {decision!r}")
    return decision.version, [list(row) for row in decision.physical_to_logical_map]


def replay_commits(
    plan: GeometryPlan, tensors: list[torch.Tensor], engine_id: str, start: tuple[int, Map]
) -> dict[str, Any]:
    """A's commits: begin, move in place, synchronize, commit, check; the measurements."""
    from sglang_integration.engine import client
    from sglang_integration.engine.rebalance_decisions import (
        BeginAction,
        check_commits,
        decide_begin,
    )

    geometry, device = plan.geometry, str(tensors[0].device)
    version, current = start
    slots_moved = bytes_moved = 0
    move_seconds = 0.0
    for commit in plan.moves.commits:
        begin = decide_begin([client.begin(plan.socket_path, engine_id, version, commit.layers)])
        if begin.action is not BeginAction.MOVE:
            raise EngineCheckError(f"begin at version {version}: {begin.action}: {begin.reason}")
        new_map = [list(row) for row in current]
        for layer, row in commit.rows.items():
            new_map[layer] = list(row)
        old_rows, new_rows = geometry.local_rows(current), geometry.local_rows(new_map)
        started = time.perf_counter()
        for layer in commit.layers:
            moved = move_layer([t[layer] for t in tensors], old_rows[layer], new_rows[layer])
            slots_moved, bytes_moved = slots_moved + moved[0], bytes_moved + moved[1]
        synchronize(device)
        move_seconds += time.perf_counter() - started
        reply = client.commit(plan.socket_path, engine_id, commit.rows)
        checked = check_commits([reply], base_version=version, engine_digest=layout_digest(new_map))
        if not checked.ok or checked.version is None:
            raise EngineCheckError(f"commit from version {version}: {list(checked.problems)}")
        version, current = checked.version, new_map
    return {
        "final_version": version,
        "final_map": current,
        "commits": len(plan.moves.commits),
        "slots_moved": slots_moved,
        "bytes_moved": bytes_moved,
        "move_seconds": move_seconds,
    }


def engine_a(order: EngineOrder, tensors: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    engine_id = f"gpu-check-A-{uuid.uuid4().hex[:8]}"
    report: dict[str, Any] = {"engine_id": engine_id}
    for plan in order.plans:
        geometry, mine = plan.geometry, tensors[plan.geometry.name]
        decision, attachment = start_layout(plan, engine_id)
        try:
            start = adopted(decision, plan)
            before = slot_counts(geometry, read_slots(geometry, mine), start[1])
            measured = replay_commits(plan, mine, engine_id, start)
            after = slot_counts(geometry, read_slots(geometry, mine), measured["final_map"])
        finally:
            if attachment is not None:
                attachment.close()
        report[geometry.name] = {
            "start_version": start[0],
            "right_before": before["right"],
            "right_after": after["right"],
            **measured,
        }
    return report


def engine_b(order: EngineOrder, tensors: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    engine_id = f"gpu-check-B-{uuid.uuid4().hex[:8]}"
    report: dict[str, Any] = {"engine_id": engine_id}
    for plan in order.plans:
        geometry = plan.geometry
        decision, attachment = start_layout(plan, engine_id)
        try:
            version, the_map = adopted(decision, plan)
            started = time.perf_counter()
            held = read_slots(geometry, tensors[geometry.name])
            seconds = time.perf_counter() - started
        finally:
            if attachment is not None:
                attachment.close()
        report[geometry.name] = {
            "version": version,
            "digest": layout_digest(the_map),
            "map": the_map,
            "read_seconds": seconds,
            **slot_counts(geometry, held, the_map),
        }
    return report


def engine_ignoring_record(
    order: EngineOrder, tensors: dict[str, list[torch.Tensor]]
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for plan in order.plans:
        geometry = plan.geometry
        initial = geometry.initial_map()
        held = read_slots(geometry, tensors[geometry.name])
        report[geometry.name] = {"map": initial, **slot_counts(geometry, held, initial)}
    return report


def framing_used() -> str:
    """Whose ``send_msg``/``recv_msg`` this process's client imported (none: never asked)."""
    framing = sys.modules.get("sglang.srt.weight_cache.protocol")
    if framing is None:
        return "none (no daemon request)"
    if getattr(framing, "STANDS_IN", False):
        return "stand-in (gpu_single.standin_framing)"
    return f"sglang's (sglang {importlib.metadata.version('sglang')})"


def run_engine(order: EngineOrder, channel: Connection) -> None:
    """Process target: map the memory, act as ``order.role``, report, exit."""
    try:
        if order.standin_framing:
            from gpu_single import standin_framing

            standin_framing.install()
        tensors = map_tensors(order.blob)
        first = next(iter(tensors.values()))[0]
        actions = {"A": engine_a, "B": engine_b, "ignored": engine_ignoring_record}
        report = actions[order.role](order, tensors)
        report.update(
            device=str(first.device), shared=bool(first.is_shared()), framing=framing_used()
        )
        channel.send({"event": "report", "role": order.role, **report})
    except Exception:
        channel.send({"event": "error", "role": order.role, "error": traceback.format_exc()})
