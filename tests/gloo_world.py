"""torch's default gloo group under the names sglang's ``GroupCoordinator`` gives it, for tests
whose rank processes join a real gloo world without building sglang's groups."""

from __future__ import annotations

from typing import Any


class WorldGroup:
    """torch's default gloo group under the names sglang's ``GroupCoordinator`` gives it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()
        self.ranks = list(range(self.world_size))
        self.cpu_group = dist.group.WORLD

    def all_gather_object(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered
