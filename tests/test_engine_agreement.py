"""startup_verdict.decide: one decision from every rank's finding (docs/design.md "The engine
side")."""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.core.startup_verdict import (
    AdoptLayout,
    FailStartup,
    FindingKind,
    KeepInitialLayout,
    RankFinding,
    decide,
)

INITIAL = trivial_map(3, 10, 8)
INITIAL_DIGEST = layout_digest(INITIAL)
MOVED = [[1, 0, *row[2:]] for row in INITIAL]
MOVED_DIGEST = layout_digest(MOVED)


def record(rank: int, version: int = 0, the_map: list[list[int]] = INITIAL) -> RankFinding:
    return RankFinding(
        rank=rank,
        kind=FindingKind.RECORD,
        socket_path=f"/run/d{rank}.sock",
        initial_digest=INITIAL_DIGEST,
        version=version,
        digest=layout_digest(the_map),
        physical_to_logical_map=the_map,
    )


def other(rank: int, kind: FindingKind, reason: str | None = None) -> RankFinding:
    return RankFinding(
        rank=rank,
        kind=kind,
        socket_path=f"/run/d{rank}.sock",
        initial_digest=INITIAL_DIGEST,
        reason=reason,
    )


def test_all_daemons_at_one_version_and_digest_adopt_that_map() -> None:
    decision = decide([record(0, 3, MOVED), record(1, 3, MOVED)])
    assert decision == AdoptLayout(version=3, digest=MOVED_DIGEST, physical_to_logical_map=MOVED)


def test_all_daemons_at_version_zero_adopt_their_map() -> None:
    assert decide([record(0), record(1)]) == AdoptLayout(0, INITIAL_DIGEST, INITIAL)


def test_daemons_at_different_versions_fail_naming_each_rank_and_version() -> None:
    decision = decide([record(0, 3, MOVED), record(1, 2, INITIAL)])
    assert isinstance(decision, FailStartup)
    assert "disagree" in decision.reason
    assert "rank 0 (daemon /run/d0.sock) at version 3" in decision.reason
    assert "rank 1 (daemon /run/d1.sock) at version 2" in decision.reason
    assert "Restart the weight cache daemons" in decision.reason


def test_daemons_at_one_version_with_different_digests_fail() -> None:
    decision = decide([record(0, 2, MOVED), record(1, 2, INITIAL)])
    assert isinstance(decision, FailStartup)
    assert MOVED_DIGEST[:12] in decision.reason and INITIAL_DIGEST[:12] in decision.reason


DIRTY_REASON = (
    "engine 'engine-a' detached while its move of layers [4, 5] from version 7 was pending"
)


def test_a_dirty_daemon_fails_with_its_engine_layers_and_base_version() -> None:
    decision = decide([record(0, 7, MOVED), other(1, FindingKind.DIRTY, DIRTY_REASON)])
    assert isinstance(decision, FailStartup)
    assert "rank 1 (daemon /run/d1.sock): dirty: " + DIRTY_REASON in decision.reason
    assert "Restart the weight cache daemons" in decision.reason


def test_a_stuck_move_fails_naming_the_moving_engine_and_layers() -> None:
    stuck = "engine 'engine-b' began a move of layers [0, 2] from version 1, still pending"
    decision = decide([record(0, 1), other(1, FindingKind.STUCK, stuck)])
    assert isinstance(decision, FailStartup)
    assert stuck in decision.reason
    assert "Stop that engine" in decision.reason


def test_a_rank_that_could_not_read_its_daemon_fails_all() -> None:
    decision = decide(
        [record(0), other(1, FindingKind.UNREADABLE, "ConnectionRefusedError: refused")]
    )
    assert isinstance(decision, FailStartup)
    assert "rank 1 (daemon /run/d1.sock): unreadable: ConnectionRefusedError" in decision.reason


@pytest.mark.parametrize(
    "kind", [FindingKind.NO_RECORD, FindingKind.OLDER_DAEMON, FindingKind.NO_DAEMON]
)
def test_daemons_without_record_beside_unmoved_recording_daemons_keep_the_initial_layout(
    kind: FindingKind,
) -> None:
    decision = decide([record(0, 0), other(1, kind)])
    assert decision == KeepInitialLayout(without_record=(other(1, kind),), recording_ranks=(0,))


@pytest.mark.parametrize(
    "kind", [FindingKind.NO_RECORD, FindingKind.OLDER_DAEMON, FindingKind.NO_DAEMON]
)
def test_daemons_without_record_beside_a_daemon_that_moved_experts_fail(
    kind: FindingKind,
) -> None:
    decision = decide([record(0, 1, MOVED), other(1, kind)])
    assert isinstance(decision, FailStartup)
    assert "rank 0 (daemon /run/d0.sock) at version 1" in decision.reason
    assert f"rank 1 (daemon /run/d1.sock): {kind.value}" in decision.reason


@pytest.mark.parametrize("version", [1, 4])
def test_a_daemon_whose_moves_came_back_to_the_initial_layout_still_counts_as_moved(
    version: int,
) -> None:
    # Version > 0 is the rule ("fails otherwise"), not a map compare: one move counts too.
    decision = decide([record(0, version, INITIAL), other(1, FindingKind.OLDER_DAEMON)])
    assert isinstance(decision, FailStartup)
    assert f"rank 0 (daemon /run/d0.sock) at version {version}" in decision.reason
    assert "while others have moved experts" in decision.reason


def test_daemons_without_record_beside_a_version_zero_daemon_with_another_layout_fail() -> None:
    decision = decide([record(0, 0, MOVED), other(1, FindingKind.NO_RECORD)])
    assert isinstance(decision, FailStartup)
    assert "--init-expert-location" in decision.reason


def test_no_daemon_keeping_a_record_keeps_the_initial_layout() -> None:
    findings = [other(0, FindingKind.OLDER_DAEMON), other(1, FindingKind.NO_DAEMON)]
    assert decide(findings) == KeepInitialLayout(tuple(findings), ())


def test_dirty_wins_over_disagreement_and_missing_records() -> None:
    decision = decide(
        [
            record(0, 2, MOVED),
            record(1, 1),
            other(2, FindingKind.NO_RECORD),
            other(3, FindingKind.DIRTY, DIRTY_REASON),
        ]
    )
    assert isinstance(decision, FailStartup)
    assert "dirty" in decision.reason and DIRTY_REASON in decision.reason


def test_decide_rejects_no_findings_and_duplicate_ranks() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        decide([])
    with pytest.raises(ValueError, match="exactly one finding"):
        decide([record(0), record(0)])


def test_a_record_finding_without_its_map_is_a_caller_bug() -> None:
    broken = RankFinding(0, FindingKind.RECORD, "/run/d0.sock", INITIAL_DIGEST, version=0)
    with pytest.raises(ValueError, match="needs version, digest and map"):
        decide([broken])


# --- every two-rank combination, against the rules written as a table ----------------------

FAILED = {FindingKind.DIRTY, FindingKind.STUCK, FindingKind.UNREADABLE}
WITHOUT = {FindingKind.NO_RECORD, FindingKind.OLDER_DAEMON, FindingKind.NO_DAEMON}
VARIANTS = [
    ("record v0", lambda r: record(r, 0)),
    ("record v2", lambda r: record(r, 2, MOVED)),
    ("record v0 other map", lambda r: record(r, 0, MOVED)),
    ("record v4 initial map", lambda r: record(r, 4, INITIAL)),
    *[
        (kind.value, functools.partial(lambda k, r: other(r, k, "why"), kind))
        for kind in FindingKind
        if kind is not FindingKind.RECORD
    ],
]


def expected(a: str, b: str) -> type:
    pair = {a, b}
    if pair & {k.value for k in FAILED}:
        return FailStartup
    records = [name for name in (a, b) if name.startswith("record")]
    without = [name for name in (a, b) if not name.startswith("record")]
    if len(set(records)) > 1:
        return FailStartup  # two different records disagree (version or digest)
    if not without:
        return AdoptLayout
    if any(r != "record v0" for r in records):
        return FailStartup  # moved, or another initial layout, beside a rank without record
    return KeepInitialLayout


@pytest.mark.parametrize(("a", "b"), list(itertools.product([n for n, _ in VARIANTS], repeat=2)))
def test_every_two_rank_combination_follows_the_rules(a: str, b: str) -> None:
    make = dict(VARIANTS)
    decision = decide([make[a](0), make[b](1)])
    assert type(decision) is expected(a, b)


@given(
    st.lists(st.sampled_from([n for n, _ in VARIANTS]), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
)
def test_the_decision_does_not_depend_on_the_order_of_findings(names, rnd) -> None:
    make = dict(VARIANTS)
    findings = [make[name](rank) for rank, name in enumerate(names)]
    shuffled = list(findings)
    rnd.shuffle(shuffled)
    assert decide(shuffled) == decide(findings)


@given(st.lists(st.sampled_from([n for n, _ in VARIANTS]), min_size=1, max_size=6))
def test_any_dirty_stuck_or_unreadable_rank_fails_the_start(names) -> None:
    make = dict(VARIANTS)
    decision = decide([make[name](rank) for rank, name in enumerate(names)])
    if set(names) & {k.value for k in FAILED}:
        assert isinstance(decision, FailStartup)
