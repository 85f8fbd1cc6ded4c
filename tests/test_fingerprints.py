"""Slot fingerprints (``sglang_integration.content.fingerprints``): exact, device-local, and able
to tell a slot holding the named expert from one holding another, a half-overwritten one and a zero
one."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from sglang_integration.content import fingerprints as fp
from sglang_integration.content.fingerprints import fingerprint_hex, fingerprint_slots

SLOTS = 6


def _layer(seed: int = 0, slots: int = SLOTS) -> list[torch.Tensor]:
    """A small layer in sglang's shapes and dtypes: w13 and w2 in bf16, a bf16 tensor whose
    slots are 2 mod 4 bytes (int16 words), an fp8-like byte tensor whose slots are odd in bytes
    (byte words) and float32 scales."""
    generator = torch.Generator().manual_seed(seed)

    def bits(nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raw = torch.randint(0, 256, (slots, nbytes), dtype=torch.uint8, generator=generator)
        return raw.view(dtype).view(slots, *shape)

    return [
        bits(96, torch.bfloat16, (8, 6)),
        bits(48, torch.bfloat16, (6, 4)),
        bits(6, torch.bfloat16, (3,)),
        bits(5, torch.uint8, (5,)),
        bits(48, torch.float32, (3, 4)),
    ]


def _copy_expert(tensors: list[torch.Tensor], source: int, target: int) -> None:
    for tensor in tensors:
        tensor[target] = tensor[source]


def _reference(tensors: list[torch.Tensor], slot: int) -> list[int]:
    """The module docstring's definition, with Python integers (no float64, no torch math)."""
    words: list[int] = []
    for tensor in tensors:
        raw = bytes(tensor[slot].contiguous().view(torch.uint8).reshape(-1).tolist())
        width = 4 if len(raw) % 4 == 0 else 2 if len(raw) % 2 == 0 else 1
        signed = width > 1
        words += [
            int.from_bytes(raw[i : i + width], "little", signed=signed)
            for i in range(0, len(raw), width)
        ]
    # the chunk structure: parts, cut at tensor boundaries and every CHUNK_WORDS words
    sizes = []
    for tensor in tensors:
        raw_len = tensor[slot].numel() * tensor.element_size()
        sizes.append(raw_len // (4 if raw_len % 4 == 0 else 2 if raw_len % 2 == 0 else 1))
    table = [int(v) for v in fp._Tables.weights(torch.device("cpu")).tolist()]
    total = len(words)
    bounds = [k * total // fp.PARTS for k in range(fp.PARTS + 1)]
    edges = np.cumsum([0, *sizes]).tolist()
    values = []
    for part in range(fp.PARTS):
        sums = []
        for low_t, high_t in itertools.pairwise(edges):
            low, high = max(bounds[part], low_t), min(bounds[part + 1], high_t)
            for start in range(low, high, fp.CHUNK_WORDS):
                chunk = words[start : min(high, start + fp.CHUNK_WORDS)]
                sums.append(sum(w * t for w, t in zip(chunk, table, strict=False)))
        lanes = []
        for lane, prime in enumerate(fp._PRIMES):
            multipliers = fp._Tables.multipliers(torch.device("cpu"), lane, max(1, len(sums)))
            lanes.append(
                sum((s % prime) * int(m) for s, m in zip(sums, multipliers.tolist(), strict=False))
                % prime
            )
        values.append(lanes[0] * 2**31 + lanes[1])
    return values


def test_fingerprints_are_the_exact_integer_definition_for_every_word_width():
    tensors = _layer(1)
    got = fingerprint_slots(tensors, SLOTS)
    assert got.dtype == torch.int64 and tuple(got.shape) == (SLOTS, fp.PARTS)
    for slot in range(SLOTS):
        assert got[slot].tolist() == _reference(tensors, slot)


def test_a_slot_larger_than_a_chunk_and_a_block_gives_the_definition(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    words = 3 * fp.CHUNK_WORDS + 17
    tensor = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    whole = fingerprint_slots([tensor], 3)
    # smaller blocks of slots and words: the same sums in another grouping
    monkeypatch.setattr(fp, "_BUDGET", 8 * fp.CHUNK_WORDS)
    monkeypatch.setattr(fp, "_BLOCK_WORDS", fp.CHUNK_WORDS)
    assert torch.equal(fingerprint_slots([tensor], 3), whole)
    assert whole[1].tolist() == _reference([tensor], 1)


def test_a_fingerprint_depends_on_the_slots_bytes_only_not_on_where_the_slot_is():
    tensors = _layer(2)
    _copy_expert(tensors, 1, 4)  # a replica of slot 1's expert in slot 4
    hexes = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    assert hexes[4] == hexes[1]
    assert len(set(hexes)) == SLOTS - 1
    one = [tensor[1:2].clone() for tensor in tensors]  # the same expert alone in a 1-slot layer
    assert fingerprint_hex(fingerprint_slots(one, 1)) == [hexes[1]]


def test_it_tells_apart_another_expert_a_half_overwritten_slot_and_a_zero_filled_slot():
    tensors = _layer(4)
    before = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    _copy_expert(tensors, 0, 2)  # slot 2 now holds slot 0's expert
    # slot 3's first tensor (24 of its 56 words: part 0 and some of part 1) is slot 5's
    tensors[0][3] = tensors[0][5]
    for tensor in tensors:
        tensor[4].zero_()  # never filled
    after = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    parts = [[h[i : i + 16] for i in range(0, 64, 16)] for h in (*before, *after)]
    before_parts, after_parts = parts[:SLOTS], parts[SLOTS:]
    assert after[2] == before[0] != before[2]
    assert after[3] not in before
    assert after_parts[3][0] == before_parts[5][0]  # part 0: slot 5's bytes
    assert after_parts[3][2:] == before_parts[3][2:]  # the untouched parts: slot 3's own
    assert after[4] == "0" * 64
    assert all(h != "0" * 64 for h in before)
    assert [after[s] for s in (0, 1, 5)] == [before[s] for s in (0, 1, 5)]


def test_any_single_changed_word_changes_the_fingerprint():
    tensor = torch.zeros((1, 40), dtype=torch.int32)
    base = fingerprint_hex(fingerprint_slots([tensor], 1))[0]
    seen = {base}
    for position in range(40):
        for value in (1, -1, 2**31 - 1, -(2**31)):
            changed = tensor.clone()
            changed[0, position] = value
            seen.add(fingerprint_hex(fingerprint_slots([changed], 1))[0])
    assert len(seen) == 1 + 40 * 4


def test_it_runs_on_the_tensors_device_and_copies_no_weights_to_the_host():
    # The meta device holds no data: any copy of the weights to the host would raise. The result
    # stays on the tensors' device (the GPU check runs the same on CUDA).
    tensors = [torch.empty((SLOTS, 64, 32), dtype=torch.bfloat16, device="meta")]
    result = fingerprint_slots(tensors, SLOTS)
    assert result.device.type == "meta" and tuple(result.shape) == (SLOTS, fp.PARTS)


def test_another_process_computes_the_same_fingerprints(tmp_path):
    tensors = _layer(5)
    path = tmp_path / "layer.pt"
    torch.save(tensors, path)
    code = (
        "import json, sys, torch\n"
        "from sglang_integration.content.fingerprints import fingerprint_slots, fingerprint_hex\n"
        "t = torch.load(sys.argv[1])\n"
        f"print(json.dumps(fingerprint_hex(fingerprint_slots(t, {SLOTS}))))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(output) == fingerprint_hex(fingerprint_slots(tensors, SLOTS))


@pytest.mark.parametrize(
    ("tensors", "slots", "message"),
    [
        ([], 2, "at least one routed-expert tensor"),
        ([torch.zeros((3, 4))], 2, "does not have 2 slots"),
    ],
)
def test_a_layer_that_does_not_fit_is_refused_with_the_reason(tensors, slots, message):
    with pytest.raises(ValueError, match=message):
        fingerprint_slots(tensors, slots)


def test_the_prepared_gpu_check_of_fingerprints_passes_on_the_cpu():
    # scripts/gpu_fingerprints.py runs on CUDA where there is a GPU; the same checks on the CPU.
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_fingerprints.py"
    result = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--scale", "32"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok    ") == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_slot_of_negative_zeros_is_zero_filled_like_a_slot_of_zeros(dtype):
    tensors = [t.to(dtype) for t in _layer(6)]
    for tensor in tensors:
        tensor[2].zero_()
        tensor[3] = -0.0  # every value -0.0: bytes not zero, and still no expert at all
    hexes = fingerprint_hex(fingerprint_slots(tensors, SLOTS))
    assert hexes[2] == hexes[3] == "0" * 64
    assert all(h != "0" * 64 for i, h in enumerate(hexes) if i not in (2, 3))
    tensors[0][3, 0] = 1.0  # one real value: no longer empty
    assert fingerprint_hex(fingerprint_slots(tensors, SLOTS))[3] != "0" * 64


def _swapped(base: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Slot 0: ``base``; slot ``n + 1``: ``base`` with words ``pairs[n]`` exchanged."""
    slots = base.repeat(len(pairs) + 1, 1)
    for n, (i, j) in enumerate(pairs):
        slots[n + 1, i], slots[n + 1, j] = base[j], base[i]
    return slots


def _missed(slots: torch.Tensor, definition: fp.Definition | None = None) -> int:
    """How many of slots 1.. have slot 0's fingerprint (the definition in force unless named)."""
    if definition is None:
        prints = fingerprint_slots([slots], slots.shape[0])
    else:
        prints = fingerprint_slots([slots], slots.shape[0], definition=definition)
    return int((prints[1:] == prints[0]).all(dim=1).sum())


def test_every_exchange_of_two_different_words_within_a_chunk_changes_the_fingerprint():
    chunk = fp.CHUNK_WORDS
    generator = torch.Generator().manual_seed(11)
    base = torch.randint(-(2**31), 2**31 - 1, (fp.PARTS * chunk,), generator=generator)
    base = base.to(torch.int32)  # one chunk per part
    adjacent = [(i, i + 1) for i in range(chunk - 1)]  # every shift by one place in part 0
    far = torch.randint(0, chunk, (2 * 2000,), generator=generator).view(-1, 2).tolist()
    far = [(int(i), int(j)) for i, j in far if base[i] != base[j]]
    assert _missed(_swapped(base, adjacent)) == 0
    assert _missed(_swapped(base, far)) == 0
    # the table before: weights repeated within a chunk, and the swap of two such words unseen
    first = fp.FIRST.table()[:chunk].tolist()
    i = next(i for i in range(chunk) if first[i] in first[i + 1 :])
    j = first.index(first[i], i + 1)
    assert _missed(_swapped(base, [(i, j)]), fp.FIRST) == 1
    assert _missed(_swapped(base, [(i, j)])) == 0


def test_exchanges_between_the_chunks_of_a_part_are_seen_in_random_trials():
    chunk = fp.CHUNK_WORDS
    generator = torch.Generator().manual_seed(12)
    words = fp.PARTS * 8 * chunk  # eight chunks per part
    base = torch.randint(-(2**31), 2**31 - 1, (words,), generator=generator).to(torch.int32)
    picks = torch.randint(0, 8 * chunk, (1000, 2), generator=generator).tolist()
    pairs = [(i, j) for i, j in picks if i // chunk != j // chunk and base[i] != base[j]]
    assert len(pairs) > 800 and _missed(_swapped(base, pairs)) == 0
