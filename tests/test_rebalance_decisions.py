"""The rebalance hook's decisions: pure functions of what every rank all-gathered."""

from __future__ import annotations

import socket

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.core.startup_verdict import FindingKind
from layout_ledger.wire import protocol
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import client
from sglang_integration.engine.rebalance import rank_status
from sglang_integration.engine.rebalance_decisions import (
    REASON_ELASTIC_EP,
    REASON_MIXED_SOURCES,
    REASON_NO_RECORD,
    REASON_NOT_ATTACHED,
    REASON_OLDER_DAEMON,
    REASON_UNKNOWN_SOURCE,
    REASON_VERSIONS_DIFFER,
    BeginAction,
    Mode,
    RankLayoutStatus,
    WeightSource,
    check_commits,
    decide_begin,
    decide_mode,
)
from sglang_integration.engine.startup import EngineLayoutSession

WEIGHTS_FROM_DAEMON = WeightSource.DAEMON
WEIGHTS_FROM_DISK = WeightSource.DISK
# A rank's standing with its daemon: what startup found there, and whether it is attached.
ATTACHED = (FindingKind.RECORD, True)
NOT_ATTACHED = (None, False)
OLDER_DAEMON = (FindingKind.OLDER_DAEMON, False)
NO_RECORD = (FindingKind.NO_RECORD, False)

DAEMON_AT_3 = RankLayoutStatus(WEIGHTS_FROM_DAEMON, *ATTACHED, 3)
DISK = RankLayoutStatus(WEIGHTS_FROM_DISK, *NOT_ATTACHED)


def _only(reasons: tuple[str, ...], prefix: str) -> str:
    matching = [reason for reason in reasons if reason.startswith(prefix)]
    assert len(matching) == 1, reasons
    return matching[0]


# ------------------------------------------------------------------ decide_mode -------------


def test_weights_from_disk_on_every_rank_rebalance_as_before() -> None:
    assert decide_mode([DISK, DISK], elastic_ep=False).mode is Mode.ORIGINAL
    # Elastic EP with weights from disk is sglang's business, unchanged.
    assert decide_mode([DISK, DISK], elastic_ep=True).mode is Mode.ORIGINAL


def test_daemon_weights_on_every_attached_rank_move_in_two_phases_from_their_version() -> None:
    decision = decide_mode([DAEMON_AT_3, DAEMON_AT_3], elastic_ep=False)
    assert decision.mode is Mode.TWO_PHASE
    assert decision.version == 3
    assert decision.reasons == ()


def test_ranks_mixing_disk_and_daemon_weights_stay_off_naming_the_disk_ranks() -> None:
    decision = decide_mode([DAEMON_AT_3, DISK], elastic_ep=False)
    assert decision.mode is Mode.OFF
    assert _only(decision.reasons, REASON_MIXED_SOURCES).endswith("(rank 1)")


@pytest.mark.parametrize(
    ("attach", "reason"),
    [
        (OLDER_DAEMON, REASON_OLDER_DAEMON),
        (NO_RECORD, REASON_NO_RECORD),
        (NOT_ATTACHED, REASON_NOT_ATTACHED),
    ],
)
def test_a_daemon_without_a_record_or_an_engine_that_did_not_attach_stays_off(
    attach: tuple[FindingKind | None, bool], reason: str
) -> None:
    other = RankLayoutStatus(WEIGHTS_FROM_DAEMON, *attach)
    decision = decide_mode([DAEMON_AT_3, other], elastic_ep=False)
    assert decision.mode is Mode.OFF
    assert _only(decision.reasons, reason).endswith("(rank 1)")


def test_elastic_ep_with_daemon_weights_stays_off() -> None:
    decision = decide_mode([DAEMON_AT_3, DAEMON_AT_3], elastic_ep=True)
    assert decision.mode is Mode.OFF
    assert decision.reasons == (REASON_ELASTIC_EP,)


def test_each_reason_is_reported_once_with_every_rank_it_applies_to() -> None:
    statuses = [
        RankLayoutStatus(WEIGHTS_FROM_DAEMON, *OLDER_DAEMON),
        DISK,
        RankLayoutStatus(WEIGHTS_FROM_DAEMON, *OLDER_DAEMON),
        RankLayoutStatus(None, *NOT_ATTACHED),
    ]
    decision = decide_mode(statuses, elastic_ep=True)
    assert decision.mode is Mode.OFF
    assert len(decision.reasons) == len(set(decision.reasons)) == 4
    assert _only(decision.reasons, REASON_OLDER_DAEMON).endswith("(rank 0, 2)")
    assert _only(decision.reasons, REASON_UNKNOWN_SOURCE).endswith("(rank 3)")
    assert _only(decision.reasons, REASON_MIXED_SOURCES).endswith("(rank 1)")
    assert REASON_ELASTIC_EP in decision.reasons


def test_an_attached_rank_without_a_version_counts_as_not_attached() -> None:
    decision = decide_mode(
        [DAEMON_AT_3, RankLayoutStatus(WEIGHTS_FROM_DAEMON, *ATTACHED, None)], elastic_ep=False
    )
    assert decision.mode is Mode.OFF
    assert _only(decision.reasons, REASON_NOT_ATTACHED).endswith("(rank 1)")


def test_daemons_at_different_versions_stay_off() -> None:
    decision = decide_mode(
        [DAEMON_AT_3, RankLayoutStatus(WEIGHTS_FROM_DAEMON, *ATTACHED, 4)], elastic_ep=False
    )
    assert decision.mode is Mode.OFF
    assert _only(decision.reasons, REASON_VERSIONS_DIFFER)


# ------------------------------------------------------------------ decide_begin ------------

OK = Reply(Outcome.OK)
BUSY = Reply(Outcome.BUSY, "another engine is attached")
REFUSED = Reply(Outcome.REFUSED, "base_version 2 is not the current version 3")


def test_every_daemon_agreeing_moves() -> None:
    assert decide_begin([OK, OK]).action is BeginAction.MOVE


def test_one_busy_daemon_skips_this_rebalance_on_every_rank() -> None:
    decision = decide_begin([OK, BUSY])
    assert decision.action is BeginAction.SKIP
    assert decision.reason == "rank 1: another engine is attached"


def test_a_refusal_disables_for_good_even_when_another_daemon_is_busy() -> None:
    decision = decide_begin([BUSY, REFUSED])
    assert decision.action is BeginAction.DISABLE
    assert decision.reason == "rank 1: refused: base_version 2 is not the current version 3"


@pytest.mark.parametrize(
    "reply",
    [
        Reply(Outcome.UNREACHABLE, "connection refused"),
        Reply(Outcome.ERROR, "request failed"),
        Reply(Outcome.OLDER_DAEMON, "Unknown request type"),
        Reply.from_wire({"reason": "no status"}, request_type=protocol.BEGIN, peer="d.sock"),
        Reply.from_wire("not a dict", request_type=protocol.BEGIN, peer="d.sock"),
    ],
)
def test_a_reply_that_is_neither_ok_nor_busy_counts_as_a_refusal(reply: Reply) -> None:
    assert decide_begin([OK, reply]).action is BeginAction.DISABLE


# ------------------------------------------------------------------ check_commits -----------

MAP = trivial_map(8, 12, 8)
DIGEST = layout_digest(MAP)


def _committed(version: int, digest: str = DIGEST) -> Reply:
    return Reply(Outcome.OK, None, {"version": version, "digest": digest})


def test_commits_at_the_next_version_with_the_engines_digest_pass() -> None:
    check = check_commits([_committed(4), _committed(4)], base_version=3, engine_digest=DIGEST)
    assert check.ok
    assert check.version == 4


def test_a_daemon_digest_other_than_the_engines_own_fails_the_check() -> None:
    wrong = layout_digest(trivial_map(8, 12, 7))
    check = check_commits(
        [_committed(4), _committed(4, wrong)], base_version=3, engine_digest=DIGEST
    )
    assert not check.ok
    assert check.problems == (
        f"rank 1: daemon digest {wrong!r} differs from the engine's {DIGEST}",
    )


def test_daemons_recording_different_or_unexpected_versions_fail_the_check() -> None:
    check = check_commits([_committed(4), _committed(5)], base_version=3, engine_digest=DIGEST)
    assert not check.ok
    assert "rank 1: daemon recorded version 5, expected 4" in check.problems
    assert "daemons recorded different versions [4, 5]" in check.problems


def test_a_refused_commit_fails_the_check() -> None:
    refused = Reply(Outcome.REFUSED, "layers differ from the pending move")
    check = check_commits([_committed(4), refused], base_version=3, engine_digest=DIGEST)
    assert not check.ok
    assert check.problems == ("rank 1: commit refused: layers differ from the pending move",)


# ------------------------------------------------------------------ rank status -------------


def _session(finding: FindingKind, attachment: client.Attachment | None) -> EngineLayoutSession:
    return EngineLayoutSession(
        engine_id="engine-a",
        rank=0,
        socket_path="/nonexistent/daemon.sock",
        finding=finding,
        attachment=attachment,
        version=7,
        digest=DIGEST,
    )


def test_rank_status_reads_the_startup_session() -> None:
    closed = client.Attachment("/nonexistent", "engine-a", Reply(Outcome.OK), None)
    ours, theirs = socket.socketpair()
    attached = client.Attachment("/nonexistent", "engine-a", Reply(Outcome.OK), ours)
    try:
        assert rank_status(WEIGHTS_FROM_DAEMON, _session(FindingKind.RECORD, attached)) == (
            RankLayoutStatus(WEIGHTS_FROM_DAEMON, *ATTACHED, 7)
        )
    finally:
        attached.close()
        theirs.close()
    assert rank_status(WEIGHTS_FROM_DAEMON, None) == RankLayoutStatus(
        WEIGHTS_FROM_DAEMON, *NOT_ATTACHED
    )
    assert _standing(
        rank_status(WEIGHTS_FROM_DAEMON, _session(FindingKind.OLDER_DAEMON, None))
    ) == (OLDER_DAEMON)
    assert _standing(rank_status(WEIGHTS_FROM_DAEMON, _session(FindingKind.NO_RECORD, None))) == (
        NO_RECORD
    )
    # A record whose attach connection is closed is not an attachment.
    assert not rank_status(WEIGHTS_FROM_DAEMON, _session(FindingKind.RECORD, closed)).on_record


def _standing(status: RankLayoutStatus) -> tuple[FindingKind | None, bool]:
    return status.finding, status.attached


def test_a_commit_reply_summary_keeps_the_version_and_digest() -> None:
    reply = Reply(
        Outcome.OK, None, {"status": "ok", "version": 4, "digest": DIGEST, "big": [1] * 9}
    )
    assert reply.trimmed() == Reply(Outcome.OK, None, {"version": 4, "digest": DIGEST})
    busy = Reply(Outcome.BUSY, "another engine is attached", {"status": "busy"})
    assert busy.trimmed() == Reply(Outcome.BUSY, "another engine is attached")
