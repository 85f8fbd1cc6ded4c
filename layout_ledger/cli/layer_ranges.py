"""``--layers 0,3,5-7``: kept as ranges until the ledger's layer count is known.

A range is checked against the ledger's geometry before it is expanded, so ``0-1000000000`` is
one error line, not a list of a billion layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from layout_ledger.core.errors import LedgerError


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
