"""The layout value itself: the physical_to_logical_map, its digest and its validation.

A map is ``num_layers`` rows of ``num_physical_slots`` Python ints, each the logical expert held
in that slot (the same shape as ``ExpertLocationMetadata.physical_to_logical_map``).

The digest is ``sha256(json.dumps(map, separators=(",", ":")))`` (docs/protocol.md). Compact
JSON of a list of rows is ``"[" + ",".join(row_json) + "]"``, so the digest can be computed from
each row's JSON text; the ledger stores exactly that text per row, and a commit re-serializes only
the rows it moved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.errors import InvalidRequest

_orjson: Any
try:  # optional: the fast JSON encoder (see ``compact_json``)
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is present wherever sglang is
    _orjson = None

Map = list[list[int]]

# Bounds that keep a hostile or broken request from costing the daemon memory or time.
MAX_LAYERS = 4096
MAX_SLOTS = 65536


@dataclass(frozen=True)
class Geometry:
    """The shape every map of one daemon incarnation has."""

    num_layers: int
    num_physical_slots: int
    num_logical_experts: int

    def __post_init__(self) -> None:
        for name, value, bound in (
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("num_physical_slots", self.num_physical_slots, MAX_SLOTS),
            ("num_logical_experts", self.num_logical_experts, MAX_SLOTS),
        ):
            if not is_int(value) or not 1 <= value <= bound:
                raise InvalidRequest(f"{name} must be an int in [1, {bound}], got {value!r}")
        if self.num_logical_experts > self.num_physical_slots:
            raise InvalidRequest(
                f"num_logical_experts ({self.num_logical_experts}) exceeds "
                f"num_physical_slots ({self.num_physical_slots}): every expert needs a slot"
            )

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_physical_slots} physical slots, "
            f"{self.num_logical_experts} logical experts"
        )


def is_int(value: Any) -> bool:
    """A real Python int (bool, float, NaN and numpy scalars are not)."""
    return type(value) is int


def is_digest(value: Any) -> bool:
    """64 lowercase hex characters, the form of every digest (on the wire and in the ledger)."""
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def compact_json(value: Any) -> bytes:
    """``json.dumps(value, separators=(",", ":"))``, encoded: the protocol's JSON.

    orjson (in sglang's dependency set, so present wherever a daemon or an engine runs) writes
    exactly these bytes for lists of ints, faster; without it, or for a value it does not take
    (an int beyond 64 bits), the standard library does.
    """
    if _orjson is not None:
        try:
            encoded: bytes = _orjson.dumps(value)
            return encoded
        except (TypeError, ValueError):
            pass
    return json.dumps(value, separators=(",", ":")).encode()


def row_json(row: Sequence[int]) -> str:
    """The compact JSON text of one row, as it appears inside the digested map."""
    return compact_json(list(row)).decode()


def digest_of_row_jsons(row_jsons: Sequence[str]) -> str:
    """The map digest from each row's compact JSON (equal to ``layout_digest`` of the map)."""
    return hashlib.sha256(("[" + ",".join(row_jsons) + "]").encode()).hexdigest()


def layout_digest(physical_to_logical_map: Sequence[Sequence[int]]) -> str:
    """SHA-256 of the map as docs/protocol.md defines it (compact JSON, 64 lowercase hex chars)."""
    rows = [row if isinstance(row, list) else list(row) for row in physical_to_logical_map]
    return hashlib.sha256(compact_json(rows)).hexdigest()


def trivial_map(num_layers: int, num_physical_slots: int, num_logical_experts: int) -> Map:
    """sglang's trivial layout: physical slot ``i`` holds logical expert ``i % num_logical``."""
    row = [slot % num_logical_experts for slot in range(num_physical_slots)]
    return [list(row) for _ in range(num_layers)]


def validate_row(row: Any, geometry: Geometry, what: str) -> list[int]:
    """Return ``row`` as a list of ints, or raise ``InvalidRequest`` naming ``what`` is wrong."""
    if not isinstance(row, (list, tuple)):
        raise InvalidRequest(f"{what} must be a list of ints, got {type(row).__name__}")
    if len(row) != geometry.num_physical_slots:
        raise InvalidRequest(
            f"{what} has {len(row)} slots; this layout has "
            f"{geometry.num_physical_slots} physical slots per layer"
        )
    upper = geometry.num_logical_experts
    # Fast path in C (a commit validates every slot of every moved layer); the loop below
    # only runs to name the first bad slot.
    if row and set(map(type, row)) == {int} and min(row) >= 0 and max(row) < upper:
        return list(row)
    for slot, value in enumerate(row):
        if not is_int(value):
            raise InvalidRequest(
                f"{what} slot {slot} holds {value!r} ({type(value).__name__}); "
                f"expected an int logical expert id"
            )
        if not 0 <= value < upper:
            raise InvalidRequest(f"{what} slot {slot} holds expert {value}, outside [0, {upper})")
    return list(row)


def validate_map(physical_to_logical_map: Any, geometry: Geometry) -> Map:
    """Return a validated copy of a whole map."""
    if not isinstance(physical_to_logical_map, (list, tuple)):
        raise InvalidRequest(
            f"a map must be a list of rows, got {type(physical_to_logical_map).__name__}"
        )
    if len(physical_to_logical_map) != geometry.num_layers:
        raise InvalidRequest(
            f"the map has {len(physical_to_logical_map)} layers; expected {geometry.num_layers}"
        )
    return [
        validate_row(row, geometry, f"layer {layer}")
        for layer, row in enumerate(physical_to_logical_map)
    ]


def validate_layers(layers: Any, geometry: Geometry) -> tuple[int, ...]:
    """A move's layer list: non-empty, ints, no duplicates, in range. Returned sorted."""
    if not isinstance(layers, (list, tuple)):
        raise InvalidRequest(f"layers must be a list of ints, got {type(layers).__name__}")
    if not layers:
        raise InvalidRequest("layers is empty; a move names at least one layer")
    if len(layers) > geometry.num_layers:
        raise InvalidRequest(
            f"layers lists {len(layers)} entries but the model has {geometry.num_layers} layers"
        )
    seen: set[int] = set()
    for layer in layers:
        if not is_int(layer):
            raise InvalidRequest(f"layer {layer!r} ({type(layer).__name__}) is not an int")
        if not 0 <= layer < geometry.num_layers:
            raise InvalidRequest(f"layer {layer} is outside [0, {geometry.num_layers})")
        if layer in seen:
            raise InvalidRequest(f"layer {layer} appears twice in layers")
        seen.add(layer)
    return tuple(sorted(seen))


def validate_rows(rows: Any, layers: tuple[int, ...], geometry: Geometry) -> dict[int, list[int]]:
    """A commit's ``{layer: row}``: exactly the pending ``layers``, each row valid."""
    if not isinstance(rows, Mapping):
        raise InvalidRequest(f"rows must be a dict {{layer: row}}, got {type(rows).__name__}")
    if len(rows) > geometry.num_layers:
        raise InvalidRequest(f"rows has {len(rows)} entries; the model has {geometry.num_layers}")
    check_row_layers(rows, layers)
    return {layer: validate_row(rows[layer], geometry, f"row of layer {layer}") for layer in layers}


def validate_rows_json(rows: Any, layers: tuple[int, ...], geometry: Geometry) -> dict[int, str]:
    """``validate_rows``, returning each valid row's compact JSON text instead of the row.

    The fast path encodes every row at once and checks the text: nothing but digits, commas and
    one bracket pair per row means every value is a non-negative int (a bool, float, NaN,
    string, None, nested list or negative number would show another character or bracket);
    then each row's length and largest value. Anything else takes ``validate_rows``, which
    names the first bad slot.
    """
    if isinstance(rows, Mapping) and len(rows) <= geometry.num_layers:
        check_row_layers(rows, layers)
        ordered = [rows[layer] for layer in layers]
        texts = _encoded_if_valid(ordered, geometry)
        if texts is not None:
            return dict(zip(layers, texts, strict=True))
    return {layer: row_json(row) for layer, row in validate_rows(rows, layers, geometry).items()}


_NOT_JSON_INTS = bytes(range(256)).translate(None, b"0123456789,[]")


def _encoded_if_valid(rows: list[Any], geometry: Geometry) -> list[str] | None:
    """Each row's JSON text when every row is a valid list of ints, else None (no detail)."""
    slots, upper = geometry.num_physical_slots, geometry.num_logical_experts
    for row in rows:
        if not isinstance(row, (list, tuple)) or len(row) != slots:
            return None
    encoded = _strict_encode(rows)
    if encoded is None or encoded.translate(None, _NOT_JSON_INTS) != encoded:
        return None
    if encoded.count(b"[") != len(rows) + 1 or encoded.count(b"]") != len(rows) + 1:
        return None  # a nested list in some row
    if not _all_below(rows, upper):
        return None
    return ["[" + text + "]" for text in encoded[2:-2].decode().split("],[")] if rows else []


def _all_below(rows: list[Any], upper: int) -> bool:
    """Every value (a non-negative int, by the text check) is below ``upper``.

    Up to 256 experts, packing the rows into bytes and deleting the allowed values is faster
    than ``max`` over Python ints (``bytes`` refuses a value over 255 by itself)."""
    if upper > 256:
        return max(map(max, rows), default=-1) < upper
    try:
        packed = b"".join(map(bytes, rows))
    except ValueError:
        return False
    return not packed.translate(None, bytes(range(upper)))


def _strict_encode(rows: list[Any]) -> bytes | None:
    """The rows' compact JSON, or None for something the encoder does not take.

    A request reaches the daemon through sglang's SafeUnpickler, which admits no int subclass
    but bool (whose ``true``/``false`` the text check refuses); orjson writes any other int
    subclass (an IntEnum handed to the record in-process) as its value."""
    if _orjson is None:
        if any(set(map(type, row)) != {int} for row in rows):
            return None
        return compact_json(rows)
    try:
        encoded: bytes = _orjson.dumps(rows, option=_orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:
        return None
    return encoded


def check_row_layers(row_layers: Collection[Any], layers: tuple[int, ...]) -> None:
    """A commit's row keys must be int layers, exactly the pending ``layers``."""
    for key in row_layers:
        if not is_int(key):
            raise InvalidRequest(f"rows key {key!r} ({type(key).__name__}) is not an int layer")
    if set(row_layers) != set(layers):
        raise InvalidRequest(
            f"rows cover layers {sorted(row_layers)} but the pending move is of layers "
            f"{list(layers)}; commit exactly the pending layers"
        )
