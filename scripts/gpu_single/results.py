"""The check's results: stages of rows (what, expected, measured, held?), rendered as a table
and written as JSON."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Column widths; longer cells wrap onto more lines of the same row.
CELL_WIDTHS = (58, 26, 26)
SKIPPED = "skipped"


@dataclass(frozen=True)
class Row:
    """One expected outcome; ``ok`` is None for a measurement shown for information only."""

    what: str
    expected: str
    measured: str
    ok: bool | None


@dataclass
class Stage:
    name: str  # short, for the summary line
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    status: str = "ran"  # "ran", "skipped: <why>", "failed: <why>"
    seconds: float = 0.0
    output: str = ""  # a command's own output, shown after the table

    def check(self, what: str, expected: Any, measured: Any, ok: bool) -> bool:
        self.rows.append(Row(what, str(expected), str(measured), bool(ok)))
        return bool(ok)

    def info(self, what: str, measured: Any) -> None:
        self.rows.append(Row(what, "-", str(measured), None))

    @property
    def failed(self) -> list[Row]:
        return [row for row in self.rows if row.ok is False]

    @property
    def broken(self) -> bool:
        """The stage could not run to its end (a process failed or timed out)."""
        return self.status.startswith("failed")


def render_stage(stage: Stage) -> str:
    lines = [stage.title, f"  [{stage.status}, {stage.seconds:.1f} s]"]
    if not stage.rows:
        return "\n".join(lines + [f"  note: {note}" for note in stage.notes])
    rows = [("check", "expected", "measured", "result")]
    for row in stage.rows:
        result = "-" if row.ok is None else ("ok" if row.ok else "FAILED")
        rows.append((row.what, row.expected, row.measured, result))
    for index, row in enumerate(rows):
        cells = [
            textwrap.wrap(text, w) or [""] for text, w in zip(row[:3], CELL_WIDTHS, strict=True)
        ]
        for line in range(max(len(cell) for cell in cells)):
            parts = [
                (cell[line] if line < len(cell) else "").ljust(w)
                for cell, w in zip(cells, CELL_WIDTHS, strict=True)
            ]
            lines.append("  " + "  ".join(parts) + ("  " + row[3] if line == 0 else ""))
        if index == 0:
            lines.append("  " + "-" * (sum(CELL_WIDTHS) + 2 * len(CELL_WIDTHS) + 6))
    lines += [f"  note: {note}" for note in stage.notes]
    return "\n".join(lines)


def exit_code(stages: list[Stage]) -> int:
    """0 every check held; 1 a check failed; 2 a stage could not run to its end."""
    if any(stage.broken for stage in stages):
        return 2
    if any(stage.failed for stage in stages):
        return 1
    return 0


def summary(stages: list[Stage]) -> str:
    checks = [row for stage in stages for row in stage.rows if row.ok is not None]
    held = sum(1 for row in checks if row.ok)
    skipped = [stage.name for stage in stages if stage.status.startswith(SKIPPED)]
    broken = [stage.name for stage in stages if stage.broken]
    text = f"{held}/{len(checks)} checks held"
    if skipped:
        text += f"; skipped: {', '.join(skipped)}"
    if broken:
        text += f"; did not run to the end: {', '.join(broken)}"
    return text


def write_json(path: Path, header: dict[str, Any], stages: list[Stage], code: int) -> None:
    document = {"versions": header, "exit_code": code, "stages": [asdict(s) for s in stages]}
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")
