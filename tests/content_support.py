"""Slot contents for the content tests: a fingerprint per (layer, expert), and slots holding them.

``expert_fingerprint`` stands in for ``sglang_integration.content.fingerprints`` of an expert's
bytes (64 hex digits, one per (layer, expert)); ``Slots`` is what a daemon's local slots hold,
which a test changes the way a move, a crash or a broken loader would, and fingerprints on request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from layout_ledger.core.content import ZERO, LocalFingerprints, parts_of


def expert_fingerprint(layer: int, expert: int) -> str:
    return hashlib.sha256(f"layer {layer} expert {expert}".encode()).hexdigest()


def half_and_half(layer: int, first: int, second: int) -> str:
    """Parts 0-1 of expert ``first``, parts 2-3 of expert ``second`` (a half-written slot)."""
    a, b = parts_of(expert_fingerprint(layer, first)), parts_of(expert_fingerprint(layer, second))
    return "".join((*a[:2], *b[2:]))


class Slots:
    """A daemon's local slots ``first_slot ..`` of every layer and what each holds."""

    def __init__(self, the_map: Sequence[Sequence[int]], first_slot: int, count: int) -> None:
        self.first_slot = first_slot
        self.held: dict[int, list[str]] = {
            layer: [expert_fingerprint(layer, row[first_slot + i]) for i in range(count)]
            for layer, row in enumerate(the_map)
        }

    def move(self, layer: int, slot: int, expert: int) -> None:
        self.held[layer][slot - self.first_slot] = expert_fingerprint(layer, expert)

    def put(self, layer: int, slot: int, fingerprint: str) -> None:
        self.held[layer][slot - self.first_slot] = fingerprint

    def zero(self, layer: int, slot: int) -> None:
        self.put(layer, slot, ZERO)

    def fill(self, layer: int, row: Sequence[int]) -> None:
        for index in range(len(self.held[layer])):
            self.move(layer, self.first_slot + index, row[self.first_slot + index])

    def fingerprints(self, layers: Sequence[int] | None = None) -> LocalFingerprints:
        chosen = sorted(self.held) if layers is None else list(layers)
        return LocalFingerprints(
            self.first_slot, {layer: tuple(self.held[layer]) for layer in chosen}
        )

    def held_tuples(self) -> dict[int, tuple[str, ...]]:
        return {layer: tuple(values) for layer, values in self.held.items()}
