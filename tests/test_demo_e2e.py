"""A reduced run of the CPU end-to-end demo (``scripts/demo.py``): the same seven cases and the
forensics, with fewer rebalances, through the same code (``scripts/demo_cases``): real
model-less daemons with ledgers, engines of 2 gloo rank processes running sglang's real startup
method, ``EPLBManager`` and ``ExpertLocationUpdater`` through the plugin's real hooks,
shared-memory experts, SIGKILLs, and the ``layout-ledger`` console script.

Each test names the rule its case protects and fails with the demo's failed checks listed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from demo_cases import (
    CaseResult,
    DemoConfig,
    DemoRun,
    Workspace,
    run_demo,
)

README = Path(__file__).resolve().parents[1] / "docs" / "operations.md"  # the sqlite3 cookbook
CONFIG = DemoConfig(case1_rebalances=2, case2_rebalances=(1, 1, 1), case3_rebalances_before_kill=1)
CHUNKS = CONFIG.chunks_per_rebalance


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[DemoRun, Workspace]]:
    workspace = Workspace(CONFIG)
    try:
        run = run_demo(workspace, README)
    finally:
        workspace.close()
    yield run, workspace


def _case(run: DemoRun, title_start: str) -> CaseResult:
    (case,) = [case for case in run.cases if case.title.startswith(title_start)]
    return case


def _assert_every_check_holds(case: CaseResult) -> None:
    failed = [f"{c.what}: expected {c.expected}, measured {c.measured}" for c in case.failed]
    assert failed == [], f"{case.title}:\n" + "\n".join(failed)
    assert any(check.ok for check in case.checks)


@pytest.mark.timeout(240)
def test_engine_b_restarted_on_the_daemons_adopts_the_ledger_version_and_reads_every_slot_right(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 1: ")
    _assert_every_check_holds(case)
    versions = CONFIG.case1_rebalances * CHUNKS
    assert case.facts["b_versions"] == [versions] * CONFIG.ep_size
    assert case.facts["b_correct"] == CONFIG.all_slots


@pytest.mark.timeout(240)
def test_without_the_plugin_engine_b_reads_the_moved_slots_wrongly(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 1, plugin disabled")
    _assert_every_check_holds(case)
    assert case.facts["wrong"] > CONFIG.all_slots // 2


@pytest.mark.timeout(240)
def test_a_standby_pauses_rebalancing_without_a_move_and_it_resumes_once_the_standby_exits(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 2: ")
    _assert_every_check_holds(case)
    alone, with_standby, after = CONFIG.case2_rebalances
    assert case.facts["paused"] == [with_standby] * CONFIG.ep_size
    assert case.facts["v1"] == alone * CHUNKS
    assert case.facts["v2"] == (alone + after) * CHUNKS


@pytest.mark.timeout(240)
def test_sigkill_between_chunks_keeps_the_committed_version_and_mid_move_refuses_the_next_engine(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 3: ")
    _assert_every_check_holds(case)
    assert case.facts["committed"] == CONFIG.case3_rebalances_before_kill * CHUNKS + 1
    assert case.facts["base"] == CONFIG.case3_rebalances_before_kill * CHUNKS
    assert any("ExpertLayoutStartupError: " in note for note in case.notes)


@pytest.mark.timeout(240)
def test_the_ledger_names_the_engine_that_left_the_daemon_dirty(
    demo: tuple[DemoRun, Workspace],
) -> None:
    run = demo[0]
    case = _case(run, "Forensics")
    _assert_every_check_holds(case)
    assert [command.command.split()[1] for command in run.commands] == [
        "status",
        "history",
        "verify",
    ]
    assert run.query is not None
    sql, _, rows = run.query
    assert sql.startswith("-- forensic: dirty")
    assert len(rows) == 1


@pytest.mark.timeout(240)
def test_the_next_engine_repairs_daemons_left_mid_move_without_a_restart_every_slot_right(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 4: ")
    _assert_every_check_holds(case)
    checks = {check.what: check.measured for check in case.checks}
    assert checks["B: slots holding the expert B's map names"] == f"{CONFIG.all_slots}/96"
    assert checks["daemons not restarted (same processes)"] == "both: yes"


@pytest.mark.timeout(240)
def test_a_half_written_slot_an_unfilled_replica_and_an_empty_only_copy_are_refused(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 4 (b)")
    _assert_every_check_holds(case)
    assert any("holds partial: parts 0-1 of expert" in note for note in case.notes)
    assert any("slot 10 zero-filled" in note for note in case.notes)
    assert any("expert 5 in slot 5 is zero-filled" in note for note in case.notes)


@pytest.mark.timeout(240)
def test_no_process_or_shared_memory_file_outlives_the_demo(
    demo: tuple[DemoRun, Workspace],
) -> None:
    workspace = demo[1]
    assert workspace.processes_alive() == []
    assert not workspace.root.exists()
    assert not workspace.shm_root.exists()


@pytest.mark.timeout(240)
def test_a_standby_without_a_lease_lets_the_active_engine_rebalance_and_takes_over_in_place(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 5: ")
    _assert_every_check_holds(case)
    facts = case.facts
    assert facts["v2"] > facts["v"]  # versions go past V with the standby attached
    checks = {check.what: check.measured for check in case.checks}
    took_over = next(what for what in checks if what.startswith("C's first forward: its lease"))
    assert checks[took_over].endswith(f"; {CONFIG.all_slots}/96")


@pytest.mark.timeout(240)
def test_a_standbys_warmup_pauses_moves_only_until_its_lease_idles_out_and_it_repairs_a_mid_move(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 5 (b)")
    _assert_every_check_holds(case)
    assert len(case.checks) == 6


@pytest.mark.timeout(240)
def test_a_restarted_daemon_keeps_the_balance_and_each_fallback_says_why(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 6: ")
    _assert_every_check_holds(case)
    facts = case.facts
    versions = CONFIG.case6_rebalances * CHUNKS
    assert facts["b_versions"] == [versions] * CONFIG.ep_size
    assert [reason.split(":")[0] for reason in facts["fallbacks"]] == [
        "a ledger cannot be read or its rows do not verify",
        "--expert-layout-restore initial on rank 0",
        "nothing to restore",
    ]


@pytest.mark.timeout(240)
def test_daemons_a_commit_left_at_different_versions_converge_on_the_newest_when_b_starts(
    demo: tuple[DemoRun, Workspace],
) -> None:
    case = _case(demo[0], "Case 7 (b)")
    _assert_every_check_holds(case)
    facts = case.facts
    newest = CONFIG.case7b_rebalances * CHUNKS + 1
    assert facts["versions"] == [newest, newest - 1]
    assert facts["b_versions"] == [newest] * CONFIG.ep_size
    assert facts["stopped"] == [True, None]  # rank 0 committed, rank 1 never sent its commit
    assert facts["way"] == "reload"  # A's chunk gave rank 1 experts only rank 0 held at N
