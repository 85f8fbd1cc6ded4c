"""The progress line: on a terminal's stderr once the work takes a while, never on a pipe.

The terminal is a real pseudo-terminal (``os.openpty``); the long command a real
``layout-ledger fleet --verify`` process over many ledgers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_ledgers import build

from layout_ledger.cli.progress import DELAY_ENV, Progress

CONSOLE_SCRIPT = Path(sys.executable).with_name("layout-ledger")
ERASE = b"\r\x1b[K"


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    got = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            return got
        if not chunk:
            return got
        got += chunk


def test_work_that_runs_past_the_delay_shows_its_phase_on_a_terminal_then_erases_it():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w", closefd=True) as terminal:
        with Progress("verify", terminal, delay=0.1, redraw=0.05) as progress:
            progress.phase("digests, incarnation 2 (2 of 2)")
            time.sleep(0.5)
        shown = _drain(leader)
    os.close(leader)
    assert b"layout-ledger verify: digests, incarnation 2 (2 of 2), 0 s" in shown
    assert shown.endswith(ERASE)


def test_work_that_ends_before_the_delay_shows_nothing_on_a_terminal():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w", closefd=True) as terminal:
        with Progress("verify", terminal, delay=1.0) as progress:
            progress.phase("integrity_check")
            time.sleep(0.05)
        shown = _drain(leader)
    os.close(leader)
    assert shown == b""


def test_no_progress_line_goes_to_a_pipe():
    reader, writer = os.pipe()
    with (
        os.fdopen(writer, "w") as pipe,
        Progress("verify", pipe, delay=0.0, redraw=0.05) as progress,
    ):
        progress.phase("digests")
        time.sleep(0.3)
    with os.fdopen(reader, "rb") as got:
        assert got.read() == b""


@pytest.fixture(scope="module")
def many_ledgers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("many")
    first = build("clean", directory / "rank-000.sqlite")
    wal = Path(f"{first}-wal")
    for rank in range(1, 120):
        copy = directory / f"rank-{rank:03d}.sqlite"
        shutil.copyfile(first, copy)
        if wal.exists():  # its killed writer left the history in the WAL
            shutil.copyfile(wal, f"{copy}-wal")
    return directory


@pytest.mark.timeout(240)
def test_fleet_verify_shows_a_progress_line_on_a_terminal_and_none_when_piped(many_ledgers):
    leader, follower = os.openpty()
    try:
        # At once: how long the work takes on this machine does not decide what the test sees.
        done = subprocess.run(
            [str(CONSOLE_SCRIPT), "fleet", "--verify", str(many_ledgers)],
            stdout=subprocess.PIPE,
            stderr=follower,
            env={**os.environ, DELAY_ENV: "0"},
            check=False,
            timeout=200,
        )
        shown = _drain(leader)
    finally:
        os.close(follower)
        os.close(leader)
    assert done.returncode == 0
    assert b"layout-ledger fleet --verify: ledger " in shown
    assert b" of 120: " in shown
    assert shown.endswith(ERASE), "the progress line is erased before the result"
    assert b"\x1b" not in done.stdout
    piped = subprocess.run(
        [str(CONSOLE_SCRIPT), "fleet", "--verify", str(many_ledgers)],
        capture_output=True,
        env={**os.environ, DELAY_ENV: "0"},
        check=False,
        timeout=200,
    )
    assert (piped.returncode, piped.stderr) == (0, b"")
    assert piped.stdout == done.stdout
