"""Read commands work while a daemon-like writer process commits, each on one snapshot."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
from cli_ledgers import committing_writer, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.core.layout import layout_digest


@pytest.mark.timeout(180)
def test_status_show_verify_and_history_read_consistent_snapshots_while_a_writer_commits(
    tmp_path, capsys
):
    path = tmp_path / "live.sqlite"
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    commits = context.Value("i", 0)
    writer = context.Process(target=committing_writer, args=(str(path), ready, stop, commits))
    writer.start()
    seen: set[int] = set()
    try:
        assert ready.wait(120), "the writer process did not start"
        deadline = time.monotonic() + 90
        while (len(seen) < 8 or commits.value < 40) and time.monotonic() < deadline:
            code, out, err = run_cli(capsys, "status", str(path), "--json")
            (status,) = json.loads(out)["ledgers"]
            assert err == ""
            if status["pending"] is None:
                assert code == exit_codes.OK
            else:  # caught between a begin and its commit: that begin is on this version
                assert code == exit_codes.PENDING_OR_REFUSALS
                assert status["pending"]["base_version"] == status["version"]
            version = status["version"]
            _, out, _ = run_cli(capsys, "show", str(path), "--version", str(version), "--json")
            shown = json.loads(out)
            the_map = [layer["slots"] for layer in shown["layers"]]
            assert layout_digest(the_map) == shown["digest"] == status["digest"]
            code, out, _ = run_cli(capsys, "verify", str(path), "--json")
            assert code == exit_codes.OK, json.loads(out)["first_inconsistency"]
            seen.add(version)
    finally:
        stop.set()
        writer.join(60)
    assert writer.exitcode == 0
    assert len(seen) >= 8, f"the readers saw only versions {sorted(seen)}"
    # The writer closed cleanly: everything it committed is there, consistent.
    code, out, _ = run_cli(capsys, "status", str(path), "--json")
    (status,) = json.loads(out)["ledgers"]
    assert (code, status["version"], status["end_state"]) == (
        exit_codes.NOT_RUNNING,  # stopped cleanly: not running
        commits.value,
        "clean",
    )
    _, out, _ = run_cli(capsys, "history", str(path), "--kind", "commit", "--json")
    assert [event["new_version"] for event in json.loads(out)["events"]] == list(
        range(1, commits.value + 1)
    )
    assert run_cli(capsys, "verify", str(path))[0] == exit_codes.OK
