"""Stage 1's rows: what was expected and what the processes reported (``ipc_stage._run``'s
facts). One table per geometry holds the CPU demo's case-1 rows; the setup table holds what is
common (device, memory, IPC handles, daemons, ledgers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_single import daemons
from gpu_single.engines import GeometryPlan
from gpu_single.expert_bytes import count_matching
from gpu_single.geometry import ExpertGeometry, human_bytes
from gpu_single.results import Stage

# The function torch's reduction names for each device's shared tensors.
EXPECTED_REBUILD = {"cuda": "rebuild_cuda_tensor", "cpu": "rebuild_storage_filename"}


def _slots(count: int, geometry: ExpertGeometry) -> str:
    return f"{count}/{geometry.total_local_slots}"


def _each(values: Sequence[Any]) -> str:
    return ", ".join(str(value) for value in values)


def setup_rows(
    stage: Stage,
    device: str,
    daemon_kind: str,
    geometries: Sequence[ExpertGeometry],
    facts: dict[str, Any],
) -> None:
    holder = facts["holder"]
    stage.info("device the holder allocated on", holder["device_name"])
    for geometry in geometries:
        stage.info(
            f"holder's experts, {geometry.name}",
            f"{human_bytes(geometry.total_bytes)} ({geometry.total_local_slots} slots x "
            f"{human_bytes(geometry.slot_bytes)})",
        )
    stage.info("holder: allocate + fill + serialize handles", f"{holder['seconds']:.2f} s")
    wanted = EXPECTED_REBUILD[device]
    stage.check(
        "the IPC handles engines rebuild from (torch's reductions)",
        wanted,
        f"{_each(holder['rebuild'])} ({holder['handles_bytes']} bytes of handles)",
        wanted in holder["rebuild"],
    )
    engine_devices = [facts[role]["device"] for role in ("A", "B", "ignored")]
    stage.check(
        "engines A, B, B-ignoring-the-record mapped the memory on",
        f"{device} (x3)",
        _each(engine_devices),
        all(found.startswith(device) for found in engine_devices),
    )
    exits = [facts[role]["exit_code"] for role in ("A", "B", "ignored")]
    stage.check("engine processes' exit codes", "0, 0, 0", _each(exits), exits == [0, 0, 0])
    framing = [facts[role]["framing"] for role in ("A", "B")]
    framing_wanted = "stand-in" if daemon_kind == daemons.LEDGER_SERVICE else "sglang's"
    stage.check(
        "framing the engines' client (sglang_integration.engine.client) used, A and B",
        framing_wanted,
        _each(framing),
        all(found.startswith(framing_wanted) for found in framing),
    )
    stage.info("daemons (one per geometry, each its own ledger)", daemon_kind)
    if daemon_kind == daemons.LEDGER_SERVICE:
        stage.notes.append(daemons.STAND_IN_NOTE)
    stage.info("daemons ready after", _each(f"{s:.1f} s" for s in facts["daemon_wait"]))
    _daemon_end_rows(stage, facts)


def _daemon_end_rows(stage: Stage, facts: dict[str, Any]) -> None:
    codes = facts["daemon_exit"]
    stage.check(
        "daemons' exit codes after SIGTERM",
        _each([0] * len(codes)),
        _each(codes),
        all(code == 0 for code in codes),
    )
    ends = [state.get("end_state") for state in facts["after_stop"]]
    stage.check(
        "ledgers after the daemons stopped: incarnation ended (layout-ledger status)",
        _each(["clean"] * len(ends)),
        _each(ends),
        all(end == "clean" for end in ends),
    )
    verified = facts["verify"]
    stage.check(
        "layout-ledger verify, exit code",
        _each([0] * len(verified)),
        _each(verified),
        all(code == 0 for code in verified),
    )


def geometry_rows(stage: Stage, plan: GeometryPlan, facts: dict[str, Any]) -> None:
    """The CPU demo's case-1 rows, for one geometry."""
    geometry, name = plan.geometry, plan.geometry.name
    index = [p.geometry.name for p in facts["plans"]].index(name)
    a, b, ignored = facts["A"][name], facts["B"][name], facts["ignored"][name]
    commits = len(plan.moves.commits)
    final = plan.moves.final_map(geometry.initial_map())
    _engine_a_rows(stage, plan, a, final)
    status = facts["after_A"][index]
    stage.check(
        "daemon version after A exited (layout-ledger status)",
        commits,
        status.get("version"),
        status.get("version") == commits,
    )
    stage.check(
        "engines attached after A exited",
        "none",
        _each(status.get("attached", [])) or "none",
        status.get("attached") == [],
    )
    stage.check(
        "B adopts the ledger's version at startup", commits, b["version"], b["version"] == commits
    )
    stage.check(
        "B's map = A's last map",
        "yes",
        "yes" if b["map"] == a["final_map"] else "no",
        b["map"] == a["final_map"],
    )
    every = _slots(geometry.total_local_slots, geometry)
    stage.check(
        "B: slots holding the expert B's map names",
        every,
        _slots(b["right"], geometry),
        b["right"] == geometry.total_local_slots,
    )
    stage.check(
        "B: slots read wrongly", _slots(0, geometry), _slots(b["wrong"], geometry), b["wrong"] == 0
    )
    _ignored_rows(stage, geometry, final, ignored)
    held = facts["holder_held"][name]
    stage.check(
        "the holder's own tensors hold A's last layout",
        every,
        _slots(count_matching(held, geometry.local_rows(final)), geometry),
        count_matching(held, geometry.local_rows(final)) == geometry.total_local_slots,
    )
    stage.notes.append(f"engine A's commits: {plan.moves.source}")


def _engine_a_rows(
    stage: Stage, plan: GeometryPlan, a: dict[str, Any], final: list[list[int]]
) -> None:
    geometry, moves = plan.geometry, plan.moves
    every = _slots(geometry.total_local_slots, geometry)
    stage.check("A starts at the daemon's version", 0, a["start_version"], a["start_version"] == 0)
    stage.check(
        "A: slots holding the expert A routes to, before its moves",
        every,
        _slots(a["right_before"], geometry),
        a["right_before"] == geometry.total_local_slots,
    )
    stage.check(
        "A: rebalances x chunks, each begin, move in place, commit checked",
        f"{moves.rebalances} x {moves.chunks_per_rebalance} = {len(moves.commits)} commits",
        f"{a['commits']} commits, version {a['final_version']}",
        a["commits"] == len(moves.commits) and a["final_version"] == len(moves.commits),
    )
    stage.check(
        "A's last map = the plan's",
        "yes",
        "yes" if a["final_map"] == final else "no",
        a["final_map"] == final,
    )
    stage.check(
        "A: slots holding the expert A routes to, after its moves",
        every,
        _slots(a["right_after"], geometry),
        a["right_after"] == geometry.total_local_slots,
    )
    seconds = a["move_seconds"]
    rate = a["bytes_moved"] / seconds / 1e9 if seconds > 0 else 0.0
    stage.info(
        "A: slot copies in place, bytes, time on the device",
        f"{a['slots_moved']} slots, {human_bytes(a['bytes_moved'])}, {seconds * 1e3:.1f} ms "
        f"({rate:.1f} GB/s written)",
    )


def _ignored_rows(
    stage: Stage, geometry: ExpertGeometry, final: list[list[int]], ignored: dict[str, Any]
) -> None:
    initial = geometry.local_rows(geometry.initial_map())
    moved = geometry.total_local_slots - count_matching(geometry.local_rows(final), initial)
    stage.info("B ignoring the plugin's record routes with", "the initial layout")
    stage.check(
        "B ignoring the record: slots read wrongly (the bug)",
        f"{_slots(moved, geometry)} (the moved slots)",
        _slots(ignored["wrong"], geometry),
        ignored["wrong"] == moved and moved > 0,
    )
