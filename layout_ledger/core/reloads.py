"""Reloading local slots from the checkpoint: what a reload or a heal asks and what it reports.

A daemon that knows its checkpoint rewrites some of its local slots in place from it (the
daemon's ``checkpoint_reload``: sglang's own loader over only those experts' tensors). The
record asks for it through ``SlotReloader`` (no torch here) in two transitions: a heal (the
dirty layers, into the committed map) and ``expert_layout_reload`` (the slots whose expert
differs between the current and a new map). ``ReloadReport`` is what came back: the slots'
fingerprints after it, and the cost the ``heal`` and ``reload`` events record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import LedgerError


class ReloadFailed(LedgerError):
    """The checkpoint could not be reloaded into the slots (a missing or changed checkpoint
    file, a tensor that does not load); the slots may be half-written."""


@dataclass(frozen=True)
class ReloadReport:
    """One reload: the layers and how many local slots it rewrote, the checkpoint bytes it
    read, its seconds, and the reloaded layers' local slots fingerprinted after it."""

    layers: tuple[int, ...]
    slots: int
    bytes_read: int
    seconds: float
    fingerprints: LocalFingerprints

    def describe(self) -> str:
        """``2 layers [1, 2], 6 slots, 91,200 bytes read, 0.012 s`` (the events' reason)."""
        return (
            f"{len(self.layers)} layers {list(self.layers)}, {self.slots} slots, "
            f"{self.bytes_read:,} bytes read, {self.seconds:.3f} s"
        )


class SlotReloader(Protocol):
    """Rewrites ``slots`` (layer -> physical slot ids, this daemon's local ones) from the
    checkpoint, placed by ``physical_to_logical_map``; raises ``ReloadFailed``."""

    def __call__(
        self, physical_to_logical_map: Sequence[Sequence[int]], slots: Mapping[int, Sequence[int]]
    ) -> ReloadReport: ...


def changed_local_slots(
    old_map: Sequence[Sequence[int]],
    new_map: Sequence[Sequence[int]],
    first_slot: int,
    num_slots: int,
) -> dict[int, list[int]]:
    """Per layer, the local slots whose expert differs between the two maps (layers without
    one are left out)."""
    found: dict[int, list[int]] = {}
    local = range(first_slot, first_slot + num_slots)
    for layer, (old, new) in enumerate(zip(old_map, new_map, strict=True)):
        slots = [slot for slot in local if old[slot] != new[slot]]
        if slots:
            found[layer] = slots
    return found


def all_local_slots(layers: Sequence[int], first_slot: int, num_slots: int) -> dict[int, list[int]]:
    """Every local slot of ``layers`` (what a heal reloads)."""
    return {layer: list(range(first_slot, first_slot + num_slots)) for layer in layers}
