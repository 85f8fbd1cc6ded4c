"""All-gather of small objects over a gloo group through its first rank: a few steps at any size.

The engine's ranks all-gather small values: the findings that decide a start
(``finding_gather``), each rebalance chunk's begin and commit replies (the agents', on their
own group, and the converging move's). ``torch.distributed.all_gather_object`` runs two ring
collectives, the pickled sizes then the pickles padded to the largest; gloo's ring
(``allgather.cc``) takes ``EP - 1`` steps, each waiting for the rank before. A gather sends each
rank's buffer straight to the root (one step) and gloo's broadcast is a binomial tree
(``broadcast.cc``, ``ceil(log2 EP)`` steps), so a gather to the group's first rank and its
broadcast of every rank's buffer take ``1 + ceil(log2 EP)`` steps: 3 at EP 4 and 7 at EP 64,
where ``all_gather_object`` takes 6 and 126 (docs/benchmarks.md has what each costs). Every rank
still receives every rank's bytes: ``EP`` slots, linear in the ranks.

Each rank sends a fixed ``SLOT_BYTES`` slot: a 4-byte length, then its pickle when it fits (a
trimmed ``Reply`` or a start's finding pickles to a few hundred bytes). Every rank sees every
length, so when a pickle did not fit (a content finding with the recorded fingerprints of its
rank's slots) every rank takes the same second round, its pickle padded to the longest,
gathered and broadcast the same way, and no rank is left in a collective alone. The bytes are
pickles from the engine's own ranks, as ``all_gather_object``'s are.
"""

from __future__ import annotations

import pickle
from typing import Any

SLOT_BYTES = 2048
_LENGTH_BYTES = 4


def all_gather_small(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank of ``group``: what
    ``group.all_gather_object(value)`` gives, through the group's first rank. ``group`` has the
    names of sglang's ``GroupCoordinator`` used here: ``world_size``, ``rank_in_group``,
    ``ranks`` (the global ranks, the first is the root) and ``cpu_group`` (gloo)."""
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
    parts = (
        [every[index * size : (index + 1) * size] for index in range(world_size)]
        if int(group.rank_in_group) == 0
        else None
    )
    dist.gather(torch.frombuffer(mine, dtype=torch.uint8), parts, dst=root, group=group.cpu_group)
    dist.broadcast(every, src=root, group=group.cpu_group)
    received = every.numpy().tobytes()
    return [received[index * size : (index + 1) * size] for index in range(world_size)]
