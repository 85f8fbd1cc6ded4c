"""All-gather of small objects through the group's first rank: a few steps whatever its size.

gloo's ``all_gather`` is a ring, each rank receiving from the one before it: ``EP - 1`` steps,
each waiting for the last (gloo's ``allgather.cc``), and ``all_gather_object`` runs two of them
(the pickled sizes, then the pickles padded to the largest). Its ``gather`` sends each rank's
buffer straight to the root, one step, and its ``broadcast`` is a binomial tree,
``ceil(log2 EP)`` steps (``broadcast.cc``). For the few hundred bytes a rank sends to decide an
engine's start (``finding_gather``), the steps are the cost: a gather to the first rank and its
broadcast of every rank's buffer take ``1 + ceil(log2 EP)`` steps (7 at EP 64) where
``all_gather_object`` takes ``2 (EP - 1)`` (126); every rank still receives every rank's bytes,
``EP`` slots, linear in the ranks.

Each rank sends a fixed ``SLOT_BYTES`` slot: a 4-byte length, then its pickle when it fits.
The broadcast carries every slot, so every rank sees every length: when a pickle did not fit
(a content finding with the recorded fingerprints of the rank's slots), every rank takes the
same second round, its pickle padded to the longest, gathered and broadcast the same way, and
no rank is left in a collective alone. The bytes are pickles from the engine's own ranks, as
``all_gather_object``'s are.
"""

from __future__ import annotations

import pickle
from typing import Any

SLOT_BYTES = 2048
_LENGTH_BYTES = 4


def all_gather_through_root(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank of ``group`` (sglang's
    ``GroupCoordinator``: ``world_size``, ``rank_in_group``, ``ranks``, ``cpu_group``)."""
    world_size = int(group.world_size)
    if world_size == 1:
        return [value]
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    slot = bytearray(SLOT_BYTES)
    slot[:_LENGTH_BYTES] = len(payload).to_bytes(_LENGTH_BYTES, "little")
    if len(payload) <= SLOT_BYTES - _LENGTH_BYTES:
        slot[_LENGTH_BYTES : _LENGTH_BYTES + len(payload)] = payload
    slots = _through_root(group, slot, world_size)
    lengths = [int.from_bytes(each[:_LENGTH_BYTES], "little") for each in slots]
    longest = max(lengths)
    if longest <= SLOT_BYTES - _LENGTH_BYTES:
        return [
            pickle.loads(each[_LENGTH_BYTES : _LENGTH_BYTES + length])
            for each, length in zip(slots, lengths, strict=True)
        ]
    padded = bytearray(longest)
    padded[: len(payload)] = payload
    return [
        pickle.loads(each[:length])
        for each, length in zip(_through_root(group, padded, world_size), lengths, strict=True)
    ]


def _through_root(group: Any, mine: bytearray, world_size: int) -> list[bytes]:
    """Every rank's equally long ``mine``: gathered on the group's first rank, broadcast."""
    import torch
    import torch.distributed as dist

    size = len(mine)
    root = int(group.ranks[0])
    every = torch.empty(size * world_size, dtype=torch.uint8)
    parts = list(every.split(size)) if int(group.rank_in_group) == 0 else None
    dist.gather(torch.frombuffer(mine, dtype=torch.uint8), parts, dst=root, group=group.cpu_group)
    dist.broadcast(every, src=root, group=group.cpu_group)
    received = every.numpy().tobytes()
    return [received[index * size : (index + 1) * size] for index in range(world_size)]
