"""``layout-ledger fleet``: every ledger of an engine, and the verdict the engine itself reaches.

16 ranks' ledgers written by the ledger's own writer, each held open as its running daemon
would hold it (tests/engine_ledgers.py): all agreeing, a rank one version behind, a restarted
rank at version 0, a dirty rank, a pending move, an unreadable file; the verdict is
``agreement.decide``'s, the exit code follows the precedence dirty > pending > disagree >
unusable. Then 2 real model-less daemons, one of them SIGKILLed and restarted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cli_ledgers import build, execute, run_cli
from engine_ledgers import EngineLedgers, this_host

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.fleet import collect_fleet
from layout_ledger.core.startup_verdict import FindingKind, decide
from sglang_integration.testing.daemon_control import EngineStandIn, start_daemon

pytestmark = pytest.mark.timeout(240)

RANKS = 16


@pytest.fixture
def engine(tmp_path: Path):
    (tmp_path / "ledgers").mkdir()
    ledgers = EngineLedgers(tmp_path / "ledgers", RANKS)
    ledgers.commit_all(3)
    try:
        yield ledgers
    finally:
        ledgers.close()


def fleet_json(capsys, *paths: object) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "fleet", *map(str, paths), "--json")
    return code, json.loads(out)


def test_sixteen_agreeing_ranks_adopt_their_version_and_exit_0(engine, capsys):
    code, report = fleet_json(capsys, *engine.paths)
    assert code == exit_codes.OK
    digest = engine.records[0].digest
    assert report["verdict"] == {
        "outcome": "adopt",
        "version": 3,
        "digest": digest,
        "reason": f"every daemon holds version 3 (digest {digest[:12]}), none dirty, no move "
        "pending: an engine starting now routes with it",
        "engine_reason": None,
        "mover": "engine-a",
        "moves": "engine engine-a may move (the one lease holder on every daemon)",
    }
    rows = report["ledgers"]
    assert [row["rank"] for row in rows] == list(range(RANKS))
    assert {(row["alive"], row["version"], row["state"], row["host"]) for row in rows} == {
        (True, 3, "clean", this_host())
    }
    assert rows[5]["device_uuid"] == "GPU-0005" and rows[5]["tp_rank"] == 5


def test_a_directory_and_the_daemons_template_name_the_same_ledgers(engine, capsys):
    directory = engine.paths[0].parent
    by_file = fleet_json(capsys, *engine.paths)[1]
    assert fleet_json(capsys, directory)[1] == by_file
    assert fleet_json(capsys, directory / "rank-{device_uuid}.sqlite")[1] == by_file


def test_a_rank_one_version_behind_fails_naming_it_and_exits_5(engine, capsys):
    for rank in range(RANKS):
        if rank != 5:
            engine.commit(rank)
    code, report = fleet_json(capsys, *engine.paths)
    assert code == exit_codes.INCONSISTENT
    verdict = report["verdict"]
    assert verdict["outcome"] == "fail"
    assert verdict["reason"] == (
        f"the ledgers disagree: ranks 0-4,6-15 at version 4 (digest "
        f"{engine.records[0].digest[:12]}), rank 5 at version 3 (digest "
        f"{engine.records[5].digest[:12]})"
    )
    assert verdict["engine_reason"].startswith(
        "the weight cache daemons disagree on the expert layout: "
    )


def test_the_verdict_is_the_one_the_engines_own_decide_reaches(engine):
    engine.restart(9)
    report = collect_fleet(engine.paths)
    decision = decide([row.finding for row in report.ledgers])
    assert report.verdict.engine_reason == decision.reason
    assert [row.finding.kind for row in report.ledgers].count(FindingKind.RECORD) == RANKS


def test_a_restarted_rank_at_version_0_fails_saying_its_daemon_restarted(engine, capsys):
    engine.restart(9)
    code, report = fleet_json(capsys, *engine.paths)
    assert code == exit_codes.INCONSISTENT
    assert report["ledgers"][9]["incarnation_id"] == 2
    assert report["ledgers"][9]["version"] == 0
    assert report["verdict"]["reason"].endswith(
        f"rank 9 at version 0 (digest {engine.records[9].digest[:12]}, its daemon restarted)"
    )


def test_a_dirty_rank_fails_naming_it_and_exits_3(engine, capsys):
    engine.leave_mid_move(12)
    code, report = fleet_json(capsys, *engine.paths)
    assert code == exit_codes.DIRTY
    assert report["ledgers"][12]["state"] == "dirty"
    assert report["verdict"]["reason"].startswith(
        "rank 12 dirty: engine 'engine-a' detached while its move of layers [2, 3] from "
        "version 3 was pending"
    )


def test_a_pending_move_fails_as_an_engine_that_waited_would_and_exits_4(engine, capsys):
    engine.begin(7)
    code, report = fleet_json(capsys, *engine.paths)
    assert code == exit_codes.PENDING_OR_REFUSALS
    row = report["ledgers"][7]
    assert (row["state"], row["finding"]) == ("pending", "stuck")
    assert row["pending"]["engine_id"] == "engine-a" and row["pending"]["since"]
    assert report["verdict"]["reason"].startswith(
        "rank 7 pending: engine 'engine-a' began a move of layers [2, 3] from version 3; "
    )
    assert "an engine starting now waits for it" in report["verdict"]["engine_reason"]


def test_an_unreadable_ledger_fails_naming_it_and_exits_2(engine, tmp_path, capsys):
    broken = tmp_path / "not-a-ledger.sqlite"
    broken.write_text("hello")
    code, out, err = run_cli(capsys, "fleet", *map(str, engine.paths), str(broken), "--json")
    assert code == exit_codes.UNUSABLE
    assert err == (
        f"layout-ledger fleet: error: cannot read ledger {broken}: {broken} is not an SQLite "
        "database\n"
    )
    report = json.loads(out)
    row = report["ledgers"][RANKS]
    assert (row["rank"], row["state"], row["finding"]) == (RANKS, "unreadable", "unreadable")
    assert row["problem"] in report["verdict"]["reason"]


def test_the_exit_code_follows_dirty_then_pending_then_disagreement_then_unusable(
    engine, tmp_path, capsys
):
    broken = tmp_path / "broken.sqlite"
    broken.write_text("hello")
    paths = [*engine.paths, broken]
    engine.commit(3)  # rank 3 ahead: the ledgers disagree
    assert fleet_json(capsys, *paths)[0] == exit_codes.INCONSISTENT
    engine.begin(4)
    assert fleet_json(capsys, *paths)[0] == exit_codes.PENDING_OR_REFUSALS
    engine.leave_mid_move(5)
    code, report = fleet_json(capsys, *paths)
    assert code == exit_codes.DIRTY
    reason = report["verdict"]["reason"]
    assert reason.index("rank 5 dirty") < reason.index("rank 4 pending")
    assert reason.index("rank 4 pending") < reason.index("rank 16 unreadable")
    assert reason.index("rank 16 unreadable") < reason.index("the ledgers disagree")


def test_the_human_table_has_one_row_per_ledger_and_a_summary_not_every_rank(engine, capsys):
    for rank in (1, 2):
        engine.leave_mid_move(rank)
    code, out, _ = run_cli(capsys, "fleet", *map(str, engine.paths))
    assert code == exit_codes.DIRTY
    lines = out.splitlines()
    assert lines[0].split() == [
        "rank",
        "host",
        "gpu",
        "device",
        "tp",
        "pp",
        "ep",
        "daemon",
        "inc",
        "version",
        "digest",
        "state",
        "ledger",
    ]
    digest = engine.records[0].digest[:12]
    assert lines[1].split() == [
        "0",
        this_host(),
        "0",
        "GPU-0000",
        "0",
        "0",
        "0",
        "running",
        "1",
        "3",
        digest,
        "clean",
        str(engine.paths[0]),
    ]
    assert lines[2].split()[-2] == "dirty"
    assert len(lines) == 1 + RANKS + 4
    assert lines[-4:-2] == ["", "verdict: fail"]
    assert lines[-2].startswith("  ranks 1-2 dirty: engine 'engine-a' detached")
    assert lines[-2].endswith(f"; ranks 0,3-15 at version 3 (digest {digest})")
    assert lines[-1] == "  moves: no engine may move: a daemon is dirty (see the verdict)"


def test_fleet_verify_runs_verify_on_every_ledger_one_line_each(engine, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "fleet", "--verify", *map(str, engine.paths[:2]))
    assert code == exit_codes.OK
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{engine.paths[0]}: ok: ") and " events chained, head " in lines[0]
    broken = tmp_path / "broken.sqlite"
    broken.write_text("hello")
    code, out, _ = run_cli(capsys, "fleet", "--verify", str(engine.paths[0]), str(broken), "--json")
    assert code == exit_codes.UNUSABLE
    rows = json.loads(out)["ledgers"]
    assert [(row["path"], row["ok"]) for row in rows] == [
        (str(engine.paths[0]), True),
        (str(broken), None),
    ]


def test_a_path_that_names_no_ledger_is_unusable(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, "fleet", str(tmp_path / "empty"))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err == (
        f"layout-ledger fleet: error: {tmp_path / 'empty'} is not a regular file, and the "
        "directory holds no ledger (no SQLite file in it); name a ledger file or the directory "
        "the daemons write their ledgers into\n"
    )
    template = tmp_path / "ledger_{device_uuid}.sqlite"
    code, _, err = run_cli(capsys, "fleet", str(template))
    assert code == exit_codes.UNUSABLE
    assert err == (
        f"layout-ledger fleet: error: no ledger file matches the template {template}; give the "
        "template the daemons were given (--expert-layout-ledger), or no PATH for the default "
        "location\n"
    )


# --- real daemons ---------------------------------------------------------------------------


def _daemons(directory: Path, only: int | None = None):
    """Model-less daemons for ranks 0 and 1 (or only rank ``only``), each its own ledger."""
    started = [
        start_daemon(
            directory,
            f"daemon{rank}",
            extra=["--tp-rank", str(rank), "--ep-rank", str(rank), "--device-uuid", f"cpu-{rank}"],
        )
        for rank in ((0, 1) if only is None else (only,))
    ]
    return started if only is None else started[0]


def test_two_real_daemons_adopt_then_a_sigkilled_one_fails_and_its_restart_disagrees(
    tmp_path, capsys
):
    daemons = _daemons(tmp_path)
    engine = [EngineStandIn.start(d.socket_path, "engine-a") for d in daemons]
    paths = [d.ledger_path for d in daemons]
    row = [(slot + 1) % 8 for slot in range(10)]
    try:
        for stand_in in engine:
            assert stand_in.begin(0, [0]).ok and stand_in.commit({0: row}).ok
        code, report = fleet_json(capsys, *paths)
        assert code == exit_codes.OK
        assert report["verdict"]["outcome"] == "adopt"
        assert report["verdict"]["version"] == 1
        assert [(r["rank"], r["alive"], r["pid"]) for r in report["ledgers"]] == [
            (0, True, daemons[0].pid),
            (1, True, daemons[1].pid),
        ]
        daemons[1].kill()  # SIGKILL
        code, report = fleet_json(capsys, *paths)
        assert code == exit_codes.INCONSISTENT
        assert report["ledgers"][1]["alive"] is False
        assert report["verdict"]["reason"] == (
            "rank 1 not running (no clean end recorded); rank 0 at version 1 "
            f"(digest {report['ledgers'][0]['digest'][:12]})"
        )
        daemons[1] = _daemons(tmp_path, only=1)
        code, report = fleet_json(capsys, *paths)
        assert code == exit_codes.INCONSISTENT
        assert report["verdict"]["reason"].endswith(
            "rank 1 at version 0 (digest "
            f"{report['ledgers'][1]['digest'][:12]}, its daemon restarted)"
        )
    finally:
        for stand_in in engine:
            stand_in.kill()
        for daemon in daemons:
            daemon.kill()


def test_two_real_daemons_with_a_pending_move_exit_4_and_dirty_after_the_engine_dies_exit_3(
    tmp_path, capsys
):
    daemons = _daemons(tmp_path)
    paths = [d.ledger_path for d in daemons]
    engine = [EngineStandIn.start(d.socket_path, "engine-a") for d in daemons]
    try:
        for stand_in in engine:
            assert stand_in.begin(0, [0, 1]).ok
        code, report = fleet_json(capsys, *paths)
        assert code == exit_codes.PENDING_OR_REFUSALS
        assert report["verdict"]["reason"].startswith(
            "ranks 0-1 pending: engine 'engine-a' began a move of layers [0, 1] from version 0"
        )
        for stand_in in engine:
            stand_in.kill()  # the engine dies mid-move: the daemons mark themselves dirty
        deadline = time.monotonic() + 30
        while True:  # each daemon sees its attach connection's EOF on its own thread
            code, report = fleet_json(capsys, *paths)
            dirty = [row["state"] == "dirty" for row in report["ledgers"]]
            if all(dirty) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert code == exit_codes.DIRTY
        assert report["verdict"]["reason"].startswith("ranks 0-1 dirty: engine 'engine-a'")
    finally:
        for daemon in daemons:
            daemon.kill()


def test_text_a_ledger_holds_never_drives_the_terminal_in_fleet_or_metrics(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "UPDATE incarnations SET host = 'node' || char(27) || ']0;owned' || char(7)")
    code, out, _ = run_cli(capsys, "fleet", str(path))
    assert code == exit_codes.NOT_RUNNING  # the only daemon was killed
    assert "\x1b" not in out and "\x07" not in out
    assert "node\\x1b]0;owned\\x07" in out.splitlines()[1]
    assert json.loads(run_cli(capsys, "fleet", str(path), "--json")[1])["ledgers"][0]["host"] == (
        "node\x1b]0;owned\x07"
    )
    _, out, _ = run_cli(capsys, "metrics", str(path))
    assert "\x1b" not in out and 'host="node\\\\x1b]0;owned\\\\x07"' in out
