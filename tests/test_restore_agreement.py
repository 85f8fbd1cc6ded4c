"""One layout per engine: the daemons of one engine agree on the restore before any of them loads.

Two real processes, each a daemon's rank with sglang's real world group on gloo (``publish`` of
real ``ServerArgs``, ``init_distributed_environment``: what ``WeightCacheDaemon._init_distributed``
builds before ``_initialize_eplb_expert_location_metadata``) and sglang's own initial expert
location metadata. For each scenario every rank opens its real ledger file, reads its offer, and
runs ``restore.restore_before_load`` over ``get_world_group()``: all restore the newest version
any of them committed, with the rows of the daemon that holds them, or all load the initial
layout with the reason. One module-scoped pair of processes runs every scenario in turn.
"""

from __future__ import annotations

import os
import random
import sqlite3
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import Geometry, Map, layout_digest, trivial_map
from layout_ledger.core.state import RestoredFrom
from layout_ledger.store.ledger import Ledger
from sglang_integration.testing.cpu_engine import (
    free_port,
    one_result_per_rank,
    write_tiny_moe_config,
)

pytestmark = pytest.mark.timeout(240)

RANKS, LAYERS, LOGICAL, REDUNDANT = 2, 3, 8, 2
GEOMETRY = Geometry(LAYERS, LOGICAL + REDUNDANT, LOGICAL)
INITIAL = trivial_map(LAYERS, LOGICAL + REDUNDANT, LOGICAL)
CHECKPOINT = "c" * 64


def maps(seed: int, count: int) -> list[Map]:
    """``count`` successive maps of one history (each moves one layer from the one before)."""
    rng, current, found = random.Random(seed), [list(row) for row in INITIAL], []
    for number in range(count):
        current = [list(row) for row in current]
        current[number % LAYERS] = [rng.randrange(LOGICAL) for _ in range(LOGICAL + REDUNDANT)]
        found.append(current)
    return found


def ledger_with(path: Path, history: list[Map]) -> None:
    """A ledger whose one incarnation committed ``history`` (versions 1..len)."""
    ledger = Ledger.open(path)
    record = ledger.start_incarnation(
        GEOMETRY, INITIAL, checkpoint_digest=CHECKPOINT, daemon_label="built by the test"
    )
    record.attach("engine-a")
    for the_map in history:
        changed = [
            layer
            for layer in range(LAYERS)
            if the_map[layer] != record.physical_to_logical_map()[layer]
        ]
        record.begin("engine-a", record.version, changed)
        record.commit("engine-a", {layer: the_map[layer] for layer in changed})
    ledger.close()


A, B = maps(1, 3), maps(2, 2)
SCENARIOS: dict[str, Any] = {
    # name: (rank 0's history or what lies at its path, rank 1's, RESTORE per rank)
    "same version on both": (A[:2], A[:2], ("last", "last")),
    "the mover died between the commits of version 3": (A, A[:2], ("last", "last")),
    "rank 1's ledger is new (a replaced GPU)": (A[:2], None, ("last", "last")),
    "version 2 names two maps": (A[:2], B, ("last", "last")),
    "rank 1's file is not a ledger": (A[:2], "not a ledger\n", ("last", "last")),
    "rank 1's rows were edited": (A[:2], "edited", ("last", "last")),
    "rank 1 runs with initial": (A[:2], A[:2], ("last", "initial")),
}


def _build(directory: Path) -> None:
    for name, (*histories, _) in SCENARIOS.items():
        scenario = directory / name.replace(" ", "_").replace("'", "")
        scenario.mkdir()
        for rank, history in enumerate(histories):
            path = scenario / f"rank{rank}.sqlite"
            if isinstance(history, list):
                ledger_with(path, history)
            elif history == "edited":
                ledger_with(path, A[:2])
                with sqlite3.connect(path) as conn:
                    conn.execute("UPDATE events SET reason = 'edited' WHERE kind = 'start'")
            elif isinstance(history, str):
                path.write_text(history)
                path.chmod(0o600)


def _daemon_rank(rank: int, port: int, model_dir: str, directory: str, out: Connection) -> None:
    """One daemon rank: sglang's world group, then each scenario's agreement in turn."""
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    from layout_ledger.store.retention import Retention
    from sglang_integration.daemon.restore import open_before_load, restore_before_load
    from sglang_integration.settings import RESTORE
    from sglang_integration.testing.cpu_engine import start_cpu_engine_rank

    start_cpu_engine_rank(
        rank, world_size=RANKS, port=port, model_dir=model_dir, num_redundant=REDUNDANT
    )
    metadata = get_global_expert_location_metadata()
    initial_map = metadata.physical_to_logical_map.tolist()
    geometry = Geometry(
        int(metadata.num_layers),
        int(metadata.num_physical_experts),
        int(metadata.num_logical_experts),
    )
    results = {}
    for name, (*_, modes) in SCENARIOS.items():
        os.environ[RESTORE.env] = modes[rank]
        path = Path(directory) / name.replace(" ", "_").replace("'", "") / f"rank{rank}.sqlite"
        opened = open_before_load(str(path), Retention(keep_versions=100, prune_every=100))
        plan = restore_before_load(
            opened,
            get_world_group(),
            geometry=geometry,
            checkpoint_digest=CHECKPOINT,
            initial_map=initial_map,
        )
        results[name] = {
            "restored_from": plan.restored_from,
            "map": plan.physical_to_logical_map,
            "reason": getattr(plan.verdict, "reason", None),
            "opened": opened.ledger is not None,
        }
        if opened.ledger is not None:
            opened.ledger.close()
    out.send((geometry, initial_map, results))


@pytest.fixture(scope="module")
def agreed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    directory = tmp_path_factory.mktemp("agreement")
    _build(directory)
    model_dir = write_tiny_moe_config(directory / "model", LAYERS, LOGICAL)
    port = free_port()
    results = one_result_per_rank(
        RANKS, _daemon_rank, lambda rank: (rank, port, str(model_dir), str(directory))
    )
    return directory, results


def _of(agreed: tuple[Path, list[Any]], name: str) -> list[dict[str, Any]]:
    return [results[name] for _, _, results in agreed[1]]


def _ledger(agreed: tuple[Path, list[Any]], name: str, rank: int) -> str:
    return str(agreed[0] / name.replace(" ", "_").replace("'", "") / f"rank{rank}.sqlite")


def test_the_daemons_see_sglangs_geometry_and_initial_layout(agreed: Any) -> None:
    for geometry, initial_map, _ in agreed[1]:
        assert (geometry, initial_map) == (GEOMETRY, INITIAL)


def test_daemons_at_one_version_each_restore_it_from_their_own_ledger(agreed: Any) -> None:
    digest = layout_digest(A[1])
    for rank, found in enumerate(_of(agreed, "same version on both")):
        assert found["restored_from"] == RestoredFrom(1, 2, digest), rank
        assert found["map"] == A[1]


def test_all_restore_the_newest_version_any_committed_with_the_rows_of_its_holder(
    agreed: Any,
) -> None:
    for name in (
        "the mover died between the commits of version 3",
        "rank 1's ledger is new (a replaced GPU)",
    ):
        rank0, rank1 = _of(agreed, name)
        the_map = A[2] if "mover" in name else A[1]
        version = 3 if "mover" in name else 2
        digest = layout_digest(the_map)
        assert rank0["restored_from"] == RestoredFrom(1, version, digest)
        assert rank1["restored_from"] == RestoredFrom(
            1, version, digest, source=f"rank 0's ledger {_ledger(agreed, name, 0)}"
        )
        assert rank0["map"] == rank1["map"] == the_map


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("version 2 names two maps", "the ledgers name version 2 with different maps: rank 0"),
        (
            "rank 1's file is not a ledger",
            "a ledger cannot be read or its rows do not verify: rank 1 (ledger ",
        ),
        ("rank 1's rows were edited", "its rows do not verify: the events' chain breaks"),
        ("rank 1 runs with initial", "--expert-layout-restore initial on rank 1"),
    ],
)
def test_daemons_that_cannot_agree_all_load_the_initial_layout_with_the_reason(
    agreed: Any, name: str, reason: str
) -> None:
    found = _of(agreed, name)
    for rank in range(RANKS):
        assert found[rank]["restored_from"] is None
        assert found[rank]["map"] == INITIAL
        assert reason in found[rank]["reason"], found[rank]["reason"]
    assert found[0]["reason"] == found[1]["reason"]
    if name == "rank 1's file is not a ledger":
        assert [f["opened"] for f in found] == [True, False]  # it took part all the same
