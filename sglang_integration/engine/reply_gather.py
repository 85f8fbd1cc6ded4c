"""All-gather of a small object over a gloo group in one collective, for the per-chunk path.

``torch.distributed.all_gather_object`` runs two collectives: the pickled sizes, then the bytes
padded to the largest. A chunk's begin and commit replies are small (a trimmed ``Reply`` pickles
to a few hundred bytes), so each rank sends a fixed ``SLOT_BYTES`` buffer instead: a 4-byte
length and the pickle, one collective (docs/benchmarks.md has what each costs).

Every rank sees every length, so a value too large for its slot on any rank makes all of them
take the same fallback (``all_gather_object``) and no rank is left in a collective alone. The
bytes are pickles from the engine's own ranks, as ``all_gather_object``'s are.
"""

from __future__ import annotations

import pickle
from typing import Any

SLOT_BYTES = 1024
_LENGTH_BYTES = 4


def all_gather_small(group: Any, value: Any) -> list[Any]:
    """``group.all_gather_object(value)`` (sglang's ``GroupCoordinator``), in one collective."""
    import torch
    import torch.distributed as dist

    world_size = int(group.world_size)
    if world_size == 1:
        return [value]
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    fits = len(payload) <= SLOT_BYTES - _LENGTH_BYTES
    mine = bytearray(SLOT_BYTES)
    mine[:_LENGTH_BYTES] = len(payload).to_bytes(_LENGTH_BYTES, "little")
    if fits:
        mine[_LENGTH_BYTES : _LENGTH_BYTES + len(payload)] = payload
    slots = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(slots, torch.frombuffer(mine, dtype=torch.uint8), group=group.cpu_group)
    received = [bytes(slot.numpy()) for slot in slots]
    lengths = [int.from_bytes(data[:_LENGTH_BYTES], "little") for data in received]
    if max(lengths) > SLOT_BYTES - _LENGTH_BYTES:
        gathered: list[Any] = group.all_gather_object(value)
        return gathered
    return [
        pickle.loads(data[_LENGTH_BYTES : _LENGTH_BYTES + length])
        for data, length in zip(received, lengths, strict=True)
    ]
