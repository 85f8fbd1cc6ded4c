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

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runbook_ledgers import DEFAULT_DIR, runbook_ledgers

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "operations.md"
BIN = Path(sys.executable).parent
PAGE_HOST = "vm"


def console_blocks() -> list[list[tuple[str, list[str]]]]:
    """Each ```console block of the runbook: its (command, shown output lines)."""
    blocks = []
    for body in re.findall(r"^```console\n(.*?)^```$", RUNBOOK.read_text(), re.S | re.M):
        entries: list[tuple[str, list[str]]] = []
        for line in body.rstrip("\n").split("\n"):
            if line.startswith("$ "):
                entries.append((line[2:], []))
            else:
                entries[-1][1].append(line)
        blocks.append(entries)
    return blocks


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
        (root / "cp-backups").mkdir()
        yield runbook.root


def _run(command: str, root: Path, directory: Path) -> tuple[int, list[str]]:
    here = command.replace(str(DEFAULT_DIR), str(root)).replace(
        " /backups/", f" {root}/cp-backups/"
    )
    environment = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        here,
        shell=True,
        capture_output=True,
        text=True,
        cwd=directory,
        env=environment,
        timeout=120,
        check=False,
    )
    text = (done.stdout + done.stderr).replace(str(root), str(DEFAULT_DIR))
    host = socket.gethostname()
    if host != PAGE_HOST:
        text = re.sub(rf"\b{re.escape(host)}\b", PAGE_HOST, text)
    return done.returncode, text.rstrip("\n").split("\n") if text else []


def test_the_runbook_has_console_blocks_of_the_incidents():
    commands = [command for block in console_blocks() for command, _ in block]
    assert len(commands) >= 15
    assert all(
        command == "echo $?" or command.startswith(("layout-ledger ", "cp "))
        for command in commands
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(console_blocks())))
def test_each_runbook_command_prints_what_the_page_shows(built, index):
    block = console_blocks()[index]
    incident = next(
        (
            match.group(1)
            for command, _ in block
            if (match := re.search(rf"{re.escape(str(DEFAULT_DIR))}/([a-z]+)/", command))
        ),
        "backup",
    )
    code = 0
    for command, shown in block:
        if command == "echo $?":
            assert shown == [str(code)], f"exit code after the command before: {code}"
            continue
        code, got = _run(command, built, built / incident)
        assert _matches(shown, got), f"$ {command}\n" + "\n".join(got)
