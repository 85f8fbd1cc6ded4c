"""history --follow, relative times, --reverse, the --after-event cursor, status's "ago".

The follower is a real ``layout-ledger`` process reading a ledger that another process commits
to through the daemon's ``Ledger`` (tests/cli_ledgers.py's committing writer), stopped with a
real SIGINT.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import multiprocessing
import os
import re
import selectors
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_ledgers import EPOCH, at, build, commit, committing_writer, query, rotated, run_cli, start

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands import status as status_command
from layout_ledger.cli.follow import POLL_SECONDS
from layout_ledger.cli.time_text import ago, parse_time
from layout_ledger.store.ledger import Ledger

CONSOLE_SCRIPT = Path(sys.executable).with_name("layout-ledger")
NOW = datetime.datetime(2026, 3, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("clean", tmp_path_factory.mktemp("follow") / "clean.sqlite")


# --- relative times ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelled", "back"),
    [
        ("1h", datetime.timedelta(hours=1)),
        ("30min", datetime.timedelta(minutes=30)),
        ("2d", datetime.timedelta(days=2)),
        ("1 hour ago", datetime.timedelta(hours=1)),
        ("1h 30min", datetime.timedelta(minutes=90)),
        ("-45s", datetime.timedelta(seconds=45)),
        ("2 weeks ago", datetime.timedelta(weeks=2)),
        ("now", datetime.timedelta(0)),
    ],
)
def test_a_relative_time_reaches_back_from_now(spelled, back):
    assert parse_time(spelled, NOW) == (NOW - back).isoformat(timespec="microseconds")


@pytest.mark.parametrize(
    ("spelled", "moment"),
    [
        ("today", datetime.datetime(2026, 3, 1, tzinfo=datetime.timezone.utc)),
        ("yesterday", datetime.datetime(2026, 2, 28, tzinfo=datetime.timezone.utc)),
        ("@1733400000", datetime.datetime(2024, 12, 5, 12, tzinfo=datetime.timezone.utc)),
        ("9:05", datetime.datetime(2026, 3, 1, 9, 5, tzinfo=datetime.timezone.utc)),
        ("+5min", NOW + datetime.timedelta(minutes=5)),
        ("2025-12-30", datetime.datetime(2025, 12, 30, tzinfo=datetime.timezone.utc)),
    ],
)
def test_journalctls_day_names_unix_times_clock_times_and_spans_ahead_are_taken_in_utc(
    spelled, moment
):
    assert parse_time(spelled, NOW) == moment.isoformat(timespec="microseconds")


def test_every_time_docs_cli_md_says_since_takes_is_taken(clean, capsys):
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    paragraph = text[text.index("**Times**") :].split("\n\n")[0]
    spelled = [
        example.strip('"')
        for example in re.findall(r"`([^`]+)`", paragraph)
        if not example.startswith("--") and example not in ("-", "s", "min", "m", "h", "d", "w")
    ]
    assert len(spelled) >= 15, spelled
    for moment in spelled:
        code, _, err = run_cli(capsys, "history", str(clean), f"--since={moment}", "--last", "1")
        assert (moment, code, err) == (moment, exit_codes.OK, "")


def test_an_iso_time_is_utc_without_a_zone_and_z_means_utc():
    assert parse_time("2026-01-01T00:00:05") == at(5)
    assert parse_time("2026-01-01T00:00:05Z") == at(5)
    assert parse_time("2026-01-01T01:00:05+01:00") == at(5)


def test_history_since_and_until_take_relative_times(clean, capsys):
    code, out, _ = run_cli(capsys, "history", str(clean), "--since", "1 hour ago")
    assert (code, out) == (exit_codes.OK, "no events match\n")
    code, out, _ = run_cli(capsys, "history", str(clean), "--until", "1min", "--json")
    assert code == exit_codes.OK
    assert [event["event_id"] for event in json.loads(out)["events"]] == list(range(1, 18))


@pytest.mark.parametrize("bad", ["1 fortnight", "h1", "yesterday-ish", "10"])
def test_a_time_that_is_neither_iso_nor_relative_is_a_usage_error(clean, capsys, bad):
    code, _, err = run_cli(capsys, "history", str(clean), "--since", bad)
    assert code == exit_codes.UNUSABLE
    assert "expected a time like" in err and "1 hour ago" in err


# --- --reverse and the --after-event cursor -------------------------------------------------


def test_history_reverse_prints_the_newest_first_and_last_keeps_the_newest(clean, capsys):
    _, out, _ = run_cli(capsys, "history", str(clean), "--reverse", "--nl")
    assert [json.loads(line)["event_id"] for line in out.splitlines()] == list(range(17, 0, -1))
    _, out, _ = run_cli(capsys, "history", str(clean), "-r", "--last", "3", "--nl")
    assert [json.loads(line)["event_id"] for line in out.splitlines()] == [17, 16, 15]


def test_after_event_shows_only_later_events_and_json_gives_the_next_cursor(clean, capsys):
    code, out, _ = run_cli(capsys, "history", str(clean), "--after-event", "14", "--csv")
    assert code == exit_codes.OK
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [row["event_id"] for row in rows] == ["15", "16", "17"]
    # The cursor is the ledger's newest event, also when the filter matched none of the last.
    _, out, _ = run_cli(capsys, "history", str(clean), "--kind", "abort", "--json")
    report = json.loads(out)
    assert [event["event_id"] for event in report["events"]] == [15]
    assert report["ledgers"] == [{"path": str(clean), "rank": 0, "cursor": 17}]
    _, out, _ = run_cli(capsys, "history", str(clean), "--after-event", "17", "--json")
    assert (json.loads(out)["events"], json.loads(out)["ledgers"][0]["cursor"]) == ([], 17)


@pytest.mark.parametrize("other", [["--reverse"], ["--until", "1h"]])
def test_follow_refuses_options_that_need_an_end(clean, capsys, other):
    code, _, err = run_cli(capsys, "history", str(clean), "--follow", *other)
    assert code == exit_codes.UNUSABLE
    assert "--follow" in err


# --- --follow against a live writer ---------------------------------------------------------


def _start_follower(*arguments: str) -> subprocess.Popen[bytes]:
    """``layout-ledger *arguments`` with SIGINT not ignored, as in a terminal's foreground.

    A process started in the background of a non-interactive shell inherits SIGINT ignored (and
    so would the follower, which Ctrl-C, the test's SIGINT, would then never reach); an ignored
    signal stays ignored across exec, a handled one starts at its default there.
    """
    inherited = signal.getsignal(signal.SIGINT)
    if inherited == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [str(CONSOLE_SCRIPT), *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    finally:
        if inherited == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Lines:
    """A child's stdout read line by line without blocking past a deadline."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self._stream = process.stdout
        os.set_blocking(self._stream.fileno(), False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._stream, selectors.EVENT_READ)
        self._buffer = b""
        self.lines: list[str] = []

    def read_until(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.lines) and time.monotonic() < deadline:
            if self._selector.select(timeout=0.2):
                chunk = self._stream.read() or b""
                self._buffer += chunk
                *complete, self._buffer = self._buffer.split(b"\n")
                self.lines.extend(line.decode() for line in complete)


def _read_calls(pid: int) -> int:
    """The read system calls process ``pid`` made so far (an open ledger costs many)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError("no syscr in /proc/PID/io")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", ["--nl", "--csv"])
def test_follow_prints_every_committed_event_once_in_order_and_sigint_exits_0(tmp_path, form):
    path = tmp_path / "live.sqlite"
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    commits = context.Value("i", 0)
    writer = context.Process(target=committing_writer, args=(str(path), ready, stop, commits))
    writer.start()
    follower = None
    try:
        assert ready.wait(120), "the writer process did not start"
        while commits.value < 20:
            time.sleep(0.01)
        follower = _start_follower("history", str(path), "--follow", form)
        lines = _Lines(follower)
        header = 1 if form == "--csv" else 0
        # At least the first ten (tail's habit), then events committed while it follows.
        lines.read_until(lambda got: len(got) >= header + 40, 60)
        stop.set()
        writer.join(60)
        assert writer.exitcode == 0
        (last_id,) = query(path, "SELECT max(event_id) FROM events")[0]
        end = str(last_id)
        lines.read_until(
            lambda got: any(f'"event_id": {end},' in x or x.split(",")[2:3] == [end] for x in got),
            30,
        )
        # Nothing changes now (after the follower saw the writer's last checkpoint, a poll or
        # two later): it only compares two stats a poll, reading nothing.
        time.sleep(1)
        idle_before = _read_calls(follower.pid)
        time.sleep(2)
        idle_reads = _read_calls(follower.pid) - idle_before
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    finally:
        stop.set()
        writer.join(60)
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
    assert (follower.returncode, err) == (0, b"")
    if form == "--csv":
        assert lines.lines[0].startswith("ledger,rank,event_id,incarnation_id,at,kind,")
        ids = [int(row["event_id"]) for row in csv.DictReader(io.StringIO("\n".join(lines.lines)))]
    else:
        ids = [json.loads(line)["event_id"] for line in lines.lines]
    assert ids == list(range(ids[0], last_id + 1)), "an event was missed or printed twice"
    assert len(ids) >= 40
    kinds = [kind for (kind,) in query(path, f"SELECT kind FROM events WHERE event_id >= {ids[0]}")]
    assert kinds[-1] == "end"
    assert idle_reads == 0, f"an idle follower made {idle_reads} reads in 2 s"


@pytest.mark.parametrize("form", [[], ["--json"]])
def test_follow_of_a_quiet_ledger_prints_the_last_ten_then_stops_on_sigint(clean, form):
    # --json follows as journalctl -f -o json does: one JSON object a line (--nl's rows).
    follower = _start_follower("history", str(clean), "--follow", *form)
    try:
        lines = _Lines(follower)
        lines.read_until(lambda got: len(got) >= 10, 60)
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert (follower.returncode, err) == (0, b"")
    if form:
        assert [json.loads(line)["event_id"] for line in lines.lines] == list(range(8, 18))
    else:
        assert [line.split()[2] for line in lines.lines] == [f"#{n}" for n in range(8, 18)]


def _start_a_new_incarnation(path: str) -> None:
    start(Ledger.open(path))
    os._exit(0)  # killed: the kernel drops the lock


@pytest.mark.timeout(120)
def test_follow_of_a_stopped_daemons_ledger_sees_the_next_daemon_start(tmp_path, clean):
    # A stopped daemon's ledger is read in immutable mode (no -wal, no -shm made beside it);
    # when a daemon starts on it, the follower reopens it and prints the new incarnation.
    path = tmp_path / "stopped.sqlite"
    shutil.copyfile(clean, path)
    if Path(f"{clean}-wal").exists():
        shutil.copyfile(f"{clean}-wal", f"{path}-wal")
    conn = sqlite3.connect(path)  # the whole history into the main file, the WAL emptied
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    follower = _start_follower("history", str(path), "--follow", "--kind", "start", "--nl")
    try:
        lines = _Lines(follower)
        lines.read_until(lambda got: len(got) >= 2, 60)
        daemon = multiprocessing.get_context("fork").Process(
            target=_start_a_new_incarnation, args=(str(path),)
        )
        daemon.start()
        daemon.join(60)
        lines.read_until(lambda got: len(got) >= 3, 30)
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert (follower.returncode, err) == (0, b"")
    assert [json.loads(line)["incarnation_id"] for line in lines.lines] == [1, 2, 3]


def _reads_settled(pid: int) -> None:
    """Return once process ``pid`` made no read for three polls (it is not inside a read)."""
    deadline = time.monotonic() + 30
    before = _read_calls(pid)
    while True:
        time.sleep(3 * POLL_SECONDS)
        now = _read_calls(pid)
        if now == before:
            return
        assert time.monotonic() < deadline, "the follower never stopped reading"
        before = now


@pytest.mark.timeout(120)
def test_follow_shows_a_commit_that_leaves_the_wal_the_same_size_after_a_checkpoint(tmp_path):
    # After a checkpoint copied every frame, the next commit writes the WAL again from its
    # start: the file keeps its size (and inode), only its modification time tells.
    path = tmp_path / "live.sqlite"
    wal = Path(f"{path}-wal")
    ledger = Ledger.open(path)  # this process is the daemon writing the ledger
    follower = None
    try:
        record = start(ledger)
        record.attach("engine-w")
        for step in range(8):  # a WAL of many frames
            commit(record, "engine-w", {step % 4: rotated([0, 1, 2, 3, 0, 1], step % 6)})
        follower = _start_follower("history", str(path), "--follow", "--nl")
        lines = _Lines(follower)
        lines.read_until(lambda got: len(got) >= 10, 60)
        for _ in range(5):
            assert ledger.checkpoint().complete
            _reads_settled(follower.pid)  # it saw the checkpoint (or missed it) and is idle
            size = wal.stat().st_size
            version = commit(record, "engine-w", {0: [3, 2, 1, 0, 0, 1]})
            if wal.stat().st_size == size:
                break  # a commit the WAL's size does not show (else a read pinned the WAL)
        else:
            raise AssertionError("no commit after a checkpoint kept the WAL's size in 5 tries")
        ((event_id,),) = query(path, "SELECT max(event_id) FROM events WHERE kind = 'commit'")
        lines.read_until(lambda got: any(f'"event_id": {event_id},' in x for x in got), 10)
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
        ledger.close()
    assert (follower.returncode, err) == (0, b"")
    shown = [json.loads(line) for line in lines.lines]
    assert (shown[-1]["event_id"], shown[-1]["kind"], shown[-1]["new_version"]) == (
        event_id,
        "commit",
        version,
    ), "the commit was never shown"


# --- many ledgers: one timeline ---------------------------------------------------------------


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("two")
    build("clean", directory / "a.sqlite")  # 17 events, t0..t16
    build("dirty", directory / "b.sqlite")  # 9 events, t0..t7
    return directory


def test_history_of_many_ledgers_is_one_timeline_each_line_naming_its_rank(two, capsys):
    code, out, _ = run_cli(capsys, "history", str(two), "--nl")
    assert code == exit_codes.OK
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 17 + 9
    assert [row["at"] for row in rows] == sorted(row["at"] for row in rows)
    assert {(row["ledger"], row["rank"]) for row in rows} == {
        (str(two / "a.sqlite"), 0),
        (str(two / "b.sqlite"), 1),
    }
    _, out, _ = run_cli(capsys, "history", str(two), "--kind", "dirty")
    assert out == (
        f"rank 1  {at(5)}  inc=1  #7  dirty engine=engine-a layers=2-3 base=1  (engine 'engine-a' "
        "detached while its move of layers [2, 3] from version 1 was pending, so the weights of "
        "those layers may be half-moved; restart the daemon (it reloads the weights from disk) "
        "and the engines that use it)\n"
    )
    # --last: the newest of the whole timeline; --reverse: newest first; --json: each cursor.
    _, out, _ = run_cli(capsys, "history", str(two), "--last", "3", "-r", "--json")
    report = json.loads(out)
    assert [(e["rank"], e["event_id"]) for e in report["events"]] == [(0, 17), (0, 16), (0, 15)]
    assert [ledger["cursor"] for ledger in report["ledgers"]] == [17, 9]


def test_a_cursor_is_one_ledgers_so_many_ledgers_refuse_after_event(two, capsys):
    code, out, err = run_cli(capsys, "history", str(two), "--after-event", "3")
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert "poll each ledger with its own cursor" in err


@pytest.mark.timeout(240)
def test_follow_of_many_ledgers_prints_each_ledgers_new_events_naming_its_rank(tmp_path, clean):
    shutil.copyfile(clean, tmp_path / "a.sqlite")
    if Path(f"{clean}-wal").exists():
        shutil.copyfile(f"{clean}-wal", tmp_path / "a.sqlite-wal")
    live = tmp_path / "b.sqlite"
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    commits = context.Value("i", 0)
    writer = context.Process(target=committing_writer, args=(str(live), ready, stop, commits))
    writer.start()
    follower = None
    try:
        assert ready.wait(120), "the writer process did not start"
        follower = _start_follower("history", str(tmp_path), "--follow", "--nl")
        lines = _Lines(follower)
        lines.read_until(lambda got: len(got) >= 40, 60)
        stop.set()
        writer.join(60)
        (last_id,) = query(live, "SELECT max(event_id) FROM events")[0]
        lines.read_until(lambda got: any(f'"event_id": {last_id},' in x for x in got), 30)
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    finally:
        stop.set()
        writer.join(60)
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
    assert (follower.returncode, err) == (0, b"")
    rows = [json.loads(line) for line in lines.lines]
    assert len(rows[:10]) == 10  # the timeline's last ten first
    live_ids = [row["event_id"] for row in rows if row["ledger"] == str(live)]
    assert live_ids == list(range(live_ids[0], last_id + 1)), "an event missed or printed twice"
    assert {row["rank"] for row in rows if row["ledger"] == str(live)} == {1}


# --- status: how long ago -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(5, "5 s ago"), (300, "5 min ago"), (3 * 3600 + 120, "3 h 2 min ago"), (2 * 86400, "2 d ago")],
)
def test_ago_says_how_long_before_now_a_ledger_time_was(seconds, text):
    recorded = (NOW - datetime.timedelta(seconds=seconds)).isoformat(timespec="microseconds")
    assert ago(recorded, NOW) == text
    assert ago((NOW + datetime.timedelta(seconds=5)).isoformat(), NOW) == "in 5 s"


def test_status_says_how_long_ago_each_time_it_shows_was(clean, capsys, monkeypatch):
    later = EPOCH + datetime.timedelta(hours=2)
    monkeypatch.setattr(status_command, "_utc_now", lambda: later)
    _, out, _ = run_cli(capsys, "status", str(clean))
    assert f"(started {at(4)}; 1 h 59 min ago, not running," in out
    assert f"last event:          {at(16)} commit engine-a; 1 h 59 min ago\n" in out
