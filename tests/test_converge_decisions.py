"""The convergence plan: clean daemons at different layouts, brought to the newest one.

Pure functions of what every rank all-gathered; the engine that applies them is tested in
``test_engine_converge.py``. The geometry: 2 ranks of 2 local slots, 3 logical experts.
"""

from __future__ import annotations

import pytest

from layout_ledger.core.layout import Map, layout_digest
from layout_ledger.core.startup_verdict import FailStartup, FindingKind, RankFinding
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine.converge_decisions import (
    ConvergePlan,
    Way,
    check_steps,
    held_map,
    needs_convergence,
    plan_convergence,
    why_reload,
)

ENGINE = "engine-b"
LOCAL = 2
INITIAL: Map = [[0, 1, 2, 0], [0, 1, 2, 0]]
# A commit that moved slot 3 of layer 0 (expert 0 -> 1): every expert stays held somewhere.
ONE_SLOT: Map = [[0, 1, 2, 1], [0, 1, 2, 0]]
# A commit that swapped experts between the ranks in layer 0: rank 0 now holds [0, 2], rank
# 1 [1, 1]; with rank 1's daemon still at the initial layout nobody holds expert 1.
SWAPPED: Map = [[0, 2, 1, 1], [0, 1, 2, 0]]


def record(rank: int, version: int, the_map: Map) -> RankFinding:
    return RankFinding(
        rank=rank,
        kind=FindingKind.RECORD,
        socket_path=f"/run/d{rank}.sock",
        initial_digest=layout_digest(INITIAL),
        version=version,
        digest=layout_digest(the_map),
        physical_to_logical_map=[list(row) for row in the_map],
    )


def plan(findings: list[RankFinding], **kwargs: object) -> ConvergePlan:
    attached = kwargs.pop("attached", [(ENGINE,)] * len(findings))
    result = plan_convergence(
        findings,
        attached,  # type: ignore[arg-type]
        engine_id=ENGINE,
        num_local_slots=LOCAL,
        **kwargs,  # type: ignore[arg-type]
    )
    assert isinstance(result, ConvergePlan), result
    return result


def failure(findings: list[RankFinding], **kwargs: object) -> str:
    attached = kwargs.pop("attached", [(ENGINE,)] * len(findings))
    result = plan_convergence(
        findings,
        attached,  # type: ignore[arg-type]
        engine_id=ENGINE,
        num_local_slots=LOCAL,
        **kwargs,  # type: ignore[arg-type]
    )
    assert isinstance(result, FailStartup), result
    return result.reason


def test_needs_convergence_only_for_clean_records_that_differ() -> None:
    assert needs_convergence([record(0, 1, ONE_SLOT), record(1, 0, INITIAL)])
    assert not needs_convergence([record(0, 1, ONE_SLOT), record(1, 1, ONE_SLOT)])
    dirty = RankFinding(1, FindingKind.DIRTY, "/run/d1.sock", "x", reason="an engine left")
    assert not needs_convergence([record(0, 1, ONE_SLOT), dirty])
    assert not needs_convergence([record(0, 1, ONE_SLOT)])


def test_held_map_takes_each_rank_slots_from_its_own_daemon() -> None:
    findings = [record(0, 1, SWAPPED), record(1, 0, INITIAL)]
    assert held_map(findings, LOCAL) == [[0, 2, 2, 0], [0, 1, 2, 0]]


def test_converge_target_is_the_newest_committed_layout() -> None:
    result = plan([record(0, 1, ONE_SLOT), record(1, 0, INITIAL)])
    assert (result.version, result.digest) == (1, layout_digest(ONE_SLOT))
    assert result.physical_to_logical_map == ONE_SLOT
    assert [(s.rank, s.way, s.version, s.layers) for s in result.steps] == [
        (0, Way.STAY, 1, ()),
        (1, Way.MOVE, 0, (0,)),
    ]
    assert result.held_map == INITIAL and result.move_layers == (0,)
    # the newest may be on any rank: the same plan with the ranks swapped
    swapped = plan([record(0, 0, INITIAL), record(1, 1, ONE_SLOT)])
    assert [s.way for s in swapped.steps] == [Way.MOVE, Way.STAY]


def test_converge_move_needs_every_target_expert_held_else_reload() -> None:
    result = plan([record(0, 1, SWAPPED), record(1, 0, INITIAL)])
    assert [s.way for s in result.steps] == [Way.STAY, Way.RELOAD]
    assert why_reload(result, result.step_of(1), LOCAL) == (
        "no daemon's slots hold expert 1 of layer 0, which the target places on it"
    )


def test_converge_gap_of_more_than_one_version_reloads() -> None:
    two_moves = [[0, 1, 2, 1], [0, 1, 2, 2]]
    result = plan([record(0, 2, two_moves), record(1, 0, INITIAL)])
    assert [s.way for s in result.steps] == [Way.STAY, Way.RELOAD]
    assert result.step_of(1).layers == (0, 1)
    assert why_reload(result, result.step_of(1), LOCAL).startswith(
        "a move commits version 1, not 2; only a reload jumps from version 0"
    )


def test_converge_reload_first_counts_for_the_moves() -> None:
    # 3 ranks: rank 2 at version 0 must reload (two versions behind); after it, it holds the
    # target's slots, the only ones with expert 3, which rank 1's move then copies.
    initial = [[0, 1, 2, 3, 0, 1]]
    newest = [[0, 1, 3, 2, 3, 2]]
    one_behind = [[0, 1, 2, 2, 3, 1]]  # its slots hold [2, 2]; the target wants [3, 2]
    findings = [record(0, 2, newest), record(1, 1, one_behind), record(2, 0, initial)]
    assert 3 not in held_map(findings, LOCAL)[0]
    result = plan(findings)
    assert [s.way for s in result.steps] == [Way.STAY, Way.MOVE, Way.RELOAD]


def test_converge_reload_that_takes_away_an_expert_makes_another_reload() -> None:
    # rank 2 reloads (a gap of two); it held expert 1 only, and after the reload nobody holds
    # it, so rank 1, which the target gives expert 1, must reload too.
    newest = [[0, 2, 1, 3, 0, 2]]
    findings = [
        record(0, 2, newest),
        record(1, 1, [[0, 2, 3, 3, 0, 2]]),
        record(2, 0, [[0, 2, 3, 3, 1, 1]]),
    ]
    result = plan(findings)
    assert [s.way for s in result.steps] == [Way.STAY, Way.RELOAD, Way.RELOAD]


def test_converge_one_mover_rule_other_engine_attached_fails() -> None:
    findings = [record(0, 1, ONE_SLOT), record(1, 0, INITIAL)]
    reason = failure(findings, attached=[(ENGINE,), (ENGINE, "engine-a")])
    assert reason == (
        "the weight cache daemons disagree on the expert layout (rank 0 (daemon /run/d0.sock) "
        f"at version 1, digest {layout_digest(ONE_SLOT)[:12]}; rank 1 (daemon /run/d1.sock) at "
        f"version 0, digest {layout_digest(INITIAL)[:12]}), and this engine cannot bring them "
        "to version 1: rank 1 (daemon /run/d1.sock) at version 0, digest "
        f"{layout_digest(INITIAL)[:12]} has other engines attached ('engine-a'). An engine that "
        "is not alone on a daemon never changes it. Stop the other engines, then start this "
        "engine again; or restart the weight cache daemons (they reload the weights from disk)."
    )
    # another engine on the daemon that stays is no reason: nothing changes there
    plan(findings, attached=[(ENGINE, "engine-a"), (ENGINE,)])


def test_converge_same_newest_version_two_maps_fails() -> None:
    other = [[0, 1, 2, 2], [0, 1, 2, 0]]
    reason = failure([record(0, 1, ONE_SLOT), record(1, 1, other)])
    assert reason.startswith(
        "the weight cache daemons disagree on the expert layout, and version 1, the newest, "
        "names different maps on different daemons"
    )


def test_converge_maps_of_another_shape_fail() -> None:
    reason = failure([record(0, 1, ONE_SLOT), record(1, 0, [[0, 1, 2, 0]])])
    assert "their maps have different shapes" in reason and ": (1, 4)" in reason


def test_converge_a_reload_that_did_not_reach_the_target_fails() -> None:
    findings = [record(0, 1, SWAPPED), record(1, 0, INITIAL)]
    reason = failure(findings, reloaded=[1])
    assert reason.startswith("reloading the weight cache daemons of ranks [1] did not bring")


def test_check_steps_wants_the_target_from_every_daemon_of_the_way() -> None:
    result = plan([record(0, 1, ONE_SLOT), record(1, 0, INITIAL)])
    good = Reply(Outcome.OK, None, {"version": 1, "digest": result.digest})
    assert check_steps(result, Way.MOVE, [(0, None), (1, good)]) == []
    behind = Reply(Outcome.OK, None, {"version": 1, "digest": layout_digest(INITIAL)})
    refused = Reply(Outcome.REFUSED, "other engines are attached")
    assert check_steps(result, Way.MOVE, [(0, None), (1, behind)]) == [
        "rank 1 (daemon /run/d1.sock, at version 0): recorded version 1, digest "
        f"{layout_digest(INITIAL)[:12]!r}, not version 1, digest {result.digest[:12]}"
    ]
    assert check_steps(result, Way.MOVE, [(0, None), (1, refused)]) == [
        "rank 1 (daemon /run/d1.sock, at version 0): move refused: other engines are attached"
    ]
    assert check_steps(result, Way.MOVE, [(0, good), (1, None)]) == [
        "rank 1 (daemon /run/d1.sock, at version 0): sent no move"
    ]


def test_plan_convergence_refuses_findings_that_agree() -> None:
    with pytest.raises(ValueError):
        plan_convergence(
            [record(0, 1, ONE_SLOT), record(1, 1, ONE_SLOT)],
            [(ENGINE,), (ENGINE,)],
            engine_id=ENGINE,
            num_local_slots=LOCAL,
        )


def test_converge_a_standby_engine_changes_no_daemon() -> None:
    """A standby never converges daemons: the verdict of before, saying why (no collective)."""
    from sglang_integration.engine.converge import converge_at_startup
    from sglang_integration.engine.startup_repair import StartupRank
    from sglang_integration.settings import ContentCheck

    findings = [record(0, 1, ONE_SLOT), record(1, 0, INITIAL)]
    this = StartupRank(0, "/run/d0.sock", ENGINE, ContentCheck.ENFORCE, INITIAL, (2, 4, 3))
    _, _, verdict = converge_at_startup(
        None, this, findings, [], num_local_slots=LOCAL, standby=True
    )
    assert isinstance(verdict, FailStartup)
    assert verdict.reason.startswith("the weight cache daemons disagree on the expert layout: ")
    assert verdict.reason.endswith(" A standby engine never changes them.")
