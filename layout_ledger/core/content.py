"""Slot fingerprints as the ledger and the protocol hold them, and what a fingerprint says.

A fingerprint (``sglang_integration.content.fingerprints``, computed with torch on the weights'
device) is, here, opaque: 64 lowercase hex digits, four parts of 16, one per quarter of the slot's
bytes. Two slots hold the same bytes exactly when their fingerprints are equal; a part of
``0000000000000000`` is a quarter of zero bytes. This module (no torch) keeps them per layer for
one daemon's local slots (``LocalFingerprints``), learns which fingerprint each logical expert
has from a record (``ExpertContents``), and says what a slot holds in words ("expert 3",
"zero-filled", "parts 0-1 of expert 3, parts 2-3 of expert 5", "unknown content").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from layout_ledger.core.errors import InvalidRequest

PARTS = 4
HEX_PER_PART = 16
FINGERPRINT_LENGTH = PARTS * HEX_PER_PART
ZERO_PART = "0" * HEX_PER_PART
ZERO = ZERO_PART * PARTS
UNKNOWN = "unknown content"
ZERO_FILLED = "zero-filled"

_HEX = frozenset("0123456789abcdef")


def is_fingerprint(value: Any) -> bool:
    """64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == FINGERPRINT_LENGTH and set(value) <= _HEX


def parts_of(fingerprint: str) -> tuple[str, ...]:
    return tuple(
        fingerprint[index : index + HEX_PER_PART]
        for index in range(0, FINGERPRINT_LENGTH, HEX_PER_PART)
    )


def short(fingerprint: str) -> str:
    """The first 12 digits, as messages show a fingerprint."""
    return fingerprint[:12]


@dataclass(frozen=True)
class LocalFingerprints:
    """One daemon's fingerprints of its local slots, ``first_slot`` on, per layer.

    ``layers`` holds only the layers that have routed-expert tensors (a dense layer has none).
    """

    first_slot: int
    layers: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    def slots(self, layer: int) -> Iterator[tuple[int, str]]:
        """Each local slot of ``layer`` with its fingerprint: ``(slot, fingerprint)``, in slot
        order from ``first_slot``. Every loop over a layer's local slots goes through here."""
        return enumerate(self.layers[layer], start=self.first_slot)

    def row_json(self, layer: int) -> str:
        """A layer's fingerprints as the ledger stores them (compact JSON array)."""
        return json.dumps(list(self.layers[layer]), separators=(",", ":"))

    def only(self, layers: Iterable[int]) -> LocalFingerprints:
        """These fingerprints of ``layers`` alone (a layer they do not cover is left out)."""
        return LocalFingerprints(
            self.first_slot, {layer: self.layers[layer] for layer in layers if layer in self.layers}
        )

    def updated(self, other: LocalFingerprints) -> LocalFingerprints:
        """These fingerprints with ``other``'s layers replacing theirs."""
        return LocalFingerprints(self.first_slot, {**self.layers, **other.layers})


def fingerprints_from_wire(
    raw: Any, layers: Sequence[int], first_slot: int, num_slots: int
) -> LocalFingerprints:
    """A request's ``fingerprints``: ``{layer: [fingerprint, ...]}`` for exactly ``layers``."""
    if not isinstance(raw, Mapping):
        raise InvalidRequest(
            f"fingerprints must be a dict {{layer: [fingerprint, ...]}}, got {type(raw).__name__}"
        )
    for key in raw:
        if type(key) is not int:
            raise InvalidRequest(f"fingerprints key {key!r} is not an int layer")
    if set(raw) != set(layers):
        shown = sorted(raw, key=str)
        raise InvalidRequest(
            f"fingerprints cover layers {shown} but must cover exactly layers {list(layers)}"
        )
    checked: dict[int, tuple[str, ...]] = {}
    for layer in layers:
        values = raw[layer]
        if not isinstance(values, list) or len(values) != num_slots:
            raise InvalidRequest(
                f"fingerprints of layer {layer} must be a list of this daemon's {num_slots} "
                f"local slots' fingerprints"
            )
        for index, value in enumerate(values):
            if not is_fingerprint(value):
                raise InvalidRequest(
                    f"fingerprint of layer {layer} slot {first_slot + index} is not "
                    f"{FINGERPRINT_LENGTH} lowercase hex digits"
                )
        checked[layer] = tuple(values)
    return LocalFingerprints(first_slot, checked)


def expected_fingerprints_from_wire(
    raw: Any, layers: Sequence[int], num_logical_experts: int
) -> dict[int, dict[int, str]]:
    """A repair's ``expected_fingerprints``: ``{layer: {expert: fingerprint}}`` (None: none),
    layers among ``layers``, experts int logical ids: each expert's whole-slot fingerprint as
    the daemon that holds it recorded it (the engine's all-gather knows every daemon's)."""
    if raw is None:
        return {}
    shape = "a dict {layer: {expert: fingerprint}}"
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"expected_fingerprints must be {shape}, got {type(raw).__name__}")
    checked: dict[int, dict[int, str]] = {}
    for layer, experts in raw.items():
        if type(layer) is not int or layer not in layers:
            raise InvalidRequest(
                f"expected_fingerprints key {layer!r} is not one of the repaired layers "
                f"{list(layers)}"
            )
        if not isinstance(experts, Mapping) or len(experts) > num_logical_experts:
            raise InvalidRequest(f"expected_fingerprints of layer {layer} must be {shape}")
        of_layer: dict[int, str] = {}
        for expert, value in experts.items():
            if type(expert) is not int or not 0 <= expert < num_logical_experts:
                raise InvalidRequest(
                    f"expected_fingerprints of layer {layer}: key {expert!r} is not a logical "
                    f"expert id below {num_logical_experts}"
                )
            if not is_fingerprint(value):
                raise InvalidRequest(
                    f"expected_fingerprints of layer {layer} expert {expert} is not "
                    f"{FINGERPRINT_LENGTH} lowercase hex digits"
                )
            of_layer[expert] = value
        checked[layer] = of_layer
    return checked


def differing_parts(first: str, second: str) -> str:
    """Which parts of two fingerprints differ: ``parts 0-3``, ``part 2``, ``parts 0-1, 3``."""
    indexes = [
        index
        for index, (a, b) in enumerate(zip(parts_of(first), parts_of(second), strict=True))
        if a != b
    ]
    runs: list[list[int]] = []
    for index in indexes:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)
    return ("part " if indexes and len(indexes) == 1 else "parts ") + text


# --- what a slot holds ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Identified:
    """What a fingerprint says a slot holds: whole known experts (one, or several tied: the
    same bytes), or ``text`` only."""

    expert: int | None
    text: str
    experts: tuple[int, ...] = ()

    @property
    def whole_expert(self) -> bool:
        return bool(self.experts)

    def is_expert(self, expert: int) -> bool:
        """The slot holds ``expert``'s bytes (alone, or tied with others)."""
        return expert in self.experts


class ExpertContents:
    """Per layer, the fingerprint of each logical expert, learned from recorded slots.

    Two fingerprints for one expert are a conflict (``conflicts``): the recorded slots cannot
    say which is right. One fingerprint for several experts is not: they are *tied* (a pruned,
    merged or randomly initialised model, a checkpoint that shares tensors), their bytes are
    the same, so a slot holding them holds each of them (``tied``). Checks compare bytes: content
    equal to the expected expert's content is the expected content.
    """

    def __init__(self) -> None:
        self._of_expert: dict[int, dict[int, str]] = {}
        self._of_fingerprint: dict[int, dict[str, list[int]]] = {}
        self.conflicts: list[str] = []

    def learn(self, layer: int, expert: int, fingerprint: str, where: str) -> None:
        """``where`` names the slot in a conflict's text. A zero-filled slot teaches nothing."""
        if fingerprint == ZERO:
            return
        experts = self._of_expert.setdefault(layer, {})
        known = experts.get(expert)
        if known is not None and known != fingerprint:
            self.conflicts.append(
                f"layer {layer}: expert {expert} was recorded with two contents "
                f"({short(known)}..., and {short(fingerprint)}... at {where})"
            )
            return
        experts[expert] = fingerprint
        holders = self._of_fingerprint.setdefault(layer, {}).setdefault(fingerprint, [])
        if expert not in holders:
            holders.append(expert)
            holders.sort()

    def learn_slots(self, layer: int, row: Sequence[int], local: LocalFingerprints) -> None:
        """Learn from ``layer``'s local slots: the expert ``row`` (its map row) names in each,
        and the fingerprint ``local`` recorded there."""
        for slot, fingerprint in local.slots(layer):
            self.learn(layer, int(row[slot]), fingerprint, f"slot {slot}")

    def fingerprint_of(self, layer: int, expert: int) -> str | None:
        """The fingerprint learned for ``expert`` of ``layer`` (None: never learned)."""
        return self._of_expert.get(layer, {}).get(expert)

    def tied(self) -> dict[int, list[tuple[int, ...]]]:
        """Per layer (only those with any), the groups of experts learned with the same bytes."""
        found: dict[int, list[tuple[int, ...]]] = {}
        for layer, holders in sorted(self._of_fingerprint.items()):
            groups = sorted(tuple(experts) for experts in holders.values() if len(experts) > 1)
            if groups:
                found[layer] = groups
        return found

    def identify(self, layer: int, fingerprint: str) -> Identified:
        """What ``fingerprint`` holds, as far as this layer's known experts tell."""
        if fingerprint == ZERO:
            return Identified(None, ZERO_FILLED)
        holders = self._of_fingerprint.get(layer, {}).get(fingerprint)
        if holders:
            experts = tuple(holders)
            if len(experts) == 1:
                return Identified(experts[0], f"expert {experts[0]}", experts)
            names = "/".join(str(expert) for expert in experts)
            return Identified(None, f"experts {names} (tied)", experts)
        owners = [
            self._part_owner(layer, index, part) for index, part in enumerate(parts_of(fingerprint))
        ]
        if all(owner == UNKNOWN for owner in owners):
            return Identified(None, UNKNOWN)
        return Identified(None, _describe_parts(owners))

    def _part_owner(self, layer: int, index: int, part: str) -> str:
        if part == ZERO_PART:
            return ZERO_FILLED
        owners = sorted(
            expert
            for expert, fingerprint in self._of_expert.get(layer, {}).items()
            if parts_of(fingerprint)[index] == part
        )
        if not owners:
            return UNKNOWN
        return "expert " + "/".join(str(owner) for owner in owners)


def _describe_parts(owners: Sequence[str]) -> str:
    """``parts 0-1 of expert 3, parts 2-3 of expert 5`` (runs of equal owners)."""
    runs: list[tuple[int, int, str]] = []
    for index, owner in enumerate(owners):
        if runs and runs[-1][2] == owner:
            runs[-1] = (runs[-1][0], index, owner)
        else:
            runs.append((index, index, owner))
    texts = []
    for first, last, owner in runs:
        which = f"part {first}" if first == last else f"parts {first}-{last}"
        texts.append(f"{which} {owner}" if owner == ZERO_FILLED else f"{which} of {owner}")
    return "partial: " + ", ".join(texts)


# --- comparisons the daemon makes ---------------------------------------------------------------


def replica_disagreements(
    physical_to_logical_map: Sequence[Sequence[int]], local: LocalFingerprints
) -> dict[int, str]:
    """Per layer, the local slots the map gives one expert whose fingerprints differ (a load
    that left a replica unfilled), in words; layers where every replica agrees are absent."""
    found: dict[int, str] = {}
    for layer in sorted(local.layers):
        row = physical_to_logical_map[layer]
        slots_of: dict[int, list[tuple[int, str]]] = {}
        for slot, fingerprint in local.slots(layer):
            slots_of.setdefault(int(row[slot]), []).append((slot, fingerprint))
        texts = []
        for expert, held in sorted(slots_of.items()):
            if len({fingerprint for _, fingerprint in held}) > 1:
                shown = ", ".join(
                    f"slot {slot} {_summary(fingerprint)}" for slot, fingerprint in held
                )
                texts.append(f"expert {expert} in slots that differ ({shown})")
        if texts:
            found[layer] = f"layer {layer}: " + "; ".join(texts)
    return found


def empty_experts(
    physical_to_logical_map: Sequence[Sequence[int]], local: LocalFingerprints
) -> dict[int, str]:
    """Per layer, the experts whose every local slot is zero-filled (+0.0 or -0.0 throughout:
    a load that never filled them), in words; an expert some of whose slots hold bytes is a
    replica disagreement instead (``replica_disagreements``). A zero-filled only copy agrees
    with nothing, so only this finds it."""
    found: dict[int, str] = {}
    for layer in sorted(local.layers):
        row = physical_to_logical_map[layer]
        slots_of: dict[int, list[tuple[int, str]]] = {}
        for slot, fingerprint in local.slots(layer):
            slots_of.setdefault(int(row[slot]), []).append((slot, fingerprint))
        texts = []
        for expert, held in sorted(slots_of.items()):
            if all(fingerprint == ZERO for _, fingerprint in held):
                where = ", ".join(str(slot) for slot, _ in held)
                which = "slot" if len(held) == 1 else "slots"
                texts.append(
                    f"expert {expert} in {which} {where} is zero-filled (no local copy holds "
                    f"its weights)"
                )
        if texts:
            found[layer] = f"layer {layer}: " + "; ".join(texts)
    return found


def _summary(fingerprint: str) -> str:
    return ZERO_FILLED if fingerprint == ZERO else f"{short(fingerprint)}..."


def changed_slots(
    recorded: LocalFingerprints, current: LocalFingerprints, skip: Iterable[int] = ()
) -> dict[int, list[int]]:
    """Per layer (but ``skip``), the local slots (indexes) whose fingerprint is not the recorded."""
    skipped = set(skip)
    changed: dict[int, list[int]] = {}
    for layer, fingerprints in sorted(recorded.layers.items()):
        if layer in skipped:
            continue
        now = current.layers.get(layer)
        if now is None:
            continue
        indexes = [i for i, (a, b) in enumerate(zip(fingerprints, now, strict=False)) if a != b]
        if indexes:
            changed[layer] = indexes
    return changed


def describe_changes(
    changed: Mapping[int, Sequence[int]],
    current: LocalFingerprints,
    known: ExpertContents,
    physical_to_logical_map: Sequence[Sequence[int]],
    *,
    limit: int = 8,
) -> str:
    """``layer 2 slot 7: expert 3 by the record, holds expert 5; ...`` (at most ``limit``)."""
    texts = []
    for layer, indexes in changed.items():
        for index in indexes:
            slot = current.first_slot + index
            held = known.identify(layer, current.layers[layer][index]).text
            named = physical_to_logical_map[layer][slot]
            texts.append(f"layer {layer} slot {slot}: expert {named} by the record, holds {held}")
    more = len(texts) - limit
    return "; ".join(texts[:limit]) + (f"; and {more} more" if more > 0 else "")
