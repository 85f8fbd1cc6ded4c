"""``layout-ledger plot``: the map at one version as a picture, and with ``--moves`` the
slots each commit moved over time (PNG, SVG or PDF, by the output's suffix).

matplotlib (Agg) is an optional extra (``[plot]``), imported only when a picture is drawn.
"""

from __future__ import annotations

import argparse
import datetime
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_ledger.cli import exit_codes
from layout_ledger.cli.atomic_files import write_atomically
from layout_ledger.cli.held_maps import HeldMap, check_ep_size, held_map
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit
from layout_ledger.cli.progress import Progress
from layout_ledger.cli.terminal import printable
from layout_ledger.core.errors import LedgerError
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.version_walk import walk_versions


def run(args: argparse.Namespace) -> int:
    width, height = args.size
    with LedgerReader(args.ledger) as ledger, Progress("plot") as progress:
        collected = plot_layout(
            ledger,
            args.output,
            incarnation_id=args.incarnation,
            version=args.version,
            ep_size=args.ep_size,
            moves=args.moves,
            width=width,
            height=height,
            on_phase=progress.phase,
        )
    emit(args, collected.to_json(), render_plot(collected))
    return exit_codes.OK


DPI = 100
DEFAULT_WIDTH = 1200
DEFAULT_HEIGHT = 800
MIN_PIXELS = 200
MAX_PIXELS = 10000
# Cells get their expert id written in them while the map is this small.
ANNOTATE_MAX_CELLS = 600
# The pictures matplotlib's Agg canvas writes, by the output's suffix (lower case).
PICTURE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


@dataclass(frozen=True)
class CommitMove(JsonShaped):
    version: int
    at: str
    engine_id: str | None
    moved_slots: int


@dataclass(frozen=True)
class PlotReport(JsonShaped):
    path: str
    output: str
    incarnation_id: int
    version: int
    digest: str
    ep_size: int
    width: int
    height: int
    moves: tuple[CommitMove, ...] | None


def render_plot(report: PlotReport) -> list[str]:
    text = (
        f"wrote {report.output} ({report.width}x{report.height}): incarnation "
        f"{report.incarnation_id} version {report.version} (digest {report.digest[:12]}), "
        f"ep_size {report.ep_size}"
    )
    if report.moves is not None:
        moved = sum(move.moved_slots for move in report.moves)
        commits = "1 commit" if len(report.moves) == 1 else f"{len(report.moves)} commits"
        text += f"; {commits} moving {moved} slots in all"
    return [text]


def picture_format(output: Path) -> str:
    """The format the output's suffix names; any suffix but those of ``PICTURE_FORMATS`` is
    refused."""
    form = PICTURE_FORMATS.get(output.suffix.lower())
    if form is None:
        names = [f"*{suffix}" for suffix in PICTURE_FORMATS]
        raise LedgerError(
            f"name the picture {', '.join(names[:-1])} or {names[-1]} (got {output}): plot "
            f"writes the format its suffix names"
        )
    return form


def _check_size(width: int, height: int) -> None:
    for name, value in (("width", width), ("height", height)):
        if not MIN_PIXELS <= value <= MAX_PIXELS:
            raise LedgerError(
                f"the picture's {name} must be {MIN_PIXELS}..{MAX_PIXELS} pixels, got {value}"
            )


def _matplotlib() -> tuple[Any, Any, Any]:
    try:
        import matplotlib
        import matplotlib.colors
        import matplotlib.ticker
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise LedgerError(
            "plot needs matplotlib, which is not installed; install it into the environment "
            "that runs layout-ledger: python -m pip install matplotlib (the [plot] extra)"
        ) from exc
    return matplotlib, Figure, FigureCanvasAgg


def _draw_map(matplotlib: Any, figure: Any, axes: Any, held: HeldMap, ep_size: int) -> None:
    geometry = held.incarnation.geometry
    experts = geometry.num_logical_experts
    if experts <= 20:  # one distinct qualitative colour per expert
        palette = matplotlib.colormaps["tab10" if experts <= 10 else "tab20"].colors[:experts]
        colormap = matplotlib.colors.ListedColormap(palette)
    else:
        colormap = matplotlib.colormaps["turbo"].resampled(experts)
    integer_ticks = matplotlib.ticker.MaxNLocator(integer=True)
    image = axes.imshow(
        held.physical_to_logical_map,
        aspect="auto",
        interpolation="nearest",
        cmap=colormap,
        vmin=-0.5,
        vmax=experts - 0.5,
    )
    colorbar = figure.colorbar(image, ax=axes, fraction=0.04, pad=0.02)
    colorbar.set_label("logical expert")
    colorbar.locator = integer_ticks
    colorbar.update_ticks()
    axes.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes.set_xlabel("physical slot")
    axes.set_ylabel("layer")
    # The digest is ledger text: escaped, so a warning about a glyph cannot carry a control
    # character to the terminal either.
    axes.set_title(
        printable(
            f"incarnation {held.incarnation.incarnation_id}, version {held.version} "
            f"(digest {held.digest[:12]})"
        )
    )
    local = geometry.num_physical_slots // ep_size
    for rank in range(1, ep_size):
        axes.axvline(rank * local - 0.5, color="black", linewidth=3)
        axes.axvline(rank * local - 0.5, color="white", linewidth=1.2)
    if ep_size > 1:
        top = axes.secondary_xaxis("top")
        top.set_xticks([rank * local + (local - 1) / 2 for rank in range(ep_size)])
        top.set_xticklabels([f"ep{rank}" for rank in range(ep_size)])
        top.tick_params(length=0)
    if geometry.num_layers * geometry.num_physical_slots <= ANNOTATE_MAX_CELLS:
        for layer, row in enumerate(held.physical_to_logical_map):
            for slot, expert in enumerate(row):
                axes.text(slot, layer, str(expert), ha="center", va="center", fontsize=7)


def _draw_moves(axes: Any, moves: tuple[CommitMove, ...], floor: int) -> None:
    axes.set_title("slots moved per commit")
    axes.set_ylabel("slots moved")
    if not moves:
        axes.text(0.5, 0.5, "no commit held", ha="center", va="center", transform=axes.transAxes)
        axes.set_xticks([])
        return
    times = [datetime.datetime.fromisoformat(move.at) for move in moves]
    counts = [move.moved_slots for move in moves]
    axes.vlines(times, 0, counts, color="tab:blue", linewidth=1.5)
    axes.plot(times, counts, "o", color="tab:blue", markersize=5 if len(moves) <= 50 else 2)
    axes.set_ylim(bottom=0, top=max(*counts, 1) * 1.15)
    axes.set_xlabel("commit time (UTC)" + (f"; versions before {floor} pruned" if floor else ""))
    if len(moves) <= 30:
        for move, when in zip(moves, times, strict=True):
            axes.annotate(
                f"v{move.version}",
                (when, move.moved_slots),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=7,
            )
    for label in axes.get_xticklabels():
        label.set_rotation(30)
        label.set_horizontalalignment("right")


def plot_layout(
    ledger: LedgerReader,
    output: str | Path,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
    ep_size: int = 1,
    moves: bool = False,
    width: int = DEFAULT_WIDTH,
    height: int = DEFAULT_HEIGHT,
    on_phase: Callable[[str], None] | None = None,
) -> PlotReport:
    """Draw the map at ``version`` (and, with ``moves``, the moves) into ``output``, in the
    format its suffix names (``picture_format``)."""
    output = Path(output)
    form = picture_format(output)
    _check_size(width, height)
    phase = on_phase or (lambda text: None)
    held_moves: tuple[CommitMove, ...] | None = None
    floor = 0
    with ledger.connect() as conn:
        phase("reading the map")
        held = held_map(conn, incarnation_id, version)
        if moves:
            phase("reading every commit's moves")
            steps = list(walk_versions(conn, held.incarnation))
            floor = steps[0].version
            held_moves = tuple(
                CommitMove(step.version, step.committed_at, step.engine_id, step.moved_slots)
                for step in steps
                if step.moved_slots is not None
            )
    check_ep_size(ep_size, held.incarnation.geometry)
    phase("drawing")
    matplotlib, figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    canvas_class(figure)
    if held_moves is None:
        _draw_map(matplotlib, figure, figure.add_subplot(1, 1, 1), held, ep_size)
    else:
        top, bottom = figure.subplots(2, 1, height_ratios=(3, 1))
        _draw_map(matplotlib, figure, top, held, ep_size)
        _draw_moves(bottom, held_moves, floor)
    phase(f"writing {output.name}")
    buffer = io.BytesIO()
    figure.savefig(buffer, format=form, dpi=DPI)
    write_atomically(output, buffer.getvalue())
    return PlotReport(
        path=str(ledger.path),
        output=str(output),
        incarnation_id=held.incarnation.incarnation_id,
        version=held.version,
        digest=held.digest,
        ep_size=ep_size,
        width=width,
        height=height,
        moves=held_moves,
    )
