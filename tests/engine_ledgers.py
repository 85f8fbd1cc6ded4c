"""The ledgers of one engine's ranks, written by the ledger's own writer in this process.

``EngineLedgers(directory, ranks)`` opens one ``Ledger`` per rank (``rank-NN.sqlite``), each
started with the origin a daemon records (this host, TP and EP rank, a device UUID, a socket),
and keeps them open: this process holds each one's writer lock, as each rank's running daemon
would, so ``fleet`` sees every daemon running. ``commit_all`` moves experts on every rank as
one engine does (the same rows, so the same digests); ``restart`` ends a rank's incarnation
and starts a new one at version 0, as a restarted daemon does.
"""

from __future__ import annotations

import socket
from pathlib import Path

from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin

GEOMETRY = Geometry(num_layers=4, num_physical_slots=6, num_logical_experts=4)
ENGINE = "engine-a"
# The rows of consecutive moves: move n rotates every layer's row by n + 1.
BASE_ROW = [0, 1, 2, 3, 0, 1]


def moved_row(move: int) -> list[int]:
    by = (move + 1) % len(BASE_ROW)
    return BASE_ROW[by:] + BASE_ROW[:by]


def origin_of(rank: int) -> IncarnationOrigin:
    return IncarnationOrigin.of_this_process(
        device_uuid=f"GPU-{rank:04d}",
        gpu_id=rank % 8,
        tp_rank=rank,
        pp_rank=0,
        ep_rank=rank,
        socket_path=f"/tmp/sglang_weight_cache_GPU-{rank:04d}.sock",
    )


class EngineLedgers:
    """One open ledger per rank (see the module docstring)."""

    def __init__(self, directory: Path, ranks: int) -> None:
        self.paths = [directory / f"rank-{rank:02d}.sqlite" for rank in range(ranks)]
        self.ledgers: list[Ledger] = []
        self.records: list[LayoutRecord] = []
        for rank, path in enumerate(self.paths):
            ledger = Ledger.open(path)
            self.ledgers.append(ledger)
            self.records.append(self._start(rank))

    def _start(self, rank: int) -> LayoutRecord:
        initial = trivial_map(
            GEOMETRY.num_layers, GEOMETRY.num_physical_slots, GEOMETRY.num_logical_experts
        )
        record = self.ledgers[rank].start_incarnation(
            GEOMETRY, initial, config_fingerprint=f"fp-{rank}", origin=origin_of(rank)
        )
        record.attach(ENGINE)
        return record

    def commit(self, rank: int, layers: tuple[int, ...] = (0, 1)) -> int:
        """One begin + commit on ``rank``; the move's rows depend only on its version."""
        record = self.records[rank]
        move = record.version
        record.begin(ENGINE, record.version, list(layers))
        version, _ = record.commit(ENGINE, {layer: moved_row(move) for layer in layers})
        return version

    def commit_all(self, times: int = 1) -> None:
        for _ in range(times):
            for rank in range(len(self.records)):
                self.commit(rank)

    def begin(self, rank: int, layers: tuple[int, ...] = (2, 3)) -> None:
        record = self.records[rank]
        record.begin(ENGINE, record.version, list(layers))

    def leave_mid_move(self, rank: int) -> None:
        """The engine detaches with its move pending: the daemon is dirty."""
        self.begin(rank)
        self.records[rank].detach(ENGINE)

    def restart(self, rank: int) -> None:
        """The daemon stops cleanly and starts again: a new incarnation at version 0."""
        self.ledgers[rank].end_incarnation()
        self.records[rank] = self._start(rank)

    def close(self) -> None:
        for ledger in self.ledgers:
            ledger.close()


def this_host() -> str:
    return socket.gethostname()
