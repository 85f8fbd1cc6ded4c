"""Every command of docs/operations.md, run against the incidents' ledgers, prints what the page
shows and exits as it shows.

scripts/runbook_ledgers.py builds the ledgers (a process per daemon, the running ones alive for
the whole module); each console block's commands run as a shell runs them (the console script,
``cp`` in the incident's directory), and the output is compared line by line after
normalising what differs from run to run: times and "ago", pids, 64-digit digests and chain
heads, the host name, the directory, runs of spaces (column widths follow the paths). A page
line ``...`` stands for any lines.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from runbook_ledgers import block_incident, console_blocks, run_command, runbook_ledgers

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "operations.md"
PAGE_HOST = "vm"


def _blocks() -> list[list[tuple[str, list[str]]]]:
    return console_blocks(RUNBOOK.read_text())


def _normal(line: str) -> str:
    line = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", "TIME", line)
    line = re.sub(r"\b(?:\d+ (?:d|h|min|s) )+ago\b", "AGO", line)
    line = re.sub(r"pid[ =]\d+", "pid PID", line)
    line = re.sub(r"\b[0-9a-f]{64}\b", "HEX64", line)
    return " ".join(line.split())


def _matches(shown: list[str], got: list[str]) -> bool:
    """``got`` has the page's lines, ``...`` standing for any run of lines."""
    pattern = "\n".join(".*?" if line == "..." else re.escape(_normal(line)) for line in shown)
    return re.fullmatch(pattern, "\n".join(_normal(line) for line in got), re.S) is not None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("runbook")
    with runbook_ledgers(root) as runbook:
        yield runbook.root


def _run(command: str, root: Path, incident: str) -> tuple[int, list[str]]:
    code, got = run_command(command, root, incident)
    host = socket.gethostname()
    if host != PAGE_HOST:
        got = [re.sub(rf"\b{re.escape(host)}\b", PAGE_HOST, line) for line in got]
    return code, got


def test_the_runbook_has_console_blocks_of_the_incidents():
    commands = [command for block in _blocks() for command, _ in block]
    assert len(commands) >= 15
    # Commands as an operator types them; the first gives fleet the incident's template as
    # an operator gives it the daemons' (no PATH: the daemons' ledgers on this host).
    template = "SGLANG_EXPERT_LAYOUT_LEDGER_TEMPLATE='/tmp/layout-ledger-runbook/"
    assert all(
        command == "echo $?" or command.startswith(("layout-ledger ", "cp ", template))
        for command in commands
    )


def test_the_runbook_shows_no_error_line():
    # An example that fails where the page means it to work (a rewrite of the page from a
    # wrong setup) must not pass as the documented output.
    errors = [
        line for block in _blocks() for _, shown in block for line in shown if ": error: " in line
    ]
    assert errors == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(_blocks())))
def test_each_runbook_command_prints_what_the_page_shows(built, index):
    block = _blocks()[index]
    code = 0
    for command, shown in block:
        if command == "echo $?":
            assert shown == [str(code)], f"exit code after the command before: {code}"
            continue
        code, got = _run(command, built, block_incident(block))
        assert _matches(shown, got), f"$ {command}\n" + "\n".join(got)
