"""The plugin's gloo groups: the agents' connects lazily, and the switch never outlives it.

Real processes in a real gloo group of 2 (``torch.distributed``). The agents' group is made with
torch's lazy-connection switch (``TORCH_GLOO_LAZY_INIT``, read when a group is made, an
environment variable with no argument for it): set only while the group is made, so that groups
sglang or the standby's gate make afterwards connect as they always did, and put back as it was.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import pytest

from sglang_integration.engine import gloo_groups
from sglang_integration.engine.rebalance_agent import PluginGroup
from sglang_integration.testing.cpu_engine import free_port, one_result_per_rank
from sglang_integration.testing.sglang_env import set_quiet_sglang_env


class _World:
    """torch's default gloo group under the names of sglang's ``GroupCoordinator``."""

    def __init__(self, rank: int) -> None:
        self.world_size, self.rank_in_group, self.ranks = 2, rank, [0, 1]


def _rank(rank: int, port: int, before: str | None, out: Connection) -> None:
    import torch.distributed as dist

    set_quiet_sglang_env()
    if before is None:
        os.environ.pop(gloo_groups.LAZY_INIT, None)
    else:
        os.environ[gloo_groups.LAZY_INIT] = before
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = _World(rank)
        lazy = gloo_groups.new_gloo_group(world, 60, connect_lazily=True)
        after_lazy = os.environ.get(gloo_groups.LAZY_INIT)
        eager = gloo_groups.new_gloo_group(world, 60)
        group = PluginGroup(lazy, 2, rank, [0, 1])
        group.connect_in_the_background()
        gathered: list[Any] = group.all_gather(("agent", rank))
        dist.barrier(group=eager)
        group.destroy()
        out.send((after_lazy, gathered))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("before", [None, "0"], ids=["unset", "set-to-0"])
def test_the_lazy_switch_is_put_back_as_it_was_and_the_lazy_group_gathers(
    before: str | None,
) -> None:
    port = free_port()
    results = one_result_per_rank(2, _rank, lambda rank: (rank, port, before))
    assert results == [(before, [("agent", 0), ("agent", 1)])] * 2
