"""The small all-gather through the first rank gives every rank what ``all_gather_object`` would.

Real processes in a real gloo group (2 and 3 ranks: a binomial broadcast over an odd size). The
group object is torch's own process group under the names of sglang's ``GroupCoordinator`` the
function reads (its ``cpu_group`` is a gloo group like this one); the rebalance and startup tests
run it through sglang's real world group and the agents' own group.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import pytest
from gloo_world import WorldGroup

from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import reply_gather as small_gather
from sglang_integration.testing.cpu_engine import free_port, one_result_per_rank
from sglang_integration.testing.sglang_env import set_quiet_sglang_env


def _rank(rank: int, size: int, port: int, values: list[Any], out: Connection) -> None:
    import torch.distributed as dist

    set_quiet_sglang_env()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        group = WorldGroup()
        out.send([small_gather.all_gather_small(group, value(rank)) for value in values])
    finally:
        dist.destroy_process_group()


def _small(rank: int) -> Reply:
    return Reply(Outcome.OK, body={"status": "ok", "version": 7, "digest": "ab" * 32, "rank": rank})


def _large_beyond_rank_0(rank: int) -> list[int]:
    return list(range(10 if rank == 0 else 5 * small_gather.SLOT_BYTES))


def _empty(rank: int) -> None:
    return None


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_what_all_gather_object_gives_including_a_value_too_large_for_a_slot(
    size: int,
) -> None:
    port = free_port()
    values = [_small, _large_beyond_rank_0, _empty, _small]
    results = one_result_per_rank(size, _rank, lambda rank: (rank, size, port, values))
    expected = [[value(rank) for rank in range(size)] for value in values]
    assert results == [expected] * size
