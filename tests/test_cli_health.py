"""Exit codes a health check can trust (issue 23, item 1).

``status`` exits 6 when the latest incarnation's daemon does not run (a SIGKILLed daemon's
clean ledger included); refusals make ``state: refusals`` (exit 4) only while the newest one is
within ``REFUSALS_WINDOW``; liveness is the kernel's writer lock, probed whatever host name the
daemon recorded (another container on this host), unknown only where this host cannot see the
lock (a free lock on a network filesystem); ``fleet`` fails (exit 6) when no daemon runs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_ledgers import query, run_cli
from ledger_support import SMALL, open_ledger

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.metrics import collect_metrics, exposition
from layout_ledger.core import record as record_module
from layout_ledger.core.layout import trivial_map
from layout_ledger.history.liveness import daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.rows import incarnation
from sglang_integration.testing.daemon_control import start_daemon

pytestmark = pytest.mark.timeout(180)

REFUSALS_WINDOW = datetime.timedelta(minutes=10)  # status.REFUSALS_WINDOW, documented
INITIAL = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)


def _open(path: Path, host: str | None = None) -> Ledger:
    """A running daemon's ledger (this process holds its writer lock), recorded on ``host``."""
    ledger = open_ledger(path)
    origin = IncarnationOrigin.of_this_process(**({} if host is None else {"host": host}))
    ledger.start_incarnation(SMALL, INITIAL, config_fingerprint="fp", origin=origin)
    return ledger


def _started_and_killed(path: Path, host: str) -> Path:
    """A daemon recorded on ``host`` that died without a clean end (a child, SIGKILL-like)."""

    def die() -> None:
        _open(path, host=host)
        os._exit(0)

    child = multiprocessing.get_context("fork").Process(target=die)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    return path


@contextlib.contextmanager
def _clock_at(moment: datetime.datetime) -> Iterator[None]:
    """The record's timestamps at ``moment`` (a refusal recorded in the past)."""
    saved = record_module.utc_now
    record_module.utc_now = lambda: moment.isoformat(timespec="microseconds")  # type: ignore[assignment]
    try:
        yield
    finally:
        record_module.utc_now = saved  # type: ignore[assignment]


def _status(capsys, path: object, *options: str) -> tuple[int, dict]:
    """One ledger's status --json: the one report of its list of one."""
    code, out, _ = run_cli(capsys, "status", str(path), *options, "--json")
    (report,) = json.loads(out)["ledgers"]
    return code, report


def test_status_of_a_sigkilled_daemons_clean_ledger_exits_6_not_running(tmp_path, capsys):
    daemon = start_daemon(tmp_path)
    try:
        assert _status(capsys, daemon.ledger_path)[0] == exit_codes.OK
        daemon.kill()  # SIGKILL: no clean end, its layout clean
        code, out, _ = run_cli(capsys, "status", str(daemon.ledger_path))
        assert code == exit_codes.NOT_RUNNING == 6
        assert ", not running, no clean end recorded)\n" in out
        assert out.endswith("state:               not_running\n")
        assert _status(capsys, daemon.ledger_path)[1]["state"] == "not_running"
    finally:
        daemon.kill()


def test_a_cleanly_stopped_daemon_is_not_running_too_but_an_older_incarnation_is_history(
    tmp_path, capsys
):
    path = tmp_path / "l.sqlite"
    for _ in range(2):
        _open(path).close()  # two daemon runs, each stopped cleanly
    code, report = _status(capsys, path)
    assert (code, report["state"], report["end_state"]) == (
        exit_codes.NOT_RUNNING,
        "not_running",
        "clean",
    )
    code, report = _status(capsys, path, "--incarnation", "1")
    assert (code, report["state"]) == (exit_codes.OK, "clean")


def test_a_refusal_makes_state_refusals_only_while_it_is_recent(tmp_path, capsys):
    path = tmp_path / "l.sqlite"
    ledger = _open(path)
    try:
        record = ledger.record
        assert record is not None
        record.attach("engine-a")
        past = datetime.datetime.now(datetime.timezone.utc) - REFUSALS_WINDOW * 1.2
        with _clock_at(past):
            record.record_refusal("attach", "engine-a", "engine 'engine-a' is already attached")
        code, report = _status(capsys, path)
        assert (code, report["state"]) == (exit_codes.OK, "clean")
        assert (report["refusals"], report["recent_refusals"]) == (1, 0)
        assert report["refusals_window_seconds"] == 600
        _, out, _ = run_cli(capsys, "status", str(path))
        assert "refusals:            1 (none in the last 10 minutes)\n" in out
        record.record_refusal("begin", "engine-a", "base_version 3 is not the current version 0")
        code, report = _status(capsys, path)
        assert (code, report["state"]) == (exit_codes.PENDING_OR_REFUSALS, "refusals")
        assert (report["refusals"], report["recent_refusals"]) == (2, 1)
    finally:
        ledger.close()


def test_identical_refusals_still_coming_are_recent_though_their_row_began_long_ago(
    tmp_path, capsys
):
    # A flood of one refusal is one row (count, first time ``at``, last time ``last_at``): its
    # newest refusal, not its first, says whether the daemon refuses now.
    path = tmp_path / "l.sqlite"
    ledger = _open(path)
    try:
        record = ledger.record
        assert record is not None
        past = datetime.datetime.now(datetime.timezone.utc) - REFUSALS_WINDOW * 1.2
        with _clock_at(past):
            record.attach("engine-a")
            record.record_refusal("attach", "engine-a", "engine 'engine-a' is already attached")
        record.record_refusal("attach", "engine-a", "engine 'engine-a' is already attached")
        rows = query(path, "SELECT count, at < last_at FROM events WHERE kind = 'attach_refused'")
        assert rows == [(2, 1)]  # one row, begun long ago, refused again now
        code, report = _status(capsys, path)
        assert (code, report["state"]) == (exit_codes.PENDING_OR_REFUSALS, "refusals")
        assert (report["refusals"], report["recent_refusals"]) == (2, 2)
        _, out, _ = run_cli(capsys, "status", str(path))
        assert "refusals:            2 (2 in the last 10 minutes)\n" in out
    finally:
        ledger.close()


def test_a_busy_begin_is_no_refusal_and_status_counts_it_apart(tmp_path, capsys):
    path = tmp_path / "l.sqlite"
    ledger = _open(path)
    try:
        record = ledger.record
        assert record is not None
        record.attach("engine-a")
        record.record_refusal("begin", "engine-a", "engine-b is attached", busy=True)
        code, report = _status(capsys, path)
        assert (code, report["state"], report["refusals"], report["busy_begins"]) == (
            exit_codes.OK,
            "clean",
            0,
            1,
        )
        _, out, _ = run_cli(capsys, "status", str(path))
        assert (
            "refusals:            0\nbusy begins:         1 (answered busy, not refused)\n" in out
        )
    finally:
        ledger.close()


def test_liveness_is_the_writer_lock_whatever_host_the_daemon_recorded(tmp_path, capsys):
    """A daemon in another container on this host records its own host name; the lock is the
    kernel's all the same."""
    running = tmp_path / "running.sqlite"
    stopped = _started_and_killed(tmp_path / "stopped.sqlite", "pod-b")
    ledger = _open(running, host="pod-a")
    try:
        code, report = _status(capsys, running)
        assert (code, report["alive"], report["host"]) == (exit_codes.OK, True, "pod-a")
        _, out, _ = run_cli(capsys, "status", str(running))
        assert ", running)\n" in out
        assert _status(capsys, stopped)[1]["alive"] is False
        samples = exposition(collect_metrics([running, stopped])).decode()
        values = {
            line.split("{")[0] + line.split('ledger="')[1].split('"')[0]: line.rsplit(" ", 1)[1]
            for line in samples.splitlines()
            if line.startswith("sglang_expert_layout_daemon_up{")
        }
        assert values[f"sglang_expert_layout_daemon_up{running}"] == "1.0"
        assert values[f"sglang_expert_layout_daemon_up{stopped}"] == "0.0"
    finally:
        ledger.close()


def test_a_free_lock_on_a_network_filesystem_is_unknown_unless_the_daemon_ran_here(tmp_path):
    path = tmp_path / "l.sqlite"
    _open(path, host="node-b").close()
    with LedgerReader(path) as reader, reader.connect() as conn:
        inc = incarnation(conn)
    mountinfo = (
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        f"98 22 0:52 / {tmp_path} rw,relatime shared:7 - nfs4 server:/export rw,vers=4.2\n"
    )
    # An ended incarnation is not running wherever it ran.
    assert daemon_liveness(path, inc, latest=True, mountinfo=mountinfo).alive is False
    unended = type(inc)(**{**inc.__dict__, "ended_at": None, "end_state": None})
    liveness = daemon_liveness(path, unended, latest=True, this_host="node-a", mountinfo=mountinfo)
    assert liveness.alive is None
    assert liveness.detail == (
        "unknown: the file is on a network filesystem (nfs4) and its daemon ran on host node-b, "
        "whose lock this host may not see"
    )
    here = daemon_liveness(path, unended, latest=True, this_host="node-b", mountinfo=mountinfo)
    assert here.alive is False
    local = mountinfo.replace("nfs4", "ext4")
    assert (
        daemon_liveness(path, unended, latest=True, this_host="x", mountinfo=local).alive is False
    )


def test_a_symlinked_ledgers_daemon_is_probed_through_the_link(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    path = tmp_path / "real" / "l.sqlite"
    ledger = _open(path)
    try:
        link = tmp_path / "links" / "l.sqlite"
        os.symlink(path, link)
        code, report = _status(capsys, link)
        assert (code, report["alive"]) == (exit_codes.OK, True)
        code, out, err = run_cli(capsys, "fleet", str(tmp_path / "links"), "--json")
        assert (code, err) == (exit_codes.OK, ""), err
        assert [row["alive"] for row in json.loads(out)["ledgers"]] == [True]
    finally:
        ledger.close()


def test_fleet_fails_with_exit_6_when_no_daemon_runs(tmp_path, capsys):
    paths = [tmp_path / f"rank-{rank}.sqlite" for rank in range(3)]
    for path in paths:
        _open(path).close()
    code, out, _ = run_cli(capsys, "fleet", *map(str, paths), "--json")
    assert code == exit_codes.NOT_RUNNING
    verdict = json.loads(out)["verdict"]
    assert verdict["outcome"] == "fail"
    assert verdict["reason"] == (
        "no daemon of these ledgers runs (ranks 0-2 not running): start the daemons, then check "
        "again"
    )
    assert verdict["engine_reason"] is None
    ledger = _open(paths[0])  # one daemon back: an engine keeps its initial layout, as before
    try:
        code, out, _ = run_cli(capsys, "fleet", *map(str, paths), "--json")
        assert (code, json.loads(out)["verdict"]["outcome"]) == (exit_codes.OK, "keep_initial")
    finally:
        ledger.close()


def test_daemon_up_is_never_nan_for_a_ledger_on_local_disk(tmp_path):
    path = _started_and_killed(tmp_path / "l.sqlite", "somewhere-else")
    text = exposition(collect_metrics([path])).decode()
    (line,) = [
        line for line in text.splitlines() if line.startswith("sglang_expert_layout_daemon_up{")
    ]
    assert not math.isnan(float(line.rsplit(" ", 1)[1]))
