"""Who wrote a ledger, and whether that daemon still runs (revision 0004, ``status``).

Each incarnation records where its daemon ran (host, device, ranks, pid, socket, versions); an
older ledger upgrades with these empty. ``status`` says "running" only while the daemon that
owns the file holds its writer lock, "not running, no clean end recorded" after a SIGKILL, and
"unknown" where this machine cannot tell (another host, read-only media). Real model-less
daemons, killed with SIGKILL.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import sqlite3
from pathlib import Path

import pytest
from alembic import command
from cli_ledgers import run_cli
from ledger_support import SMALL, open_ledger, start
from sqlalchemy import create_engine
from test_ledger_files import _evidence_copy, _in_mount_namespace, needs_mounts

from layout_ledger.cli import exit_codes
from layout_ledger.core.layout import trivial_map
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.connections import WriterLock
from layout_ledger.store.migrate import alembic_config
from layout_ledger.store.origin import COLUMNS, IncarnationOrigin, installed_version
from layout_ledger.store.rows import incarnations
from sglang_integration.testing.daemon_control import start_daemon

pytestmark = pytest.mark.timeout(180)

ORIGIN = IncarnationOrigin(
    host=socket.gethostname(),
    device_uuid="GPU-5c1d1b7e-0000-4000-8000-00000000000a",
    gpu_id=3,
    tp_rank=11,
    pp_rank=0,
    ep_rank=11,
    pid=4242,
    socket_path="/tmp/sglang_weight_cache_GPU-5c1d.sock",
    sglang_version="0.5.23",
    plugin_version="0.1.0",
)


def _start_with(path: Path, origin: IncarnationOrigin | None) -> None:
    ledger = open_ledger(path)
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    ledger.start_incarnation(
        SMALL, initial, config_fingerprint="fp-1", daemon_label="d", origin=origin
    )
    ledger.close()


def _incarnations(path: Path) -> list[IncarnationOrigin]:
    with LedgerReader(path) as reader, reader.connect() as conn:
        return [inc.origin for inc in incarnations(conn)]


def test_an_incarnation_records_where_its_daemon_ran_and_the_view_shows_it(tmp_path):
    path = tmp_path / "l.sqlite"
    _start_with(path, ORIGIN)
    assert _incarnations(path) == [ORIGIN]
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM ledger_incarnations").fetchone()
    assert {name: row[name] for name in COLUMNS} == ORIGIN.to_json()
    assert row["config_fingerprint"] == "fp-1"


def test_an_older_ledger_upgrades_with_an_empty_origin_and_its_next_incarnation_records_one(
    tmp_path,
):
    path = tmp_path / "l.sqlite"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0003_event_counts_and_chain")
    engine.dispose()
    ledger = open_ledger(path)  # upgrades to head as the daemon does
    start(ledger)  # no origin given: nothing recorded
    ledger.close()
    _start_with(path, ORIGIN)
    assert _incarnations(path) == [IncarnationOrigin(), ORIGIN]


def test_status_shows_the_origin_and_its_json_carries_each_field(tmp_path, capsys):
    path = tmp_path / "l.sqlite"
    _start_with(path, ORIGIN)
    code, out, _ = run_cli(capsys, "status", str(path))
    assert code == exit_codes.NOT_RUNNING  # its daemon stopped (cleanly)
    assert (
        "daemon:              pid 4242 on host "
        f"{ORIGIN.host}, socket /tmp/sglang_weight_cache_GPU-5c1d.sock\n"
        "device:              GPU 3, GPU-5c1d1b7e-0000-4000-8000-00000000000a, TP rank 11, "
        "PP rank 0, EP rank 11\n"
        "software:            sglang 0.5.23, plugin 0.1.0\n"
        "config fingerprint:  fp-1\n"
    ) in out
    _, out, _ = run_cli(capsys, "status", str(path), "--json")
    (status,) = json.loads(out)["ledgers"]
    assert {key: status[key] for key in COLUMNS} == ORIGIN.to_json()
    assert status["config_fingerprint"] == "fp-1"
    assert status["alive"] is False  # ended cleanly by close()


def test_status_says_running_only_while_the_daemon_runs_and_not_running_after_sigkill(
    tmp_path, capsys
):
    daemon = start_daemon(
        tmp_path,
        extra=[
            "--device-uuid",
            "model-less-7",
            "--gpu-id",
            "7",
            "--tp-rank",
            "7",
            "--ep-rank",
            "7",
        ],
    )
    try:
        ledger = str(daemon.ledger_path)
        _, out, _ = run_cli(capsys, "status", ledger, "--json")
        (status,) = json.loads(out)["ledgers"]
        assert status["alive"] is True
        assert (status["host"], status["pid"], status["socket_path"]) == (
            socket.gethostname(),
            daemon.pid,
            daemon.socket_path,
        )
        assert (status["device_uuid"], status["gpu_id"], status["tp_rank"]) == (
            "model-less-7",
            7,
            7,
        )
        assert (status["pp_rank"], status["ep_rank"]) == (None, 7)
        assert status["sglang_version"] == installed_version("sglang") == "0.5.23"
        assert status["plugin_version"] is not None
        _, out, _ = run_cli(capsys, "status", ledger)
        # Issue 23 item 2: each time status shows says how long ago it was ("; 6 s ago").
        started = re.escape(status["started_at"])
        assert re.search(
            rf"incarnation:         1 of 1 \(started {started}; [^,]* ago, running\)\n", out
        )
        daemon.kill()  # SIGKILL: no clean end
        code, out, _ = run_cli(capsys, "status", ledger)
        assert code == exit_codes.NOT_RUNNING  # the layout itself is clean, its daemon gone
        assert re.search(
            rf"incarnation:         1 of 1 \(started {started}; [^,]* ago, not running, no clean "
            r"end recorded\)\n",
            out,
        )
        assert (
            json.loads(run_cli(capsys, "status", ledger, "--json")[1])["ledgers"][0]["alive"]
            is False
        )
    finally:
        daemon.kill()


def test_status_of_a_cleanly_stopped_daemon_says_how_it_ended(tmp_path, capsys):
    daemon = start_daemon(tmp_path)
    assert daemon.stop() == 0  # SIGTERM: a clean end
    _, out, _ = run_cli(capsys, "status", str(daemon.ledger_path), "--json")
    (status,) = json.loads(out)["ledgers"]
    assert (status["alive"], status["end_state"]) == (False, "clean")


def test_status_probes_the_lock_of_a_daemon_that_recorded_another_host_name(tmp_path, capsys):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    ledger.start_incarnation(SMALL, initial, origin=IncarnationOrigin(host="node-b"))
    try:  # the writer runs (here, holding the lock), but it says it runs on node-b: another
        # container on this kernel; the lock is the kernel's, so it is seen
        _, out, _ = run_cli(capsys, "status", str(path))
        assert ", running)\n" in out
        assert (
            json.loads(run_cli(capsys, "status", str(path), "--json")[1])["ledgers"][0]["alive"]
            is True
        )
    finally:
        ledger.close()


def _start_and_die(path: Path) -> None:
    ledger = open_ledger(path)
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    ledger.start_incarnation(SMALL, initial, origin=ORIGIN)
    os._exit(0)


def test_a_writer_lock_held_by_another_process_than_the_daemon_is_not_the_daemon_running(
    tmp_path, capsys
):
    path = tmp_path / "l.sqlite"
    child = multiprocessing.get_context("fork").Process(target=_start_and_die, args=(path,))
    child.start()  # a daemon that recorded pid 4242 and died: no end, its lock released
    child.join(60)
    assert child.exitcode == 0
    prune = WriterLock(path)  # what `layout-ledger prune` holds while it runs (this pid)
    try:
        _, out, _ = run_cli(capsys, "status", str(path))
        assert (
            f"not running, no clean end recorded; pid {os.getpid()}, not its daemon (pid 4242), "
            "holds the writer lock)\n"
        ) in out
        assert (
            json.loads(run_cli(capsys, "status", str(path), "--json")[1])["ledgers"][0]["alive"]
            is False
        )
    finally:
        prune.release()


@needs_mounts
def test_status_of_a_ledger_on_read_only_media_probes_its_lock_too(tmp_path):
    path = _evidence_copy(tmp_path, with_wal=True)
    folder = path.parent
    result = _in_mount_namespace(
        f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder}",
        f"""
        from layout_ledger.cli.app import main
        main(["status", {str(path)!r}, "--json"])
        """,
    )
    assert result.returncode == 0, result.stderr
    # A read-only mount of a file on this kernel shows its lock (free: no daemon writes it).
    assert json.loads(result.stdout)["ledgers"][0]["alive"] is False
