"""``layout-ledger diff``: the slots that changed between two versions of one incarnation.

Printed as sglang's ``format_expert_location_layout_diff`` lines, ``--json``, or one row per
changed slot (``--nl``, ``--csv``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import ClassVar

from layout_ledger.cli import exit_codes
from layout_ledger.cli.held_maps import held_map
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.layer_ranges import LayerRanges, check_layers
from layout_ledger.cli.output import emit
from layout_ledger.history.reader import LedgerReader


def run(args: argparse.Namespace) -> int:
    with LedgerReader(args.ledger) as ledger:
        collected = collect_diff(
            ledger,
            args.from_version,
            args.to_version,
            incarnation_id=args.incarnation,
            layers=args.layers,
        )
    lines = render_diff(collected, slots=args.slots)
    emit(args, collected.to_json(), lines, (DIFF_COLUMNS, collected.slot_rows()))
    return exit_codes.OK


@dataclass(frozen=True)
class SlotChange(JsonShaped):
    slot: int
    before: int = field(metadata=json_field(key="from"))
    after: int = field(metadata=json_field(key="to"))


@dataclass(frozen=True)
class LayerChange(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("changed",)

    layer: int
    slots: tuple[SlotChange, ...]

    @property
    def changed(self) -> int:
        return len(self.slots)


# The columns of diff's rows (--nl, --csv): one changed slot each.
DIFF_COLUMNS: tuple[str, ...] = ("layer", "slot", "from", "to")


@dataclass(frozen=True)
class DiffReport(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("changed_slots", "total_slots")

    path: str
    incarnation_id: int
    num_physical_slots: int = field(metadata=json_field(omit=True))
    from_version: int
    from_digest: str
    to_version: int
    to_digest: str
    layers: tuple[int, ...]
    changes: tuple[LayerChange, ...] = field(metadata=json_field(key="changed_layers"))

    @property
    def changed_slots(self) -> int:
        return sum(len(change.slots) for change in self.changes)

    @property
    def total_slots(self) -> int:
        return len(self.layers) * self.num_physical_slots

    def slot_rows(self) -> list[JsonObject]:
        """Every changed slot as a row of ``DIFF_COLUMNS``."""
        return [
            {"layer": change.layer, **slot.to_json()}
            for change in self.changes
            for slot in change.slots
        ]


def collect_diff(
    ledger: LedgerReader,
    from_version: int,
    to_version: int,
    *,
    incarnation_id: int | None = None,
    layers: LayerRanges | None = None,
) -> DiffReport:
    with ledger.connect() as conn:
        before = held_map(conn, incarnation_id, from_version)
        after = held_map(conn, before.incarnation.incarnation_id, to_version)
    geometry = before.incarnation.geometry
    chosen = check_layers(layers, geometry)
    changes = []
    for layer in chosen:
        old, new = before.physical_to_logical_map[layer], after.physical_to_logical_map[layer]
        moved = tuple(
            SlotChange(slot, a, b)
            for slot, (a, b) in enumerate(zip(old, new, strict=True))
            if a != b
        )
        if moved:
            changes.append(LayerChange(layer, moved))
    return DiffReport(
        path=str(ledger.path),
        incarnation_id=before.incarnation.incarnation_id,
        num_physical_slots=geometry.num_physical_slots,
        from_version=from_version,
        from_digest=before.digest,
        to_version=to_version,
        to_digest=after.digest,
        layers=tuple(chosen),
        changes=tuple(changes),
    )


def render_diff(report: DiffReport, *, slots: bool = False) -> list[str]:
    """sglang's ``format_expert_location_layout_diff`` lines under a header; ``slots`` adds one
    line per changed slot."""
    lines = [
        f"incarnation {report.incarnation_id}: version {report.from_version} "
        f"(digest {report.from_digest[:12]}) -> version {report.to_version} "
        f"(digest {report.to_digest[:12]})",
        f"changed_physical_slots={report.changed_slots}/{report.total_slots}",
    ]
    if not report.changes:
        lines.append("changed_layers=[]")
    for change in report.changes:
        lines.append(
            f"layer={change.layer}: changed={len(change.slots)}/{report.num_physical_slots}"
        )
        if slots:
            lines.extend(f"  slot {s.slot}: {s.before} -> {s.after}" for s in change.slots)
    return lines
