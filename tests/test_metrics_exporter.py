"""An exporter that scales (issue 23, item 4; issue 20, item 7's ``metrics --serve`` part).

A scrape costs the events appended since the last one (``OverviewCache``), and says exactly what
a full read says; labels stay bounded and name each ledger by its real path; ``--serve :PORT``
binds the loopback; the server holds a bounded number of threads and sockets however many
clients stall, drops each at its deadline, and concurrent scrapes share one collection.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from cli_ledgers import run_cli
from engine_ledgers import ENGINE, EngineLedgers
from prometheus_client.parser import text_string_to_metric_families

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.metrics import collect_metrics, exposition, serve_metrics
from layout_ledger.cli.parser import parse
from layout_ledger.history import overview
from layout_ledger.history.overview import read_overview
from layout_ledger.store import replay


def OverviewCache() -> overview.OverviewCache:
    return overview.OverviewCache()


pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def engine(tmp_path: Path):
    (tmp_path / "ledgers").mkdir()
    ledgers = EngineLedgers(tmp_path / "ledgers", 2)
    ledgers.commit_all(3)
    try:
        yield ledgers
    finally:
        ledgers.close()


def _same(cached: overview.LedgerOverview, full: overview.LedgerOverview) -> None:
    """A cached overview says what a full read says (but the map, which it does not read)."""
    assert cached.state.version == full.state.version
    assert cached.state.digest == full.state.digest
    assert (cached.state.pending, cached.state.dirty) == (full.state.pending, full.state.dirty)
    assert cached.state.attached == full.state.attached
    assert cached.state.non_following_fetch == full.state.non_following_fetch
    assert cached.state.cordon == full.state.cordon
    assert (cached.commits, dict(cached.refusals)) == (full.commits, dict(full.refusals))
    assert dict(cached.begin_causes) == dict(full.begin_causes)
    assert cached.reconstructible_from == full.reconstructible_from
    assert cached.last_commit_at == full.last_commit_at
    assert cached.incarnation == full.incarnation


def test_a_cached_read_replays_only_the_new_events_and_says_what_a_full_read_says(
    engine, monkeypatch
):
    read_rows: list[int] = []
    real = replay._stored_events

    def counting(conn, incarnation_id, after=0):
        found = real(conn, incarnation_id, after)
        read_rows.append(len(found))
        return found

    monkeypatch.setattr(replay, "_stored_events", counting)
    cache = OverviewCache()
    path = engine.paths[0]
    _same(cache.read(path), read_overview(path))
    read_rows.clear()
    engine.commit(0)  # a begin and a commit
    _same(cache.read(path), read_overview(path))
    assert read_rows[0] == 2  # the cache's replay read the two new events, not the history
    read_rows.clear()
    assert cache.read(path).state.version == 4 and read_rows == [0]
    record = engine.records[0]
    # Identical refusals are counted on one row (its count grows in place), then others.
    for _ in range(3):
        record.record_refusal("begin", ENGINE, "base_version 1 is not the current version 4")
        _same(cache.read(path), read_overview(path))
    record.record_refusal("begin", ENGINE, "other engines are attached (b)", busy=True)
    record.cordon_moves("drain")
    _same(cache.read(path), read_overview(path))
    assert cache.read(path).begin_causes["stale_base_version"] == 3
    record.uncordon()
    engine.restart(0)  # a new incarnation: the cache starts it over
    engine.commit(0)
    _same(cache.read(path), read_overview(path))
    assert cache.read(path).incarnation.incarnation_id == 2


def test_a_replaced_ledger_file_is_read_from_its_start(engine, tmp_path):
    cache = OverviewCache()
    first, second = engine.paths
    engine.commit(0)
    assert cache.read(first).state.version == 4
    moved = tmp_path / "moved.sqlite"
    os.rename(first, moved)
    os.rename(second, first)  # another file under the same name, its history shorter
    try:
        _same(cache.read(first), read_overview(first))
        assert cache.read(first).state.version == 3
    finally:
        os.rename(first, second)
        os.rename(moved, first)


def test_the_ledger_label_is_the_real_path_and_no_label_changes_per_commit_or_restart(
    engine, tmp_path, monkeypatch
):
    link = tmp_path / "link.sqlite"
    os.symlink(engine.paths[0], link)
    monkeypatch.chdir(engine.paths[0].parent)
    for spec in (link, Path(engine.paths[0].name), engine.paths[0].parent / ".." / "ledgers"):
        report = collect_metrics([spec])
        assert report.ledgers[0].path == os.path.realpath(engine.paths[0])
    before = exposition(collect_metrics([engine.paths[0]])).decode()
    engine.commit(0)
    engine.restart(0)
    after = exposition(collect_metrics([engine.paths[0]])).decode()

    def series(text: str) -> set[tuple[str, tuple]]:
        return {
            (s.name, tuple(sorted(s.labels.items())))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    assert series(before) == series(after)  # values changed, not the set of series


def test_serve_on_a_bare_port_binds_the_loopback_and_help_says_what_a_remote_scraper_needs(
    capsys,
):
    assert parse(["metrics", "L", "--serve", ":9400"]).serve == ("127.0.0.1", 9400)
    assert parse(["metrics", "L", "--serve", "0.0.0.0:9400"]).serve == ("0.0.0.0", 9400)
    assert parse(["metrics", "L", "--serve", "[::]:9400"]).serve == ("::", 9400)
    _, out, _ = run_cli(capsys, "metrics", "--help")
    text = " ".join(out.split())
    assert ":PORT binds the loopback only (127.0.0.1): a Prometheus on another host needs" in text
    assert "0.0.0.0:PORT (every interface)" in text


def _threads() -> int:
    return threading.active_count()


def _scrape(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode()


def test_stalled_clients_hold_a_bounded_number_of_threads_and_are_dropped_at_the_deadline(
    engine,
):
    before = _threads()
    server = serve_metrics(
        "127.0.0.1", 0, engine.paths, {}, max_connections=16, deadline=1.0, workers=2
    )
    stalled: list[socket.socket] = []
    try:
        assert _threads() <= before + 3  # one accepting thread, two workers
        host, port = server.http.server_address
        for n in range(200):
            client = socket.create_connection((host, port), timeout=5)
            if n % 2:
                client.sendall(b"GET /metr")  # a trickle that never ends its request
            stalled.append(client)
        time.sleep(0.3)
        assert _threads() <= before + 3
        assert server.http.open_connections <= 16
        time.sleep(1.5)  # past the deadline: every stalled connection was dropped
        assert server.http.open_connections == 0
        assert server.http.timed_out >= 16 and server.http.rejected >= 100
        started = time.monotonic()
        assert "sglang_expert_layout_version" in _scrape(server.url)
        assert time.monotonic() - started < 5
    finally:
        for client in stalled:
            client.close()
        server.close()
    assert _threads() <= before


def test_concurrent_scrapes_share_one_collection(engine, monkeypatch):
    server = serve_metrics("127.0.0.1", 0, engine.paths, {})
    real = server._collect

    def slow() -> bytes:
        time.sleep(0.5)  # long enough for every scrape to arrive while it runs
        return real()

    server.shared._collect = slow
    try:
        start = server.shared.collections
        results: list[str] = []
        threads = [
            threading.Thread(target=lambda: results.append(_scrape(server.url))) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(results) == 8 and len(set(results)) <= 2
        assert server.shared.collections - start <= 2
    finally:
        server.close()


def test_unknown_paths_and_methods_get_their_status_and_the_server_says_where_it_binds(engine):
    server = serve_metrics("127.0.0.1", 0, engine.paths, {})
    try:
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(server.url.replace("/metrics", "/nope"), timeout=10)
        assert raised.value.code == 404
        request = urllib.request.Request(server.url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=10)
        assert raised.value.code == 405
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    finally:
        server.close()


def test_the_runbooks_series_have_values(engine, tmp_path):
    record = engine.records[1]
    record.fetch({"engine_id": None, "version": record.version, "digest": record.digest})
    record.cordon_moves("drain")
    record.record_refusal("begin", ENGINE, "other engines are attached (x)", busy=True)
    text = exposition(collect_metrics(engine.paths, now=lambda: 1.0e9)).decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            ledger = Path(sample.labels.get("ledger", "-")).name
            extra = sample.labels.get("reason", "")
            values[sample.name, ledger, extra] = sample.value
    assert values["sglang_expert_layout_cordoned", "rank-01.sqlite", ""] == 1
    assert values["sglang_expert_layout_cordoned", "rank-00.sqlite", ""] == 0
    assert values["sglang_expert_layout_ledger_wal_bytes", "rank-00.sqlite", ""] > 0
    assert values["sglang_expert_layout_ledger_file_bytes", "rank-00.sqlite", ""] > 0
    assert values["sglang_expert_layout_versions_held", "rank-00.sqlite", ""] == 4
    assert values["sglang_expert_layout_non_following_fetch", "rank-00.sqlite", ""] == 0
    assert values["sglang_expert_layout_non_following_fetch", "rank-01.sqlite", ""] == 1
    assert (
        values["sglang_expert_layout_busy_begins_total", "rank-01.sqlite", "busy_other_engine"] == 1
    )
    assert values["sglang_expert_layout_exporter_collected_timestamp_seconds", "-", ""] == 1.0e9


def test_an_unreadable_ledger_is_one_error_line_and_a_textfile_not_named_prom_is_warned(
    engine, tmp_path, capsys
):
    broken = tmp_path / "broken.sqlite"
    broken.write_text("hello")
    code, _, err = run_cli(capsys, "metrics", str(engine.paths[0]), str(broken))
    assert code == exit_codes.UNUSABLE
    assert err.count("\n") == 1 and err.startswith("layout-ledger metrics: error: ")
    output = tmp_path / "layout.txt"
    code, _, err = run_cli(capsys, "metrics", str(engine.paths[0]), "-o", str(output))
    assert code == exit_codes.OK and output.exists()
    assert err == (
        f"layout-ledger metrics: warning: {output} does not end in .prom: node_exporter's textfile "
        "collector reads only *.prom files, so it will not read this one\n"
    )


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("1bad=x", "'1bad' is not a Prometheus label name"),
        ("__x=1", "'__x' is not a Prometheus label name"),
        ("ledger=x", "'ledger' is a label the series already have"),
    ],
)
def test_a_bad_label_is_a_bad_argument_exit_2(capsys, label, message):
    code, out, err = run_cli(capsys, "metrics", "L", "--label", label)
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err.startswith("layout-ledger metrics: error: argument --label: ") and message in err


def test_a_label_given_twice_is_refused_not_overwritten(capsys):
    code, _, err = run_cli(capsys, "metrics", "L", "--label", "a=1", "--label", "a=2")
    assert code == exit_codes.UNUSABLE
    assert "argument --label: 'a' given twice; give each label once" in err
