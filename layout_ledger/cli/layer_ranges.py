"""Layers as ranges: ``--layers 0,3,5-7`` in, ``0-2,5,7-8`` out.

A range is checked against the ledger's geometry before it is expanded, so ``0-1000000000`` is
one error line, not a list of a billion layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry


@dataclass(frozen=True)
class LayerRanges:
    """Inclusive ``(first, last)`` layer ranges, sorted, as given (not yet checked)."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, value: str) -> LayerRanges:
        """``0,3,5-7`` -> ((0, 0), (3, 3), (5, 7)); ``ValueError`` names what is wrong."""
        ranges = []
        for raw in value.split(","):
            part = raw.strip()
            first, dash, last = part.partition("-")
            try:
                low = int(first)
                high = int(last) if dash else low
            except ValueError:
                raise ValueError(f"expected layers like 0,3,5-7, got {value!r}") from None
            if low < 0 or high < low:
                raise ValueError(f"bad layer range {part!r} in {value!r}")
            ranges.append((low, high))
        return cls(tuple(sorted(ranges)))

    def expand(self, num_layers: int) -> tuple[int, ...]:
        """The layers, sorted and without duplicates, once each is known to exist."""
        for low, high in self.ranges:
            if high < num_layers:
                continue
            held = f"layers 0..{num_layers - 1}" if num_layers else "no layers"
            missing = max(low, num_layers)
            if missing == high:
                raise LedgerError(f"layer {high} does not exist: this ledger's maps have {held}")
            raise LedgerError(
                f"layers {missing}-{high} do not exist: this ledger's maps have {held}"
            )
        layers: set[int] = set()
        for low, high in self.ranges:
            layers.update(range(low, high + 1))
        return tuple(sorted(layers))


def check_layers(layers: LayerRanges | None, geometry: Geometry) -> list[int]:
    """The layers a command looks at: all when None, else each must exist in this ledger."""
    if layers is None:
        return list(range(geometry.num_layers))
    return list(layers.expand(geometry.num_layers))


def format_layers(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8`` (sorted; an operator reads ranges faster)."""
    ordered = sorted(set(layers))
    parts = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(parts)
