"""``layout-ledger export``: write a map as a file that ``--init-expert-location`` accepts.

With ``--check`` the file becomes the output only once sglang itself loaded it and found the
ledger's map (``cli.sglang_export_check``, imported only then). Safe in a script: a dirty ledger
or one with a move pending is refused (exit 3 or 4, the reason and the runbook's section), and
an existing file is never replaced (exit 1), unless ``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from layout_ledger.cli import exit_codes
from layout_ledger.cli.atomic_files import write_atomically
from layout_ledger.cli.held_maps import geometry_json, held_map
from layout_ledger.cli.json_shape import JsonShaped, json_field
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.pending_moves import pending_text, pending_wire
from layout_ledger.cli.progress import Progress
from layout_ledger.cli.runbook import DIRTY, PENDING, see
from layout_ledger.core.errors import LedgerError, LedgerStorageError
from layout_ledger.core.layout import Geometry, Map, layout_digest
from layout_ledger.core.state import DirtyMark, PendingMove
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.replay import replayed


def run(args: argparse.Namespace) -> int:
    with LedgerReader(args.ledger) as ledger:
        exported, the_map = read_export(
            ledger, args.output, incarnation_id=args.incarnation, version=args.version
        )
    refused = export_refusal(exported)
    if refused is not None and not args.force:
        code, message = refused
        print_error("export", message)
        return code
    if args.check:
        return _export_checked(args, exported, the_map)
    exported = write_export(exported, the_map, replace=args.force)
    emit(args, {**exported.to_json(), "check": None}, render_export(exported))
    return exit_codes.OK


def _export_checked(args: argparse.Namespace, exported: ExportReport, the_map: Map) -> int:
    """``export --check``: the file becomes the output only once sglang loaded it and found the
    ledger's map; on any failure nothing is written (an earlier file stays as it was)."""
    from layout_ledger.cli import sglang_export_check as sglang_check

    sglang_check.check_inputs(args.model_path, exported.geometry, args.ep_size)
    checks: list[sglang_check.ExportCheck] = []

    def accept(temporary: Path) -> bool:
        with Progress("export --check") as progress:
            progress.phase("loading the file through sglang (imports sglang and torch)")
            return _accept(temporary)

    def _accept(temporary: Path) -> bool:
        check = sglang_check.check_export(
            temporary,
            args.model_path,
            the_map,
            exported.geometry,
            ep_size=args.ep_size,
            shown_as=args.output,
        )
        checks.append(check)
        return check.equal

    exported = write_export(exported, the_map, accept, replace=args.force)
    (check,) = checks
    lines = render_export(exported)
    lines.append(f"check with sglang: {'ok' if check.equal else 'FAILED'}: {check.detail}")
    emit(args, {**exported.to_json(), "check": check.to_json()}, lines)
    if check.equal:
        return exit_codes.OK
    print_error("export", f"check failed: {check.detail}")
    return exit_codes.INCONSISTENT


# sglang reads --init-expert-location as a file only when the name ends in .json (or .pt);
# any other value is parsed as inline JSON (compute_initial_expert_location_metadata).
EXPORT_SUFFIX = ".json"


@dataclass(frozen=True)
class ExportReport(JsonShaped):
    path: str
    output: str
    incarnation_id: int
    version: int
    digest: str
    geometry: Geometry = field(metadata=json_field(convert=geometry_json, spread=True))
    dirty: bool
    pending: PendingMove | None = field(metadata=json_field(convert=pending_wire))
    dirty_reason: str | None = None
    # False until the file is in place, and for good when export --check refused it.
    written: bool = field(default=False, metadata=json_field(omit=True))


def init_expert_location_text(physical_to_logical_map: Map) -> str:
    """The file ``--init-expert-location`` reads: one key (sglang passes every key of the file
    to ``ExpertLocationMetadata.init_by_mapping`` as a keyword), one layer per line."""
    rows = ",\n".join(
        "    " + json.dumps(row, separators=(",", ":")) for row in physical_to_logical_map
    )
    return '{\n  "physical_to_logical_map": [\n' + rows + "\n  ]\n}\n"


def read_export(
    ledger: LedgerReader,
    output: str | Path,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
) -> tuple[ExportReport, Map]:
    """What ``export`` would write (nothing written yet): the report and the map, after the
    output's name and the rows' digest are checked."""
    output = Path(output)
    if output.suffix != EXPORT_SUFFIX:
        raise LedgerError(
            f"name the output file *{EXPORT_SUFFIX} (got {output}): sglang reads "
            f"--init-expert-location as a file only when the name ends in {EXPORT_SUFFIX}"
        )
    with ledger.connect() as conn:
        held = held_map(conn, incarnation_id, version)
        i = held.incarnation.incarnation_id
        derived = replayed(conn, held.incarnation)
        dirty_mark: DirtyMark | None = derived.dirty
        pending = derived.pending
    if layout_digest(held.physical_to_logical_map) != held.digest:
        raise LedgerStorageError(
            f"the rows of incarnation {i} version {held.version} do not give its recorded "
            f"digest {held.digest[:12]}; nothing exported. Run `layout-ledger verify "
            f"{ledger.path}`"
        )
    report = ExportReport(
        path=str(ledger.path),
        output=str(output),
        incarnation_id=i,
        version=held.version,
        digest=held.digest,
        geometry=held.incarnation.geometry,
        dirty=dirty_mark is not None,
        pending=pending,
        dirty_reason=None if dirty_mark is None else dirty_mark.reason,
    )
    return report, held.physical_to_logical_map


# What export tells the person who would start an engine from a layout no daemon may hold.
_FORCE = "or pass --force to export it anyway"
_NO_REPLACE = "export never replaces a file: remove it, name another, or pass --force to replace it"


def export_refusal(report: ExportReport) -> tuple[int, str] | None:
    """Why ``export`` refuses this layout without ``--force`` (exit code, message), or None.

    A dirty incarnation's last committed layout need not be what its daemon's weights hold, and
    a pending move is changing it: an engine started from either file would route with a layout
    no daemon may hold. The runbook says to restart the daemons (dirty) or to wait (pending)."""
    where = f"incarnation {report.incarnation_id} of {report.path}"
    if report.dirty:
        return exit_codes.DIRTY, (
            f"{where} is dirty ({report.dirty_reason}); its last committed layout need not be "
            f"what the daemon's weights hold, so no engine should start from it: restart the "
            f"daemons first ({see(DIRTY)}), {_FORCE}"
        )
    if report.pending is not None:
        return exit_codes.PENDING_OR_REFUSALS, (
            f"{where} has a move pending ({pending_text(report.pending)}), which changes the "
            f"layout this file would hold: wait for it to commit, then export again "
            f"({see(PENDING)}), {_FORCE}"
        )
    return None


def write_export(
    report: ExportReport,
    the_map: Map,
    accept: Callable[[Path], bool] | None = None,
    *,
    replace: bool = False,
) -> ExportReport:
    """Write the map as ``report.output`` (``write_atomically``; ``accept`` may refuse it); an
    existing file is an error unless ``replace``."""
    data = init_expert_location_text(the_map).encode()
    written = write_atomically(
        Path(report.output), data, accept, replace=replace, refusal=_NO_REPLACE
    )
    return dataclasses.replace(report, written=written)


def render_export(report: ExportReport) -> list[str]:
    geometry = report.geometry
    what = (
        f"incarnation {report.incarnation_id} version {report.version} "
        f"(digest {report.digest[:12]}), {geometry.num_layers} layers x "
        f"{geometry.num_physical_slots} physical slots"
    )
    if report.written:
        lines = [
            f"wrote {report.output}: {what}",
            f"start an engine with it: --init-expert-location {report.output}",
        ]
    else:
        lines = [f"checked {report.output}, not written: {what}"]
    if report.dirty:
        lines.append(
            "note: this incarnation is dirty; the file holds its last committed layout, not "
            "necessarily what the daemon's memory holds"
        )
    if report.pending is not None:
        lines.append(
            f"note: a move is pending ({pending_text(report.pending)}); the file holds the "
            f"last committed layout, which that move changes when it commits"
        )
    return lines
