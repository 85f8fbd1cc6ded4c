"""Expert bytes that name their expert, written, read and moved on any torch device.

Every slot of every tensor is read as 32-bit words (an ``int32`` view of its bytes, whatever the
tensor's dtype: fp8, bf16, fp32). The words of logical expert ``e`` of layer ``l`` in tensor
``k`` are ``base_k[j] XOR seed(l, e)``, with word 0 replaced by ``e``:

- ``base_k`` is a fixed pseudo-random sequence per tensor index (:func:`base_words`);
- ``seed(l, e)`` is a 31-bit value that differs for every (layer, expert) pair, so two experts
  differ in *every* word but the first, and a slot holding part of one expert and part of
  another matches neither.

A reader takes word 0 of the first tensor as the slot's claimed expert and accepts it only when
every word of every tensor of the slot equals that expert's words (:func:`held_experts`): a
half-moved or torn slot reads as ``HOLDS_NO_EXPERT``. Every operation is one vectorized torch
call per (layer, tensor) on the tensors' own device; nothing is copied to the host but the ids.

Moves are gathers of whole slots in place (:func:`move_layer`): the bytes of slot ``src[s]``
are copied into slot ``s`` for every tensor, through the caller's own mapping of the memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HOLDS_NO_EXPERT = -1
_MASK = 0x7FFFFFFF
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant (odd: a bijection mod 2**31)


class ExpertBytesError(RuntimeError):
    """A move or fill that cannot be done (an expert missing from this GPU's slots, ...)."""


def slot_words(layer_tensor: torch.Tensor) -> torch.Tensor:
    """The ``[slots, words]`` int32 view of one layer's tensor ``[slots, ...]`` (no copy)."""
    num_slots = layer_tensor.shape[0]
    return layer_tensor.view(torch.uint8).reshape(num_slots, -1).view(torch.int32)


def seed(layer: int, logical_id: int) -> int:
    """The 31-bit seed of one (layer, expert); distinct for every pair the check uses."""
    return ((layer * 1_000_003 + logical_id * 7919 + 1) * _GOLDEN) & _MASK


def seeds_on(layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
    """``seed(layer, e)`` for a tensor of ids, computed on the ids' device (int32)."""
    mixed = (logical_ids.to(torch.int64) * 7919 + (layer * 1_000_003 + 1)) * _GOLDEN
    return (mixed & _MASK).to(torch.int32)


def base_words(num_words: int, tensor_index: int, device: torch.device | str) -> torch.Tensor:
    """The fixed pseudo-random words of tensor ``tensor_index`` (int32, in [0, 2**31))."""
    positions = torch.arange(num_words, dtype=torch.int64, device=device)
    return (((positions + 1) * _GOLDEN + tensor_index * 40503) & _MASK).to(torch.int32)


def bases_for(layer_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One ``base_words`` per tensor, sized to its slot's words, on its device."""
    return [
        base_words(slot_words(t).shape[1], index, t.device) for index, t in enumerate(layer_tensors)
    ]


def fill_layer(
    layer_tensors: Sequence[torch.Tensor],
    layer: int,
    contents: Sequence[int],
    bases: Sequence[torch.Tensor],
) -> None:
    """Write expert ``contents[s]`` of ``layer`` into every slot ``s`` of every tensor."""
    device = layer_tensors[0].device
    ids = torch.tensor(list(contents), dtype=torch.int32, device=device)
    layer_seeds = seeds_on(layer, ids)
    for words_of_tensor, base in zip((slot_words(t) for t in layer_tensors), bases, strict=True):
        if words_of_tensor.shape[0] != len(contents):
            raise ExpertBytesError(f"{len(contents)} experts for {words_of_tensor.shape[0]} slots")
        torch.bitwise_xor(base.unsqueeze(0), layer_seeds.unsqueeze(1), out=words_of_tensor)
        words_of_tensor[:, 0] = ids


def held_experts(
    layer_tensors: Sequence[torch.Tensor],
    layer: int,
    num_logical_experts: int,
    bases: Sequence[torch.Tensor],
) -> list[int]:
    """Per slot, the expert whose bytes it holds whole, else ``HOLDS_NO_EXPERT``."""
    first = slot_words(layer_tensors[0])
    ids = first[:, 0].clone()
    whole = (ids >= 0) & (ids < num_logical_experts)
    layer_seeds = seeds_on(layer, torch.where(whole, ids, torch.zeros_like(ids)))
    for words_of_tensor, base in zip((slot_words(t) for t in layer_tensors), bases, strict=True):
        expected = torch.bitwise_xor(base[1:].unsqueeze(0), layer_seeds.unsqueeze(1))
        whole &= (words_of_tensor[:, 1:] == expected).all(dim=1)
        whole &= words_of_tensor[:, 0] == ids
        del expected
    held = torch.where(whole, ids, torch.full_like(ids, HOLDS_NO_EXPERT))
    return [int(x) for x in held.cpu().tolist()]


def count_matching(held: Sequence[Sequence[int]], rows: Sequence[Sequence[int]]) -> int:
    """How many slots hold the expert ``rows`` names there."""
    return sum(
        int(h == int(r))
        for held_row, row in zip(held, rows, strict=True)
        for h, r in zip(held_row, row, strict=True)
    )


def gather_sources(old_row: Sequence[int], new_row: Sequence[int]) -> list[int]:
    """For each slot, the slot of ``old_row`` to copy from so that it holds ``new_row``'s expert
    (itself when it already does); raise when an expert is on no slot of this GPU."""
    first_slot: dict[int, int] = {}
    for slot, expert in enumerate(old_row):
        first_slot.setdefault(int(expert), slot)
    sources = []
    for slot, expert in enumerate(new_row):
        if int(old_row[slot]) == int(expert):
            sources.append(slot)
        elif int(expert) in first_slot:
            sources.append(first_slot[int(expert)])
        else:
            raise ExpertBytesError(
                f"expert {expert} is on no local slot; a move on one GPU only copies local slots"
            )
    return sources


def move_layer(
    layer_tensors: Sequence[torch.Tensor], old_row: Sequence[int], new_row: Sequence[int]
) -> tuple[int, int]:
    """Move one layer's experts in place from ``old_row`` to ``new_row`` (this GPU's slots).

    Returns (slots whose bytes changed, bytes copied into them)."""
    sources = gather_sources(old_row, new_row)
    moved = [slot for slot, source in enumerate(sources) if source != slot]
    if not moved:
        return 0, 0
    device = layer_tensors[0].device
    index = torch.tensor(sources, dtype=torch.int64, device=device)
    copied = 0
    for tensor in layer_tensors:
        words = slot_words(tensor)
        words.copy_(words.index_select(0, index))
        copied += words.shape[1] * 4 * len(moved)
    return len(moved), copied


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
