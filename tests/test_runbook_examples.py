"""Every command of docs/operations.md, run against the incidents' ledgers, prints what the page
shows and exits as it shows; and so does every command of the README's first look, on the
``healthy`` incident's two ledgers read as the default location of a root daemon.

scripts/runbook_ledgers.py builds the ledgers (a process per daemon, the running ones alive for
the whole module); each console block's commands run as a shell runs them (the console script,
``cp`` in the incident's directory), and the output is compared line by line after
normalising what differs from run to run: times and "ago", pids, 64-digit digests and chain
heads, the host name, the directory, runs of spaces (column widths follow the paths). A page
line ``...`` stands for any lines.
"""

from __future__ import annotations

import re
import shlex
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_ledgers import run_cli

from layout_ledger.store import locations
from runbook_ledgers import (
    HEALTHY_STATE_HOME,
    block_incident,
    console_blocks,
    run_command,
    runbook_ledgers,
)

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "operations.md"
README = ROOT / "README.md"
PAGE_HOST = "vm"
PAGE_STATE_HOME = locations.SYSTEM_STATE_HOME  # /var/lib: a root daemon's, as the README shows


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


# --- the README's first look ----------------------------------------------------------------


def _readme_blocks() -> list[list[tuple[str, list[str]]]]:
    return console_blocks(README.read_text())


def test_the_readme_shows_a_first_fleet_and_status_with_their_output():
    commands = [command for block in _readme_blocks() for command, _ in block]
    assert "layout-ledger fleet" in commands
    assert any(command.startswith("layout-ledger status") for command in commands)


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_each_readme_command_prints_what_the_readme_shows(built, index, monkeypatch, capsys):
    """In this process, as root reads the default location (/var/lib, here the healthy
    incident's state home: the same two ledgers, their daemons running)."""
    state_home = str(built / HEALTHY_STATE_HOME)
    monkeypatch.setattr(locations, "SYSTEM_STATE_HOME", state_home)
    monkeypatch.setattr(locations, "effective_uid", lambda: 0)
    monkeypatch.delenv(locations.TEMPLATE_ENV, raising=False)
    code = 0
    for command, shown in _readme_blocks()[index]:
        if command == "echo $?":
            assert shown == [str(code)], f"exit code after the command before: {code}"
            continue
        argv = shlex.split(command.replace(PAGE_STATE_HOME, state_home))
        assert argv[0] == "layout-ledger", command
        code, out, err = run_cli(capsys, *argv[1:])
        printed = (err + out).replace(state_home, PAGE_STATE_HOME)
        got = printed.rstrip("\n").split("\n")
        host = socket.gethostname()
        if host != PAGE_HOST:
            got = [re.sub(rf"\b{re.escape(host)}\b", PAGE_HOST, line) for line in got]
        assert _matches(shown, got), f"$ {command}\n" + "\n".join(got)
