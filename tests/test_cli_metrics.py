"""``layout-ledger metrics``: the ledgers as Prometheus series, parsed with prometheus_client's own
parser: a text file written atomically, stdout, and a real HTTP exporter (``--serve``) scraped
while real model-less daemons commit, re-reading the ledgers on every scrape; a scrape's read
snapshot never holds a daemon's commit back."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cli_ledgers import run_cli
from engine_ledgers import GEOMETRY, EngineLedgers, this_host
from prometheus_client.parser import text_string_to_metric_families

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.metrics import collect_metrics, exposition
from layout_ledger.core.layout import trivial_map
from layout_ledger.history import overview as snapshot
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import EngineStandIn, start_daemon

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
SERIES = {
    "sglang_expert_layout_version",
    "sglang_expert_layout_dirty",
    "sglang_expert_layout_move_pending",
    "sglang_expert_layout_move_pending_seconds",
    "sglang_expert_layout_attached_engines",
    "sglang_expert_layout_daemon_up",
    "sglang_expert_layout_commits_total",
    "sglang_expert_layout_refusals_total",
    "sglang_expert_layout_last_commit_timestamp_seconds",
    "sglang_expert_layout_incarnation",
    "sglang_expert_layout_info",
    "sglang_expert_layout_ledger_readable",
    # issue 23: what the runbook needs, the textfile's age, the cordon, retired ledgers
    "sglang_expert_layout_digest_prefix",
    "sglang_expert_layout_non_following_fetch",
    "sglang_expert_layout_cordoned",
    "sglang_expert_layout_versions_held",
    "sglang_expert_layout_ledger_file_bytes",
    "sglang_expert_layout_ledger_wal_bytes",
    "sglang_expert_layout_begin_refusals_total",
    "sglang_expert_layout_busy_begins_total",
    "sglang_expert_layout_ledger_retired",
    "sglang_expert_layout_exporter_collected_timestamp_seconds",
    # issue 21: standbys' leases
    "sglang_expert_layout_standby_leases",
    "sglang_expert_layout_lease_holders",
    "sglang_expert_layout_exporter_collect_seconds",
}


def parse(text: str) -> dict[tuple[str, str], Any]:
    """{(sample name, ledger label): sample} of an exposition, through prometheus_client."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("ledger", ""))
            if sample.name == "sglang_expert_layout_refusals_total":
                key = (f"{sample.name}:{sample.labels['kind']}", sample.labels["ledger"])
            if sample.name in (
                "sglang_expert_layout_begin_refusals_total",
                "sglang_expert_layout_busy_begins_total",
            ):
                key = (f"{sample.name}:{sample.labels['reason']}", sample.labels["ledger"])
            is_attached = sample.name == "sglang_expert_layout_attached_engines"
            if is_attached and sample.labels["role"] != "active":
                continue  # the standby series (0 here): tests/test_standby_leases.py
            samples[key] = sample
    return samples


@pytest.fixture
def engine(tmp_path: Path):
    (tmp_path / "ledgers").mkdir()
    ledgers = EngineLedgers(tmp_path / "ledgers", 2)
    ledgers.commit_all(2)
    try:
        yield ledgers
    finally:
        ledgers.close()


def test_metrics_writes_every_series_for_every_ledger_atomically_as_a_textfile(
    engine, tmp_path, capsys
):
    engine.begin(1)
    engine.records[0].record_refusal("begin", "engine-b", "engine-a is attached", busy=True)
    output = tmp_path / "textfile" / "layout.prom"
    output.parent.mkdir()
    code, out, err = run_cli(
        capsys, "metrics", str(engine.paths[0].parent), "-o", str(output), "--label", "engine=e1"
    )
    assert (code, err) == (exit_codes.OK, "")
    assert out == f"wrote {output}: 2 ledgers\n"
    assert sorted(os.listdir(output.parent)) == ["layout.prom"]  # no temporary left behind
    assert stat.S_IMODE(output.stat().st_mode) == 0o644
    samples = parse(output.read_text())
    assert {name.split(":")[0] for name, _ in samples} == SERIES
    first, second = map(str, engine.paths)
    assert samples["sglang_expert_layout_version", first].labels == {
        "ledger": first,
        "host": this_host(),
        "device_uuid": "GPU-0000",
        "gpu_id": "0",
        "tp_rank": "0",
        "engine": "e1",
    }
    values = {key: sample.value for key, sample in samples.items()}
    assert values["sglang_expert_layout_version", first] == 2
    assert values["sglang_expert_layout_move_pending", first] == 0
    assert values["sglang_expert_layout_move_pending", second] == 1
    assert values["sglang_expert_layout_move_pending_seconds", second] > 0
    assert values["sglang_expert_layout_dirty", first] == 0
    assert values["sglang_expert_layout_attached_engines", first] == 1
    assert values["sglang_expert_layout_daemon_up", first] == 1
    assert values["sglang_expert_layout_commits_total", first] == 2
    # A busy begin is no refusal: counted apart, as status counts it.
    assert ("sglang_expert_layout_refusals_total:begin_busy", first) not in values
    assert values["sglang_expert_layout_refusals_total:fetch_refused", first] == 0
    assert values["sglang_expert_layout_incarnation", first] == 1
    assert (
        abs(values["sglang_expert_layout_last_commit_timestamp_seconds", first] - time.time()) < 60
    )
    assert values["sglang_expert_layout_ledger_readable", first] == 1
    info = samples["sglang_expert_layout_info", first]
    # The digest is no label (a new series per commit): a value, its first 12 hex digits.
    assert info.value == 1 and "digest" not in info.labels and "pid" not in info.labels
    assert values["sglang_expert_layout_digest_prefix", first] == int(
        engine.records[0].digest[:12], 16
    )
    # "engine-a is attached" is no wording of the rules: a busy begin counted as "busy_other"
    assert values["sglang_expert_layout_busy_begins_total:busy_other", first] == 1
    assert values["sglang_expert_layout_begin_refusals_total:other", first] == 0
    assert info.labels["config_fingerprint"] == "fp-0"


def test_metrics_without_o_prints_the_exposition_and_json_lists_the_samples(engine, capsys):
    code, out, _ = run_cli(capsys, "metrics", str(engine.paths[0]))
    assert code == exit_codes.OK
    assert parse(out)["sglang_expert_layout_version", str(engine.paths[0])].value == 2
    code, out, _ = run_cli(capsys, "metrics", str(engine.paths[0]), "--json")
    shown = json.loads(out)
    assert (shown["output"], shown["ledgers"], shown["unreadable"]) == (None, 1, [])
    versions = [s for s in shown["samples"] if s["name"] == "sglang_expert_layout_version"]
    assert [s["value"] for s in versions] == [2.0]


def test_metrics_marks_an_unreadable_ledger_and_exits_2_having_written_the_rest(
    engine, tmp_path, capsys
):
    broken = tmp_path / "broken.sqlite"
    broken.write_text("hello")
    output = tmp_path / "layout.prom"
    code, _, err = run_cli(capsys, "metrics", str(engine.paths[0]), str(broken), "-o", str(output))
    assert code == exit_codes.UNUSABLE
    assert err.startswith(f"layout-ledger metrics: error: cannot read ledger {broken}: ")
    samples = parse(output.read_text())
    assert samples["sglang_expert_layout_ledger_readable", str(broken)].value == 0
    assert samples["sglang_expert_layout_ledger_readable", str(engine.paths[0])].value == 1
    assert ("sglang_expert_layout_version", str(broken)) not in samples


def test_a_daemon_that_is_not_running_reads_daemon_up_0_and_one_recording_another_host_1(
    tmp_path,
):
    initial = trivial_map(
        GEOMETRY.num_layers, GEOMETRY.num_physical_slots, GEOMETRY.num_logical_experts
    )
    stopped, elsewhere = tmp_path / "stopped.sqlite", tmp_path / "elsewhere.sqlite"
    ledger = Ledger.open(stopped)
    ledger.start_incarnation(GEOMETRY, initial, origin=IncarnationOrigin.of_this_process())
    ledger.close()
    other = Ledger.open(elsewhere)
    other.start_incarnation(GEOMETRY, initial, origin=IncarnationOrigin(host="node-b"))
    try:
        samples = parse(exposition(collect_metrics([stopped, elsewhere])).decode())
    finally:
        other.close()
    assert samples["sglang_expert_layout_daemon_up", str(stopped)].value == 0
    # Its host name is another container's; its writer lock, held here, is the kernel's.
    assert samples["sglang_expert_layout_daemon_up", str(elsewhere)].value == 1


def test_only_metrics_imports_prometheus_client_and_without_it_metrics_says_how_to_install(
    engine,
):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = (
        "import sys\n"
        "from layout_ledger.cli.app import main\n"
        f"code = main(['fleet', {str(engine.paths[0])!r}, '--json'])\n"
        "assert code == 0, code\n"
        "assert 'prometheus_client' not in sys.modules, 'fleet imported prometheus_client'\n"
        "sys.modules['prometheus_client'] = None  # as if the extra were not installed\n"
        f"sys.exit(main(['metrics', {str(engine.paths[0])!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == exit_codes.FAILED, result.stderr
    assert result.stderr == (
        "layout-ledger metrics: error: layout-ledger metrics needs the prometheus_client library "
        "(python -m pip install prometheus-client: the [metrics] extra)\n"
    )


def test_a_scrapes_read_snapshot_never_holds_a_daemons_commit_back(tmp_path, monkeypatch):
    daemon = start_daemon(tmp_path)
    engine = client.attach(daemon.socket_path, "engine-a")
    seen: dict[str, float] = {}
    real = snapshot._last_commit_at

    def commit_meanwhile(conn, incarnation_id):  # inside the scrape's read transaction
        started = time.monotonic()
        assert client.begin(daemon.socket_path, "engine-a", 0, [0]).ok
        reply = client.commit(daemon.socket_path, "engine-a", {0: [1, 0, 2, 3, 4, 5, 6, 7, 0, 1]})
        assert reply.ok, reply
        seen["commit_seconds"] = time.monotonic() - started
        return real(conn, incarnation_id)

    monkeypatch.setattr(snapshot, "_last_commit_at", commit_meanwhile)
    try:
        report = collect_metrics([daemon.ledger_path])
        (item,) = report.ledgers
        assert item.state.version == 0  # the scrape reads its own snapshot, from before
        assert seen["commit_seconds"] < 2.0  # the commit did not wait for the reader
        monkeypatch.setattr(snapshot, "_last_commit_at", real)
        (item,) = collect_metrics([daemon.ledger_path]).ledgers
        assert item.state.version == 1
    finally:
        engine.close()
        daemon.kill()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(url: str) -> dict[tuple[str, str], Any]:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return parse(response.read().decode())


def test_serve_exports_metrics_over_http_re_reading_the_ledgers_on_each_scrape(tmp_path):
    daemons = [
        start_daemon(tmp_path, f"daemon{rank}", extra=["--tp-rank", str(rank)]) for rank in range(2)
    ]
    engine = [EngineStandIn.start(d.socket_path, "engine-a") for d in daemons]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "layout_ledger.cli.app",
            "metrics",
            "--serve",
            f"127.0.0.1:{port}",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = f"http://127.0.0.1:{port}/metrics"
        assert line.startswith(f"serving {url}: 1 ledger path(s)")
        first = _scrape(url)
        ledgers = [d.ledger_path for d in daemons]
        assert [first["sglang_expert_layout_version", path].value for path in ledgers] == [0, 0]
        assert [first["sglang_expert_layout_daemon_up", path].value for path in ledgers] == [1, 1]
        assert first["sglang_expert_layout_version", ledgers[1]].labels["tp_rank"] == "1"
        assert engine[1].begin(0, [0]).ok
        second = _scrape(url)
        assert second["sglang_expert_layout_move_pending", ledgers[1]].value == 1
        assert engine[1].commit({0: [1, 0, 2, 3, 4, 5, 6, 7, 0, 1]}).ok
        daemons[0].kill()  # SIGKILL
        third = _scrape(url)
        assert third["sglang_expert_layout_version", ledgers[1]].value == 1
        assert third["sglang_expert_layout_commits_total", ledgers[1]].value == 1
        assert third["sglang_expert_layout_daemon_up", ledgers[0]].value == 0
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == exit_codes.OK
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        for stand_in in engine:
            stand_in.kill()
        for daemon in daemons:
            daemon.kill()


def test_the_alerting_rules_use_only_series_the_exporter_writes_and_cover_the_three_incidents(
    engine,
):
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())
    (group,) = rules["groups"]
    by_name = {rule["alert"]: rule for rule in group["rules"]}
    written = {name for name, _ in parse(exposition(collect_metrics(engine.paths)).decode())}
    written = {name.split(":")[0] for name in written}
    for rule in by_name.values():
        used = set(re.findall(r"sglang_expert_layout_[a-z_]+", rule["expr"]))
        assert used and used <= written, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    dirty = by_name["ExpertLayoutDirty"]
    assert (dirty["expr"], dirty["for"]) == ("sglang_expert_layout_dirty == 1", "0s")
    assert by_name["ExpertLayoutMoveStuck"]["expr"] == (
        "sglang_expert_layout_move_pending_seconds > 300"
    )
    versions = by_name["ExpertLayoutVersionsDiffer"]["expr"].split()
    # Only series with an engine label are compared (issue 23: without one, ledgers of
    # different engines fell into one group).
    assert versions == [
        "max",
        "by",
        "(engine)",
        '(sglang_expert_layout_version{engine!=""})',
        "!=",
        "min",
        "by",
        "(engine)",
        '(sglang_expert_layout_version{engine!=""})',
    ]
