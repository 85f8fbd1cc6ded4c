"""The sglang lines a hook depends on: the row of each hook module's ``UPSTREAM_LINES`` table.

Where a hook must know an sglang internal (a call's place, a line it repeats, an attribute it
reads), its module keeps one table of those lines, each with the text that must still be on it,
so an upgrade of sglang is checked line by line (``stale_rows``; tests/test_upstream_lines.py
runs it against the installed sglang) instead of trusting numbers scattered through docstrings.
Import-light: it never imports sglang.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.23"  # the version every table was written against


@dataclass(frozen=True)
class UpstreamLine:
    """One line of sglang (``SGLANG_VERSION``) a hook depends on."""

    file: str  # relative to the sglang package, e.g. "srt/weight_cache/daemon.py"
    line: int
    text: str  # what the line holds (a name, or a piece of its code)
    why: str  # what the hook takes from it


def sglang_root() -> Path | None:
    """The installed sglang package's directory, found without importing it (None: absent)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def stale_rows(rows: Iterable[UpstreamLine], root: Path) -> list[str]:
    """Every row whose line in the sglang at ``root`` no longer holds its text."""
    stale = []
    for row in rows:
        path = root / row.file
        lines = path.read_text().splitlines() if path.is_file() else []
        found = lines[row.line - 1] if 0 < row.line <= len(lines) else None
        if found is None or row.text not in found:
            stale.append(
                f"{row.file}:{row.line} should hold {row.text!r} ({row.why}); it holds {found!r}"
            )
    return stale
