"""The sglang lines the hooks depend on are still there, and are cited in one place only.

Every module of ``sglang_integration`` that depends on a line of sglang keeps one
``UPSTREAM_LINES`` table (``sglang_integration.upstream_lines``); each row must still hold its
text in the installed sglang. Line numbers appear nowhere else in the plugin or docs/daemon.md.
"""

from __future__ import annotations

import ast
import importlib
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from sglang_integration.upstream_lines import SGLANG_VERSION, UpstreamLine, sglang_root, stale_rows

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "sglang_integration"
# A citation of a source line: "daemon.py:889", "eplb_manager.py:96-185", "(line 556)".
CITATION = re.compile(r"\b\w+\.py:\d+|\blines? \d{2,}")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _modules_with_tables() -> list[str]:
    """Every plugin module that assigns ``UPSTREAM_LINES`` at module level."""
    found = []
    for path in sorted(PLUGIN.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        if "UPSTREAM_LINES" in names:
            found.append(_module_name(path))
    return found


def _tables() -> dict[str, tuple[UpstreamLine, ...]]:
    return {name: importlib.import_module(name).UPSTREAM_LINES for name in _modules_with_tables()}


def test_each_hook_point_keeps_its_table_of_upstream_lines() -> None:
    tables = _tables()
    for hook_point in (
        "sglang_integration.plugin",
        "sglang_integration.daemon.hooks",
        "sglang_integration.daemon.launcher",
        "sglang_integration.engine.startup",
        "sglang_integration.engine.load_check",
        "sglang_integration.engine.ipc_loader",
        "sglang_integration.engine.metadata",
        "sglang_integration.engine.rebalance",
    ):
        assert tables.get(hook_point), hook_point
    for name, rows in tables.items():
        assert all(isinstance(row, UpstreamLine) for row in rows), name


def test_every_upstream_line_still_holds_its_text_in_the_installed_sglang() -> None:
    root = sglang_root()
    if root is None:
        pytest.skip("sglang is not installed, so the upstream line tables cannot be checked")
    stale = {name: stale_rows(rows, root) for name, rows in _tables().items()}
    stale = {name: rows for name, rows in stale.items() if rows}
    assert stale == {}, (
        f"sglang {version('sglang')} (the tables were written against {SGLANG_VERSION}) moved "
        "lines the hooks depend on: recheck each hook, then its table"
    )


def test_line_numbers_of_sglang_are_cited_only_in_the_tables() -> None:
    cited = []
    for path in [*sorted(PLUGIN.rglob("*.py")), ROOT / "docs" / "daemon.md"]:
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if CITATION.search(line):
                cited.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert cited == []


def test_a_moved_line_is_reported_with_what_it_holds_now(tmp_path: Path) -> None:
    (tmp_path / "srt").mkdir()
    (tmp_path / "srt" / "daemon.py").write_text("def load(self):\n    sock.listen(16)\n")
    rows = [
        UpstreamLine("srt/daemon.py", 1, "def load(self", "kept"),
        UpstreamLine("srt/daemon.py", 2, "sock.listen(8)", "the backlog"),
        UpstreamLine("srt/daemon.py", 9, "serve", "past the end"),
        UpstreamLine("srt/gone.py", 1, "x", "a file that went"),
    ]
    assert stale_rows(rows, tmp_path) == [
        "srt/daemon.py:2 should hold 'sock.listen(8)' (the backlog); it holds "
        "'    sock.listen(16)'",
        "srt/daemon.py:9 should hold 'serve' (past the end); it holds None",
        "srt/gone.py:1 should hold 'x' (a file that went); it holds None",
    ]
