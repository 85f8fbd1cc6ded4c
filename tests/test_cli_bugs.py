"""The bugs issue 23 found (item 7), each reproduced: these failed before their fixes.

(The ``--label`` ones, the double report of an unreadable ledger and the ``.prom`` warning are
tests/test_metrics_exporter.py's; the symlinked ledgers, tests/test_cli_health.py's.)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from cli_ledgers import build, run_cli
from ledger_support import open_ledger

from layout_ledger.cli import exit_codes
from layout_ledger.core.layout import Geometry, trivial_map
from sglang_integration.testing.daemon_control import start_daemon

pytestmark = pytest.mark.timeout(240)

CONSOLE_SCRIPT = Path(sys.executable).with_name("layout-ledger")
WIDE = Geometry(num_layers=64, num_physical_slots=256, num_logical_experts=256)


def test_backup_into_a_missing_directory_named_with_a_slash_writes_no_file(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    (tmp_path / "missing").mkdir()
    code, out, err = run_cli(capsys, "backup", str(path), f"{tmp_path}/missing/dir/")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger backup: error: cannot write into {tmp_path}/missing/dir/: no such "
        "directory (a DEST ending in / names a directory to write the copy into); create it, or "
        "name the copy without the /\n"
    )
    assert os.listdir(tmp_path / "missing") == []


@pytest.fixture(scope="module")
def long_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger whose history and diff print far more than a pipe holds (64 KiB)."""
    path = tmp_path_factory.mktemp("long") / "l.sqlite"
    ledger = open_ledger(path)
    initial = trivial_map(WIDE.num_layers, WIDE.num_physical_slots, WIDE.num_logical_experts)
    record = ledger.start_incarnation(WIDE, initial, config_fingerprint="fp")
    record.attach("engine-a")
    rng = random.Random(0)
    layers = list(range(WIDE.num_layers))
    for _ in range(400):
        record.begin("engine-a", record.version, layers[:2])
        rows = {layer: [rng.randrange(256) for _ in range(256)] for layer in layers[:2]}
        record.commit("engine-a", rows)
    record.begin("engine-a", record.version, layers)
    record.commit("engine-a", {layer: [rng.randrange(256) for _ in range(256)] for layer in layers})
    ledger.close()
    return path


@pytest.mark.parametrize("form", ["text", "--json", "--nl", "--csv"])
@pytest.mark.parametrize("verb", ["history", "diff"])
def test_a_reader_that_goes_away_ends_every_output_form_quietly_with_exit_0(
    long_ledger, verb, form
):
    argv = [str(CONSOLE_SCRIPT), verb, str(long_ledger)]
    argv += ["0", "401", "--slots"] if verb == "diff" else []
    argv += [] if form == "text" else [form]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline()  # `| head -1`: one line, then the reader is gone
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(60) == exit_codes.OK
    assert stderr == b""


def test_an_unrecognized_option_names_the_command(capsys):
    code, _, err = run_cli(capsys, "status", "L", "--bogus")
    assert code == exit_codes.UNUSABLE
    assert err == (
        "layout-ledger status: error: unrecognized arguments: --bogus (see layout-ledger status "
        "--help)\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["history"],
        ["show"],
        ["verify"],
        ["fleet"],
        ["metrics"],
        ["export", "-o", "{tmp}/out/x.json"],
        ["backup", "{tmp}/out/"],
    ],
)
def test_read_commands_leave_a_stopped_daemons_directory_as_it_was(tmp_path, capsys, argv):
    (tmp_path / "out").mkdir()
    directory = tmp_path / "evidence"
    daemon = start_daemon(directory)
    assert daemon.stop() == 0  # stopped cleanly: SQLite removed its -wal and -shm
    before = sorted(os.listdir(directory))
    assert not [name for name in before if name.endswith(("-wal", "-shm"))]
    command = [argv[0], str(daemon.ledger_path), *(a.format(tmp=tmp_path) for a in argv[1:])]
    code, _, err = run_cli(capsys, *command)
    assert code in (exit_codes.OK, exit_codes.NOT_RUNNING), err
    assert sorted(os.listdir(directory)) == before


def test_prune_gives_the_space_back_and_dry_run_removes_nothing(tmp_path, capsys):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    initial = trivial_map(WIDE.num_layers, WIDE.num_physical_slots, WIDE.num_logical_experts)
    record = ledger.start_incarnation(WIDE, initial, config_fingerprint="fp")
    record.attach("engine-a")
    rng = random.Random(1)
    for _ in range(30):
        record.begin("engine-a", record.version, list(range(WIDE.num_layers)))
        record.commit(
            "engine-a",
            {layer: [rng.randrange(256) for _ in range(256)] for layer in range(WIDE.num_layers)},
        )
    # While the daemon runs, a dry run reads what a prune would remove.
    code, out, err = run_cli(capsys, "prune", str(path), "--keep", "2", "--dry-run", "--json")
    assert (code, err) == (exit_codes.OK, ""), err
    dry = json.loads(out)
    assert (dry["dry_run"], dry["rows_removed"], dry["vacuumed"]) == (True, 29 * 64, False)
    ledger.close()
    size = path.stat().st_size
    _, out, _ = run_cli(capsys, "prune", str(path), "--keep", "2", "--dry-run")
    assert out.splitlines()[-1] == "dry run: nothing was removed"
    assert "would remove 1856 layout rows older than version 29" in out
    assert path.stat().st_size == size
    code, out, _ = run_cli(capsys, "prune", str(path), "--keep", "2", "--json")
    pruned = json.loads(out)
    assert (code, pruned["rows_removed"], pruned["vacuumed"]) == (exit_codes.OK, 1856, True)
    assert path.stat().st_size < size / 5  # 29 of 31 versions' rows gone, and their pages
    assert run_cli(capsys, "verify", str(path))[0] == exit_codes.OK
