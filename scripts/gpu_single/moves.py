"""The commits engine A makes: what each moves (layers, new rows), in order.

- ``demo_case1_moves``: the CPU demo's case 1, as rank 0's daemon recorded it (sglang's real
  ``init_by_eplb`` on the demo's synthetic loads: 10 rebalances x 2 chunks of 4 layers),
  recorded by ``record_demo_moves.py`` into ``demo_case1_moves.json``. Replayed on the ``small``
  geometry, it gives the demo's counts.
- ``shuffled_moves``: for shapes the demo has no record of (one DeepSeek-V3 layer), each
  rebalance permutes the experts inside every EP rank's slots (seeded). On one GPU a move can
  only copy slots this GPU holds, so the set of experts per rank stays; which slot holds which
  expert changes, as an EPLB rebalance changes it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from gpu_single.geometry import ExpertGeometry
from layout_ledger.core.layout import Map, validate_map

DEMO_MOVES_PATH = Path(__file__).resolve().parent / "demo_case1_moves.json"


class MovesError(ValueError):
    """A recorded or generated move list that does not fit its geometry."""


@dataclass(frozen=True)
class Commit:
    """One chunk's commit: the layers it moves and their new rows (whole-map rows)."""

    layers: tuple[int, ...]
    rows: dict[int, list[int]]


@dataclass(frozen=True)
class MovePlan:
    """Engine A's commits on one geometry, and how many rebalances they make."""

    commits: tuple[Commit, ...]
    rebalances: int
    source: str

    @property
    def chunks_per_rebalance(self) -> int:
        return len(self.commits) // self.rebalances

    def final_map(self, initial: Map) -> Map:
        """The map after every commit, from ``initial``."""
        current = [list(row) for row in initial]
        for commit in self.commits:
            for layer, row in commit.rows.items():
                current[layer] = list(row)
        return current


def demo_case1_moves(geometry: ExpertGeometry, path: Path = DEMO_MOVES_PATH) -> MovePlan:
    """The CPU demo's case-1 commits, checked against ``geometry`` (the demo's shape)."""
    document = json.loads(path.read_text())
    shape = (document["num_layers"], document["num_physical_slots"])
    expected = (geometry.num_layers, geometry.num_physical_slots)
    if shape != expected or document["num_logical_experts"] != geometry.num_logical_experts:
        raise MovesError(f"{path} records a {shape} map, the geometry has {expected}")
    commits = []
    current = geometry.initial_map()
    for number, entry in enumerate(document["commits"], start=1):
        if entry["version"] != number:
            raise MovesError(f"{path}: commit {number} records version {entry['version']}")
        rows = {int(layer): [int(x) for x in row] for layer, row in entry["rows"].items()}
        layers = tuple(int(layer) for layer in entry["layers"])
        if sorted(rows) != sorted(layers):
            raise MovesError(f"{path}: commit {number}'s rows are not its layers")
        for layer, row in rows.items():
            current[layer] = row
        validate_map(current, geometry.layout_geometry())
        commits.append(Commit(layers, rows))
    return MovePlan(tuple(commits), int(document["rebalances"]), f"{path.name} (the CPU demo)")


def shuffled_moves(
    geometry: ExpertGeometry, rebalances: int, ep_size: int, seed: int = 7
) -> MovePlan:
    """``rebalances`` commits of every layer, each permuting the experts inside every EP rank's
    slots of the whole map (one chunk per rebalance)."""
    if geometry.num_physical_slots % ep_size != 0:
        raise MovesError(f"{geometry.num_physical_slots} slots do not divide by EP {ep_size}")
    per_rank = geometry.num_physical_slots // ep_size
    generator = random.Random(seed)
    current = geometry.initial_map()
    commits = []
    for _ in range(rebalances):
        rows = {}
        for layer, row in enumerate(current):
            new_row: list[int] = []
            for rank in range(ep_size):
                part = row[rank * per_rank : (rank + 1) * per_rank]
                shuffled = list(part)
                while shuffled == part:
                    generator.shuffle(shuffled)
                new_row += shuffled
            rows[layer] = new_row
            current[layer] = new_row
        commits.append(Commit(tuple(range(geometry.num_layers)), rows))
    return MovePlan(tuple(commits), rebalances, f"seeded shuffles inside each of {ep_size} ranks")
