"""Slot fingerprints: which expert's bytes each physical slot of a layer holds, on its device.

``fingerprint_slots(tensors, num_slots)`` takes one MoE layer's routed-expert tensors (the list
sglang's ``ExpertLocationUpdater`` moves: a model's ``routed_experts_weights_of_layer[layer]``,
first dimension the layer's local physical slots) and returns one fingerprint per slot, on the
tensors' device; its docstring is the definition. Nothing of the weights is copied to the host;
only the result is (``fingerprint_hex``). Daemons and engines compute the same values from the
same bytes, so their fingerprints can be compared.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

PARTS = 4
HEX_PER_PART = 16
_PRIMES = (2_147_483_647, 2_147_483_629)  # 2**31 - 1 and 2**31 - 19
_LANE_SHIFT = 31
_TABLE_SEED = 0x5EED_F1A6
_MULTIPLIER_SEEDS = (0x1A7E_0001, 0x1A7E_0002)


@dataclass(frozen=True)
class Definition:
    """The chunk size and weight table of a fingerprint definition (the rest is shared).

    ``DISTINCT`` (the definition, ``CHUNK_WORDS`` 2048): ``T`` is a fixed permutation of
    ``1..2048``, so no weight repeats within a chunk; ``|S| <= 2**31 * 2048 * 2049 / 2 < 2**53``.
    ``FIRST`` (the definition before it, 4096 words, 4096 odd weights below 1024 of which only
    512 distinct): kept for ``scripts/bench_fingerprints.py``'s side-by-side comparison only.
    """

    name: str
    chunk_words: int

    def table(self) -> np.ndarray:
        """``T`` as uint64 (``_Tables`` keeps it per device as float64)."""
        if self.name == "first":
            return (_splitmix64(_TABLE_SEED, self.chunk_words) >> np.uint64(54)) | np.uint64(1)
        order = np.argsort(_splitmix64(_TABLE_SEED, self.chunk_words), kind="stable")
        result: np.ndarray = (order + 1).astype(np.uint64)
        return result


DISTINCT = Definition("distinct", 2048)
FIRST = Definition("first", 4096)
CHUNK_WORDS = DISTINCT.chunk_words
# Bytes of float64 words held at once: slots and words are taken in blocks below this. A layer
# costs one read of every byte, each word written and read once as a float64
# (scripts/bench_fingerprints.py measures it next to a copy of the same bytes).
_BUDGET = 64 << 20
_BLOCK_WORDS = (_BUDGET // 8 // CHUNK_WORDS) * CHUNK_WORDS


def _splitmix64(seed: int, count: int) -> np.ndarray:
    """``count`` values of SplitMix64 from ``seed`` (numpy uint64 math wraps by definition)."""
    with np.errstate(over="ignore"):
        state = (np.arange(1, count + 1, dtype=np.uint64) + np.uint64(seed)) * np.uint64(
            0x9E3779B97F4A7C15
        )
        state = (state ^ (state >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        state = (state ^ (state >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        result: np.ndarray = state ^ (state >> np.uint64(31))
    return result


class _Tables:
    """The fixed tables of the definition, built on the host once and kept per device."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _weights: ClassVar[dict[tuple[torch.device, Definition], torch.Tensor]] = {}
    _multipliers: ClassVar[dict[tuple[torch.device, int], torch.Tensor]] = {}
    _negative_zeros: ClassVar[dict[Any, torch.Tensor]] = {}

    @classmethod
    def weights(cls, device: torch.device, definition: Definition = DISTINCT) -> torch.Tensor:
        """``T`` of ``definition``: ``chunk_words`` values as float64, on ``device``."""
        with cls._lock:
            table = cls._weights.get((device, definition))
            if table is None:
                values = definition.table()
                table = torch.from_numpy(values.astype(np.float64)).to(device)
                cls._weights[(device, definition)] = table
            return table

    @classmethod
    def negative_zeros(
        cls, tensors: Sequence[torch.Tensor], definition: Definition = DISTINCT
    ) -> torch.Tensor:
        """``(PARTS,)``: steps 1-4 of one slot of ``tensors``' shapes whose every floating-point
        value is -0.0 (its sign bit, the top bit of its last byte, set; other dtypes zero),
        kept per device and shapes (step 5)."""
        device = tensors[0].device
        key = (device, definition, tuple((t.dtype, tuple(t.shape[1:])) for t in tensors))
        with cls._lock:
            found = cls._negative_zeros.get(key)
        if found is not None:
            return found
        slots = []
        for tensor in tensors:
            one = torch.zeros((1, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
            if tensor.dtype.is_floating_point and one.numel():
                raw = one.view(torch.uint8).view(-1, tensor.element_size())
                raw[:, -1] = 0x80  # little-endian, as torch is on every device it runs on
            slots.append(one)
        found = _part_values(slots, 1, definition)[0]
        with cls._lock:
            cls._negative_zeros[key] = found
        return found

    @classmethod
    def multipliers(cls, device: torch.device, lane: int, count: int) -> torch.Tensor:
        """``M_lane[0:count]``: int64 values in ``[1, P_lane)`` (grown by doubling)."""
        with cls._lock:
            table = cls._multipliers.get((device, lane))
            if table is None or table.shape[0] < count:
                size = max(count, 2 * (0 if table is None else table.shape[0]), 1024)
                prime = np.uint64(_PRIMES[lane] - 1)
                values = _splitmix64(_MULTIPLIER_SEEDS[lane], size) % prime + np.uint64(1)
                table = torch.from_numpy(values.astype(np.int64)).to(device)
                cls._multipliers[(device, lane)] = table
            return table[:count]


def _slot_words(tensor: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``(num_slots, words)``: each slot's bytes as int32 words (int16, uint8: step 1)."""
    if tensor.dim() == 0 or tensor.shape[0] != num_slots:
        raise ValueError(
            f"a routed-expert tensor of shape {tuple(tensor.shape)} does not have {num_slots} "
            f"slots in its first dimension"
        )
    try:
        flat = tensor.view(num_slots, -1)
    except RuntimeError:
        flat = tensor.reshape(num_slots, -1)  # a device copy: a slot's bytes are not contiguous
    raw = flat.view(torch.uint8)
    for width, dtype in ((4, torch.int32), (2, torch.int16)):
        if raw.shape[1] % width == 0:
            try:
                return raw.view(dtype)
            except RuntimeError:
                return raw.clone().view(dtype)  # a device copy: not aligned to the word
    return raw


def _pieces(word_counts: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """Per part, its ``(tensor, start, end)`` word ranges in order (step 2)."""
    total = sum(word_counts)
    bounds = [part * total // PARTS for part in range(PARTS + 1)]
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(PARTS)]
    offset = 0
    for index, count in enumerate(word_counts):
        for part in range(PARTS):
            low, high = max(bounds[part], offset), min(bounds[part + 1], offset + count)
            if low < high:
                pieces[part].append((index, low - offset, high - offset))
        offset += count
    return pieces


def _chunk_sums(
    words: torch.Tensor, start: int, end: int, scratch: torch.Tensor, definition: Definition
) -> torch.Tensor:
    """``(num_slots, chunks)`` int64: step 3 over words ``[start, end)`` of every slot.

    The float64 words go through ``scratch``, one buffer for the whole call: a fresh allocation
    per block would cost more in page faults (on a CPU) than the conversion itself.
    """
    chunk = definition.chunk_words
    table = _Tables.weights(words.device, definition)
    step = max(chunk, _BLOCK_WORDS // chunk * chunk)
    num_slots = words.shape[0]
    per_block = max(1, _BUDGET // (8 * min(step, end - start)))
    rows = []
    for first in range(0, num_slots, per_block):
        columns = []
        for low in range(start, end, step):
            high = min(end, low + step)
            source = words[first : first + per_block, low:high]
            block = scratch[: source.numel()].view(source.shape)
            block.copy_(source)  # exact: every int32 is a float64
            whole = (high - low) // chunk * chunk
            if whole:
                chunked = block[:, :whole].reshape(block.shape[0], -1, chunk)
                columns.append(torch.matmul(chunked, table))
            if whole < high - low:
                columns.append(torch.matmul(block[:, whole:], table[: high - low - whole])[:, None])
        rows.append(torch.cat(columns, dim=1))
    return torch.cat(rows, dim=0).to(torch.int64)


def _part_value(sums: torch.Tensor) -> torch.Tensor:
    """``(num_slots,)`` int64: step 4 for one part's chunk sums, both lanes packed."""
    if sums.shape[1] == 0:
        return torch.zeros(sums.shape[0], dtype=torch.int64, device=sums.device)
    lanes = []
    for lane, prime in enumerate(_PRIMES):
        multipliers = _Tables.multipliers(sums.device, lane, sums.shape[1])
        weighted = torch.remainder(torch.remainder(sums, prime) * multipliers, prime)
        lanes.append(torch.remainder(weighted.sum(dim=1), prime))
    return lanes[0] * (1 << _LANE_SHIFT) + lanes[1]


def fingerprint_slots(
    tensors: list[torch.Tensor], num_slots: int, *, definition: Definition = DISTINCT
) -> torch.Tensor:
    """One fingerprint per physical slot of one layer: ``(num_slots, PARTS)`` int64, on the
    tensors' device. ``tensors``: the layer's routed-expert tensors, each with ``num_slots``
    slots in its first dimension, all on one device.

    Definition (the same bytes give the same fingerprint in every process and on every device,
    because every step is exact integer arithmetic, whose result does not depend on the order in
    which a device adds):

    1. A slot's *words*: for each tensor in order, the bytes of that slot (row-major) read as
       little-endian int32 words (int16 when a slot's bytes in that tensor are not a multiple of 4,
       unsigned bytes when odd in number). The slot's word sequence is the tensors' words one after
       the other, ``W`` words.
    2. *Parts*: the sequence is cut into ``PARTS`` (4) ranges, part ``k`` covering positions
       ``[k*W//4, (k+1)*W//4)``. Each part is cut into *chunks* of at most ``CHUNK_WORDS`` (2048)
       words, also at tensor boundaries; chunks are numbered ``c = 0, 1, ...`` within their part.
    3. A chunk's sum: ``S = sum_j w_j * T_j`` over its words ``w_j`` (``j`` from 0 within the
       chunk), ``T`` a fixed permutation of ``1..2048`` (``Definition.table``: no weight repeats
       within a chunk). ``|S| <= 2**31 * (1 + ... + 2048) < 2**53``, so it is computed exactly as
       a float64 matrix-vector product: every product and partial sum is an integer a float64
       holds exactly, in any order of addition.
    4. A part's value in each of two lanes ``q`` (primes ``P_q`` just below ``2**31``):
       ``sum_c (S_c mod P_q) * M_q[c] mod P_q``, ``M_q`` fixed tables in ``[1, P_q)``, in int64
       without overflow. The part's fingerprint is ``lane_0 * 2**31 + lane_1`` (below
       ``2**62``); ``fingerprint_hex`` writes the four parts as 16 hex digits each, 64 in all.
    5. *Empty parts*: a part whose value is that of the same part of a slot in which every
       floating-point value is -0.0 (the sign bit alone set; integer tensors 0) is 0, as a part of
       zero bytes is. So a never-filled slot is 0 in every part whether it holds +0.0 or -0.0.

    Why it tells the cases apart: a slot that holds another expert differs in (nearly) every part; a
    slot half overwritten with another expert's bytes keeps the parts that were not touched and
    changes the others, so a reader that knows every expert's parts sees "parts 0-1 of expert X,
    parts 2-3 of expert Y" (``layout_ledger.core.content``); a zero-filled slot (+0.0 or -0.0
    throughout) gives 0 in every part, which no real expert does.

    What it detects (derived here; ``tests/test_fingerprints.py`` and
    ``scripts/bench_fingerprints.py --detection`` measure it):

    - always: any change of one word (the chunk sum moves by ``d * T_j``, ``0 < |d * T_j| <
      2**43``: no multiple of ``P_0 * P_1``, so at least one lane moves, ``M_q[c]`` being non-zero
      modulo its prime); any exchange of two different words within one chunk, adjacent (a
      shift by one place) or at any distance (a swap, a transposition): the sum moves by
      ``(w_i - w_k) * (T_k - T_i)``, non-zero because no weight repeats, and below ``2**43``;
    - with probability about ``2**-62`` of being missed: any other change, such as words
      exchanged between two chunks of a part, or two other contents, for bytes that do not
      depend on the fixed tables (per lane the part value moves by a sum over chunks that the
      random multipliers make zero with probability about ``1 / P_q``);
    - never: a change made to cancel (a chosen ``+T_k`` at word ``j`` and ``-T_j`` at word ``k``):
      it is a check against accidents, not against an adversary.
    """
    if not tensors:
        raise ValueError("a layer needs at least one routed-expert tensor to fingerprint")
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise ValueError(f"a layer's routed-expert tensors are on several devices: {devices}")
    with torch.no_grad():
        values = _part_values(tensors, num_slots, definition)
        empty = _Tables.negative_zeros(tensors, definition)
        return torch.where(values == empty, torch.zeros_like(values), values)


def _part_values(
    tensors: Sequence[torch.Tensor], num_slots: int, definition: Definition
) -> torch.Tensor:
    """Steps 1-4: ``(num_slots, PARTS)`` int64."""
    with torch.no_grad():
        words = [_slot_words(tensor, num_slots) for tensor in tensors]
        largest = max(min(_BUDGET // 8, w.numel()) for w in words)
        scratch = torch.empty(largest, dtype=torch.float64, device=words[0].device)
        values = []
        for pieces in _pieces([w.shape[1] for w in words]):
            sums = [
                _chunk_sums(words[index], start, end, scratch, definition)
                for index, start, end in pieces
            ]
            values.append(_part_value(torch.cat(sums, dim=1) if sums else _no_sums(words[0])))
        return torch.stack(values, dim=1)


def _no_sums(words: torch.Tensor) -> torch.Tensor:
    return torch.zeros((words.shape[0], 0), dtype=torch.int64, device=words.device)


def fingerprint_hex(fingerprints: torch.Tensor) -> list[str]:
    """Each slot's fingerprint as ``PARTS * 16`` lowercase hex digits (copies only the result)."""
    rows = fingerprints.reshape(fingerprints.shape[0], PARTS).cpu().tolist()
    return ["".join(f"{int(value):0{HEX_PER_PART}x}" for value in row) for row in rows]


def fingerprint_layers(
    routed_experts_weights_of_layer: Mapping[int, Sequence[torch.Tensor]],
    layers: Sequence[int],
    num_slots: int,
) -> dict[int, list[str]]:
    """Hex fingerprints of every slot of ``layers`` (keys of ``routed_experts_weights_of_layer``
    are model layer ids, as sglang's models give them)."""
    missing = [layer for layer in layers if layer not in routed_experts_weights_of_layer]
    if missing:
        raise ValueError(f"the model has no routed-expert tensors for layers {missing}")
    return {
        layer: fingerprint_hex(
            fingerprint_slots(list(routed_experts_weights_of_layer[layer]), num_slots)
        )
        for layer in layers
    }
