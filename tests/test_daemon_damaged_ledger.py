"""A ledger with rows the code cannot interpret: the daemon neither dies with a traceback nor
trusts them, and ``verify`` names the table, row and column.

The rows are damaged with plain ``sqlite3`` after a real daemon wrote them and was killed.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from cli_ledgers import run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.wire import protocol as msg
from sglang_integration.testing.daemon_control import EngineStandIn, request, start_daemon

pytestmark = pytest.mark.timeout(120)


def _killed_mid_move(tmp_path: Path) -> Path:
    """A daemon killed while an engine's move of layers [1, 2] was pending."""
    daemon = start_daemon(tmp_path)
    engine = EngineStandIn.start(daemon.socket_path, "engine-a")
    assert engine.begin(0, [1, 2]).ok
    daemon.kill()
    engine.kill()
    assert daemon.ledger_path is not None
    return Path(daemon.ledger_path)


def _damage(path: Path, statement: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(statement)


def _restart_and_query(tmp_path: Path, path: Path) -> tuple[dict, str]:
    daemon = start_daemon(tmp_path, ledger_path=path)
    try:
        layout = request(daemon.socket_path, {"type": msg.QUERY})
    finally:
        daemon.stop()
    return layout, daemon.log()


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (
            "UPDATE events SET layers = '[1, 2' WHERE kind = 'begin'",
            "events row 3, column layers: not a JSON list of ints",
        ),
        (
            "UPDATE incarnations SET num_layers = 0",
            "incarnations row 1, column num_layers: num_layers must be an int in [1, 4096], got 0",
        ),
    ],
    ids=["begin layers not JSON", "num_layers 0"],
)
def test_a_daemon_ends_an_incarnation_it_cannot_interpret_as_unknown_and_starts(
    tmp_path, capsys, damage, named
):
    path = _killed_mid_move(tmp_path / "first")
    _damage(path, damage)
    reply, log = _restart_and_query(tmp_path / "second", path)
    assert reply["status"] == msg.OK and reply["layout"]["version"] == 0
    assert "Traceback" not in log
    assert f"incarnation 1 ended unknown, its rows cannot be interpreted ({named})" in log
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        end_state, reason = conn.execute(
            "SELECT i.end_state, e.reason FROM incarnations i JOIN events e "
            "ON e.incarnation_id = i.incarnation_id AND e.kind = 'end' WHERE i.incarnation_id = 1"
        ).fetchone()
    assert end_state == "unknown"
    assert reason.endswith(f"its rows cannot be interpreted: {named}")
    code, out, err = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT, out + err
    assert named in err
