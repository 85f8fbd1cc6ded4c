"""The layout value itself: the physical_to_logical_map, its digest and its validation.

A map is ``num_layers`` rows of ``num_physical_slots`` Python ints, each the logical expert held
in that slot (the same shape as ``ExpertLocationMetadata.physical_to_logical_map``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

Map = list[list[int]]


def layout_digest(physical_to_logical_map: Sequence[Sequence[int]]) -> str:
    """SHA-256 of the map as PROTOCOL.md defines it (compact JSON, 64 lowercase hex chars)."""
    encoded = json.dumps(
        [list(row) for row in physical_to_logical_map], separators=(",", ":")
    ).encode()
    return hashlib.sha256(encoded).hexdigest()


def trivial_map(num_layers: int, num_physical_slots: int, num_logical_experts: int) -> Map:
    """sglang's trivial layout: physical slot ``i`` holds logical expert ``i % num_logical``."""
    row = [slot % num_logical_experts for slot in range(num_physical_slots)]
    return [list(row) for _ in range(num_layers)]
