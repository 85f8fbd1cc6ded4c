"""The runbook's forensic cookbook (docs/operations.md): each query, run as printed, answers its
question correctly."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from ledger_support import SMALL, open_ledger, start

from layout_ledger.core.layout import trivial_map

README = Path(__file__).resolve().parent.parent / "docs" / "operations.md"  # the cookbook


def readme_queries() -> dict[str, str]:
    blocks = re.findall(r"```sql\n(.*?)```", README.read_text(), flags=re.S)
    queries = {}
    for block in blocks:
        first, _, rest = block.partition("\n")
        match = re.fullmatch(r"-- forensic: (\S+)", first.strip())
        if match:
            queries[match.group(1)] = rest
    return queries


@pytest.fixture(scope="module")
def ledger_path(tmp_path_factory):
    """Incarnation 1: A moves layer 3 twice, B attaches, A leaves mid-move (dirty).
    Incarnation 2 (after a restart): C attaches and moves layer 3 once."""
    path = tmp_path_factory.mktemp("forensics") / "ledger.sqlite"
    ledger = open_ledger(path)
    record = start(ledger)
    record.attach("engine-A")
    row_v1 = [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4]
    row_v2 = [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 7, 7]
    record.begin("engine-A", 0, [3, 4])
    record.commit("engine-A", {3: row_v1, 4: row_v1})
    record.begin("engine-A", 1, [3])
    record.commit("engine-A", {3: row_v2})
    record.attach("engine-B")
    record.detach("engine-B")
    record.begin("engine-A", 2, [6, 3])
    record.detach("engine-A")
    ledger.end_incarnation()
    record = start(ledger)
    record.attach("engine-C")
    record.begin("engine-C", 0, [3])
    record.commit("engine-C", {3: row_v1})
    ledger.close()
    return path


def run(path: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(sql).fetchall()


def test_the_readme_has_one_query_per_forensic_question():
    assert set(readme_queries()) == {
        "dirty",
        "slot-at-version",
        "layer-history",
        "attachments",
        "why-refused",
    }


def test_which_engine_left_the_daemon_dirty_with_which_layers_and_base_version(ledger_path):
    (row,) = run(ledger_path, readme_queries()["dirty"])
    incarnation_id, _at, engine_id, layers, base_version, reason = row
    assert (incarnation_id, engine_id, json.loads(layers), base_version) == (
        1,
        "engine-A",
        [3, 6],
        2,
    )
    assert "restart the daemon" in reason


def test_what_slot_5_of_layer_3_held_at_version_2(ledger_path):
    assert run(ledger_path, readme_queries()["slot-at-version"]) == [(2, 3)]
    at_version_1 = readme_queries()["slot-at-version"].replace("version <= 2", "version <= 1")
    assert run(ledger_path, at_version_1) == [(1, 2)]


def test_the_move_history_of_layer_3(ledger_path):
    rows = run(ledger_path, readme_queries()["layer-history"])
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)[3]
    assert [(r[0], r[1], r[2], r[4], json.loads(r[5])) for r in rows] == [
        (1, 0, 0, None, initial),
        (1, 1, 1, "engine-A", [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4]),
        (1, 2, None, "engine-A", [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 7, 7]),
        (2, 0, 0, None, initial),
        (2, 1, None, "engine-C", [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4]),
    ]


def test_which_engines_were_attached_when(ledger_path):
    rows = run(ledger_path, readme_queries()["attachments"])
    assert [(r[0], r[1], r[3] is not None, r[4]) for r in rows] == [
        (1, "engine-A", True, "attach connection closed (EOF)"),
        (1, "engine-B", True, "attach connection closed (EOF)"),
        (2, "engine-C", True, None),
    ]
    # engine-C's attachment ended with its daemon's clean shutdown (ledger.close()).
    ended = run(ledger_path, "SELECT ended_at FROM ledger_incarnations WHERE incarnation_id = 2")
    assert rows[2][3] == ended[0][0]


def test_why_a_new_engine_refuses_to_start_names_the_latest_state(ledger_path):
    (row,) = run(ledger_path, readme_queries()["why-refused"])
    assert row == (2, 1, 0, None, None, None, 0)
    first = readme_queries()["why-refused"].replace("DESC", "ASC")
    (row,) = run(ledger_path, first)
    assert row[:3] == (1, 2, 1) and "engine 'engine-A' detached" in row[3]


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="the sqlite3 shell is not installed")
def test_the_queries_run_in_the_sqlite3_shell_as_printed(ledger_path):
    for name, sql in readme_queries().items():
        result = subprocess.run(
            ["sqlite3", f"file:{ledger_path}?mode=ro", sql],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0 and result.stderr == "", (name, result.stderr)
        assert result.stdout.strip(), name
