"""What an engine's ranks all-gather at startup: what the decision needs, never a map a rank holds.

Real engine ranks (gloo groups of 2 and 4, sglang's real hooked startup method,
``EngineRanks``), one real model-less daemon per rank; each rank records the values its world
group all-gathers during the start (``record_gathers``). Every rank attaches to its own daemon
and holds that daemon's map: where the daemons agree, no map travels and the start is one
all-gather; where they disagree, one map per layout travels (from the lowest rank holding it)
and the engine still converges; a daemon's current slot content travels only where a daemon is
dirty (a repair reads it), never its map otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_engine_startup_hook import EngineRanks, sglang_context
from test_engine_startup_ranks import (
    FIRST_MOVE,
    INITIAL,
    NUM_LAYERS,
    NUM_LOGICAL,
    NUM_REDUNDANT,
    NUM_SLOTS,
    SECOND_MOVE,
    after,
    daemons,
    move,
    scenario,
    wait_until_dirty,
)

from layout_ledger.core.layout import layout_digest
from sglang_integration.testing.cpu_engine import write_tiny_moe_config
from sglang_integration.testing.daemon_control import DaemonProcess, EngineStandIn, start_daemon
from sglang_integration.testing.shared_experts import ExpertTensorShape, create_shared_experts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_config(tmp_path_factory.mktemp("model") / "moe", NUM_LAYERS, NUM_LOGICAL)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[EngineRanks]:
    sglang_context()
    with EngineRanks(
        request.param, model_dir, enable_eplb=True, ep_num_redundant_experts=NUM_REDUNDANT
    ) as engine_ranks:
        yield engine_ranks


def maps_in(value: Any) -> list[Any]:
    """Every physical-to-logical map (``NUM_LAYERS`` rows of ``NUM_SLOTS`` ints) in ``value``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [m for f in dataclasses.fields(value) for m in maps_in(getattr(value, f.name))]
    if isinstance(value, Mapping):
        return [m for each in value.values() for m in maps_in(each)]
    if isinstance(value, list | tuple):
        if len(value) == NUM_LAYERS and all(
            isinstance(row, list | tuple)
            and len(row) == NUM_SLOTS
            and all(isinstance(v, int) for v in row)
            for row in value
        ):
            return [value]
        return [m for each in value for m in maps_in(each)]
    return []


def gathers_of(report: dict[str, Any]) -> list[tuple[Any, list[Any]]]:
    assert report["error"] is None, report.get("traceback")
    gathers: list[tuple[Any, list[Any]]] = report["gathers"]
    return gathers


def test_the_start_gathers_no_map_where_the_daemons_agree(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        for daemon in started:
            move(daemon, FIRST_MOVE, SECOND_MOVE)
        reports = ranks.run(scenario(started, model_dir=model_dir, record_gathers=True))
    expected = after(FIRST_MOVE, SECOND_MOVE)
    for report in reports:
        gathers = gathers_of(report)
        assert report["map"] == expected  # each rank routes with the map its own daemon sent
        assert report["session"]["version"] == 2
        (only,) = gathers  # one all-gather: versions and digests, and they agree
        sent, received = only
        assert maps_in(sent) == [] and maps_in(received) == []
        findings = [finding for finding, _, _ in received]
        assert [(f.rank, f.version, f.digest) for f in findings] == [
            (rank, 2, layout_digest(expected)) for rank in range(ranks.world_size)
        ]


def test_where_daemons_disagree_one_map_per_layout_travels_and_the_engine_converges(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    """The first half of the daemons at version 1, the second at version 2: the engine plans
    its convergence from both maps, each sent once, by the lowest rank holding it (the move to
    version 2 comes once the weights are loaded; until then it routes with what is held)."""
    half = ranks.world_size // 2
    with daemons(tmp_path, ["ledger"] * ranks.world_size) as started:
        for rank, daemon in enumerate(started):
            move(daemon, FIRST_MOVE, *([SECOND_MOVE] if rank >= half else []))
        reports = ranks.run(scenario(started, model_dir=model_dir, record_gathers=True))
    held = after(FIRST_MOVE)
    held[1][half * (NUM_SLOTS // ranks.world_size) :] = SECOND_MOVE[1][NUM_SLOTS // 2 :]
    sent_maps = [None] * ranks.world_size
    sent_maps[0], sent_maps[half] = after(FIRST_MOVE), after(FIRST_MOVE, SECOND_MOVE)
    for rank, report in enumerate(reports):
        first, second, *_ = gathers_of(report)
        assert maps_in(first[0]) == [] and maps_in(first[1]) == []
        assert second[1] == sent_maps
        assert report["map"] == held
        own = after(FIRST_MOVE, *([SECOND_MOVE] if rank >= half else []))
        assert (report["session"]["version"], report["session"]["digest"]) == (
            1 + (rank >= half),
            layout_digest(own),
        )
        assert report["session"]["converging_to"] == 2


@contextlib.contextmanager
def content_daemons(directory: Path, world_size: int) -> Iterator[list[DaemonProcess]]:
    """One model-less daemon per rank serving its rank's expert files (it fingerprints them at
    load, at each commit and on the engine's content check), all at the initial layout."""
    shape = ExpertTensorShape(NUM_LAYERS, NUM_LOGICAL, NUM_SLOTS, world_size)
    started: list[DaemonProcess] = []
    try:
        for rank in range(world_size):
            create_shared_experts(directory / "experts", rank, shape, INITIAL)
            started.append(
                start_daemon(
                    directory,
                    f"rank{rank}",
                    num_layers=NUM_LAYERS,
                    num_logical_experts=NUM_LOGICAL,
                    num_physical_experts=NUM_SLOTS,
                    extra=["--experts", str(directory / "experts"), "--expert-rank", str(rank)],
                )
            )
        yield started
    finally:
        for daemon in started:
            daemon.stop()


def contents_of(received: Sequence[Any]) -> list[Any]:
    return [value[1] if isinstance(value, tuple) else value for value in received]


def test_recorded_fingerprints_travel_but_no_map_and_no_current_content_while_no_daemon_is_dirty(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    with content_daemons(tmp_path, ranks.world_size) as started:
        reports = ranks.run(scenario(started, model_dir=model_dir, record_gathers=True))
    local = NUM_SLOTS // ranks.world_size
    for report in reports:
        (only,) = gathers_of(report)
        assert maps_in(only[1]) == []
        for rank, content in enumerate(contents_of(only[1])):
            assert content.view is not None, content
            assert content.view.current == {}
            assert content.view.first_slot == rank * local
            assert sorted(content.view.recorded) == list(range(NUM_LAYERS))
        assert report["map"] == INITIAL


def test_a_dirty_daemons_current_content_travels_for_its_repair(
    ranks: EngineRanks, model_dir: Path, tmp_path: Path
) -> None:
    """An engine left every daemon mid-move (SIGKILL after its begins): the ranks gather every
    daemon's whole content finding, current fingerprints and map included, and repair them."""
    with content_daemons(tmp_path, ranks.world_size) as started:
        doomed = [EngineStandIn.start(d.socket_path, "doomed-engine") for d in started]
        for stand_in in doomed:
            assert stand_in.begin(0, [1]).ok
        for stand_in, daemon in zip(doomed, started, strict=True):
            stand_in.kill()
            wait_until_dirty(daemon)
        reports = ranks.run(scenario(started, model_dir=model_dir, record_gathers=True))
    for report in reports:
        first, second, *_ = gathers_of(report)
        assert all(c.view.current == {} for c in contents_of(first[1]))
        assert all(
            sorted(c.view.current) == list(range(NUM_LAYERS))
            and c.view.physical_to_logical_map == INITIAL
            for c in contents_of(second[1])
        )
        assert report["map"] == INITIAL
        assert report["session"]["version"] == 1  # repaired: recorded as a new version
