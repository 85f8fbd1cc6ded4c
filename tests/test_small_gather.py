"""The per-chunk all-gather gives every rank exactly what ``all_gather_object`` would, over gloo.

Two real processes in a real gloo group. The group object is torch's own process group with the
three attributes of sglang's ``GroupCoordinator`` that the function uses (its ``cpu_group`` is a
gloo group like this one); the rebalance tests run it through sglang's real world group.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import reply_gather as small_gather
from sglang_integration.testing.cpu_engine import free_port, one_result_per_rank
from sglang_integration.testing.sglang_env import set_quiet_sglang_env


class _Group:
    """torch's default gloo group under the names sglang's ``GroupCoordinator`` gives it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world_size = dist.get_world_size()
        self.cpu_group = dist.group.WORLD

    def all_gather_object(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered


def _rank(rank: int, port: int, values: list[Any], out: Connection) -> None:
    import torch.distributed as dist

    set_quiet_sglang_env()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = _Group()
        out.send([small_gather.all_gather_small(group, value(rank)) for value in values])
    finally:
        dist.destroy_process_group()


def _small(rank: int) -> Reply:
    return Reply(Outcome.OK, body={"status": "ok", "version": 7, "digest": "ab" * 32, "rank": rank})


def _large_on_rank_1(rank: int) -> list[int]:
    return list(range(10 if rank == 0 else 5 * small_gather.SLOT_BYTES))


def _empty(rank: int) -> None:
    return None


def test_every_rank_gets_what_all_gather_object_gives_including_a_value_too_large_for_a_slot():
    port = free_port()
    values = [_small, _large_on_rank_1, _empty, _small]
    results = one_result_per_rank(2, _rank, lambda rank: (rank, port, values))
    expected = [[value(rank) for rank in range(2)] for value in values]
    assert results == [expected, expected]
