"""``layout-ledger show``: the map at a version, in sglang's ``format_expert_location_layout``
text, optionally with the fingerprints the daemon recorded for its slots.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from layout_ledger.cli import exit_codes
from layout_ledger.cli.held_maps import HeldMap, check_ep_size, geometry_json, held_map
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.layer_ranges import LayerRanges, check_layers
from layout_ledger.cli.output import emit
from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.layout import Map
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.rows import fingerprints_at


def run(args: argparse.Namespace) -> int:
    with LedgerReader(args.ledger) as ledger:
        collected = collect_show(
            ledger,
            incarnation_id=args.incarnation,
            version=args.version,
            layers=args.layers,
            ep_size=args.ep_size,
            fingerprints=args.fingerprints,
        )
    emit(args, collected.to_json(), render_show(collected))
    return exit_codes.OK


def format_physical_to_logical_map(
    physical_to_logical_map: Map, ep_size: int, layer_ids: Sequence[int] | None = None
) -> str:
    """The text of sglang 0.5.23's ``format_physical_to_logical_map`` (which
    ``format_expert_location_layout`` returns), reproduced without importing sglang or torch;
    tests/test_cli_sglang.py compares the two on the same maps. Like sglang's, it takes any
    ``ep_size >= 1`` (whole rows when it does not divide the slots); ``show`` passes only one
    that does (``check_ep_size``)."""
    num_layers = len(physical_to_logical_map)
    if num_layers == 0 or not physical_to_logical_map[0]:
        return "<empty>"
    num_physical = len(physical_to_logical_map[0])
    local, remainder = divmod(num_physical, ep_size)
    lines = [
        "physical_to_logical_map "
        f"num_layers={num_layers} "
        f"num_physical_experts={num_physical} "
        f"ep_size={ep_size}"
    ]
    for layer in range(num_layers) if layer_ids is None else layer_ids:
        row = physical_to_logical_map[layer]
        if remainder != 0:
            lines.append(f"layer={layer}: physical={json.dumps(row, separators=(',', ':'))}")
            continue
        chunks = [
            f"ep{rank}={json.dumps(row[rank * local : (rank + 1) * local], separators=(',', ':'))}"
            for rank in range(ep_size)
        ]
        lines.append(f"layer={layer}: " + " ".join(chunks))
    return "\n".join(lines)


def _held_json(held: HeldMap) -> JsonObject:
    return {
        "incarnation_id": held.incarnation.incarnation_id,
        "version": held.version,
        "digest": held.digest,
        **geometry_json(held.incarnation.geometry),
    }


@dataclass(frozen=True)
class SlotPrint(JsonShaped):
    slot: int
    fingerprint: str


def _prints_json(prints: tuple[SlotPrint, ...] | None) -> JsonObject:
    return {} if prints is None else {"fingerprints": [p.to_json() for p in prints]}


@dataclass(frozen=True)
class ShownLayer(JsonShaped):
    layer: int
    slots: tuple[int, ...]
    # With --fingerprints: the daemon's local slots' fingerprints at that version.
    fingerprints: tuple[SlotPrint, ...] | None = field(
        default=None, metadata=json_field(convert=_prints_json, spread=True)
    )


@dataclass(frozen=True)
class ShowReport(JsonShaped):
    path: str
    held: HeldMap = field(metadata=json_field(convert=_held_json, spread=True))
    ep_size: int
    layers: tuple[ShownLayer, ...]


def collect_show(
    ledger: LedgerReader,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
    layers: LayerRanges | None = None,
    ep_size: int = 1,
    fingerprints: bool = False,
) -> ShowReport:
    with ledger.connect() as conn:
        held = held_map(conn, incarnation_id, version)
        recorded = fingerprints_at(conn, held.incarnation, held.version) if fingerprints else None
    check_ep_size(ep_size, held.incarnation.geometry)
    chosen = check_layers(layers, held.incarnation.geometry)
    shown = tuple(
        ShownLayer(
            layer,
            tuple(held.physical_to_logical_map[layer]),
            _slot_prints(recorded, layer) if fingerprints else None,
        )
        for layer in chosen
    )
    return ShowReport(str(ledger.path), held, ep_size, shown)


def _slot_prints(recorded: LocalFingerprints | None, layer: int) -> tuple[SlotPrint, ...]:
    if recorded is None or layer not in recorded.layers:
        return ()
    return tuple(
        SlotPrint(recorded.first_slot + index, value)
        for index, value in enumerate(recorded.layers[layer])
    )


def render_show(report: ShowReport) -> list[str]:
    layer_ids = [shown.layer for shown in report.layers]
    shown_text = format_physical_to_logical_map(
        report.held.physical_to_logical_map, report.ep_size, layer_ids
    )
    lines = shown_text.split("\n")
    printed = [shown for shown in report.layers if shown.fingerprints is not None]
    if printed:
        lines.append(
            f"slot fingerprints at version {report.held.version} (the daemon's own slots; the "
            f"first 12 of 64 hex digits; - none recorded)"
        )
        for shown in printed:
            cells = [f"{p.slot}={p.fingerprint[:12]}" for p in shown.fingerprints or ()]
            lines.append(f"layer={shown.layer}: " + (" ".join(cells) or "-"))
    return lines
