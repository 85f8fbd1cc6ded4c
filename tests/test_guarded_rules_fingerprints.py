"""A rule of the slot fingerprint (``sglang_integration.content.fingerprints``) that a plausible
bug could break without any other test noticing: the weight table is a permutation of 1..2048
(no weight repeats within a chunk, none is zero), so every word of a slot weighs in, any single
changed word changes its part, and so does any exchange of two different words of a chunk.

The other fingerprint tests compare the computation with a Python evaluation of the definition
that reads the same table, and change only the first few words of a slot; a table with a few
zero entries (some words of every chunk ignored) passes them. Here every word position of a
chunk is changed, one slot per position.
"""

from __future__ import annotations

import torch

from sglang_integration.content import fingerprints as fp
from sglang_integration.content.fingerprints import fingerprint_slots

CPU = torch.device("cpu")


def test_the_weight_table_is_a_permutation_of_1_to_a_chunk_and_keeps_every_sum_exact() -> None:
    table = fp._Tables.weights(CPU)
    assert table.dtype == torch.float64 and tuple(table.shape) == (fp.CHUNK_WORDS,)
    values = [int(value) for value in table.tolist()]
    assert all(float(value) == raw for value, raw in zip(values, table.tolist(), strict=True))
    assert sorted(values) == list(range(1, fp.CHUNK_WORDS + 1))  # no weight repeats, none zero
    assert values != sorted(values)  # a fixed shuffle, not the positions themselves
    assert 2**31 * sum(values) < 2**53  # every chunk sum of int32 words is exact in float64
    assert all(value < min(fp._PRIMES) for value in values)


def test_every_chunk_multiplier_is_non_zero_modulo_its_prime() -> None:
    for lane, prime in enumerate(fp._PRIMES):
        multipliers = fp._Tables.multipliers(CPU, lane, 3 * 1024).tolist()
        assert all(1 <= value < prime for value in multipliers), lane


def test_a_single_changed_word_at_any_position_of_a_chunk_changes_its_part_and_only_it() -> None:
    # Byte words (a slot of an odd number of bytes): part 0 of a slot of 4 * 4096 + 1 bytes is
    # exactly its first chunk, words 0..4095. Slot 0 is the base; slot j + 1 differs from it in
    # word j alone.
    words = fp.CHUNK_WORDS
    length = fp.PARTS * words + 1
    base = torch.arange(length, dtype=torch.int64).remainder(251).to(torch.uint8)
    slots = base.repeat(words + 1, 1)
    positions = torch.arange(words)
    slots[positions + 1, positions] += 1  # below 255: no wrap
    assert fp._pieces([length])[0] == [(0, 0, words)]
    prints = fingerprint_slots([slots], words + 1)
    same_part_zero = (prints[1:, 0] == prints[0, 0]).nonzero().flatten().tolist()
    assert same_part_zero == [], f"words {same_part_zero} of a chunk do not weigh in"
    assert bool((prints[1:, 1:] == prints[0, 1:]).all())  # the other parts: untouched
