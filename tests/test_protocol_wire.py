"""The one wire module: what each side writes is what the other side reads, byte for byte as before.

``layout_ledger.wire.protocol`` defines every shape for both the daemon and the engine; these tests
pin the dicts it writes (the wire protocol does not change with the code that builds it) and read
each daemon reply back the way the engine does.
"""

from __future__ import annotations

import pytest

from layout_ledger.core.layout import Geometry, layout_digest, trivial_map
from layout_ledger.core.state import DirtyMark, LayoutState, PendingMove, RestoredFrom
from layout_ledger.wire import protocol
from layout_ledger.wire.protocol import Committed, LayoutView, Outcome, Reply

MAP = trivial_map(2, 4, 3)
DIGEST = layout_digest(MAP)
MOVE = PendingMove("engine-b", (0, 1), 2, since="2026-01-01T00:00:00.000000+00:00")


def _state(**fields: object) -> LayoutState:
    base: dict[str, object] = {
        "incarnation_id": 1,
        "geometry": Geometry(2, 4, 3),
        "version": 2,
        "digest": DIGEST,
        "physical_to_logical_map": MAP,
        "pending": MOVE,
        "attached": ("engine-b",),
    }
    base.update(fields)
    return LayoutState(**base)  # type: ignore[arg-type]


def test_the_layout_state_on_the_wire_has_exactly_the_protocol_fields() -> None:
    assert LayoutView.of(_state()).to_wire() == {
        "version": 2,
        "digest": DIGEST,
        "physical_to_logical_map": MAP,
        "dirty": False,
        "dirty_reason": None,
        "pending": {"engine_id": "engine-b", "layers": [0, 1], "base_version": 2},
        "attached": ["engine-b"],
        "non_following_fetch": False,
        "standbys": [],
        "leases": [],
        "restored_from": None,
    }


def test_a_restored_state_carries_incarnation_version_and_digest_and_reads_back() -> None:
    restored = RestoredFrom(3, 2, DIGEST, source="rank 1's ledger /x.sqlite")
    wire = LayoutView.of(_state(restored_from=restored)).to_wire()
    assert wire["restored_from"] == {"incarnation": 3, "version": 2, "digest": DIGEST}
    assert LayoutView.from_wire(wire).restored_from == RestoredFrom(3, 2, DIGEST)
    older = {key: value for key, value in wire.items() if key != "restored_from"}
    assert LayoutView.from_wire(older).restored_from is None  # a daemon from before restores


@pytest.mark.parametrize(
    "bad",
    [
        [3, 2, DIGEST],
        {"incarnation": 0, "version": 2, "digest": DIGEST},
        {"incarnation": 3, "version": -1, "digest": DIGEST},
        {"incarnation": 3, "version": True, "digest": DIGEST},
        {"incarnation": 3, "version": 2, "digest": DIGEST.upper()},
    ],
)
def test_a_restored_from_of_another_shape_is_a_protocol_violation(bad: object) -> None:
    wire = {**LayoutView.of(_state()).to_wire(), "restored_from": bad}
    with pytest.raises(protocol.ProtocolViolation, match="restored_from"):
        LayoutView.from_wire(wire)


def test_a_dirty_state_carries_the_dirty_reason_and_never_the_begin_time() -> None:
    state = _state(pending=None, dirty=DirtyMark(MOVE, at="2026-01-01T00:00:01.000000+00:00"))
    wire = LayoutView.of(state).to_wire()
    assert wire["dirty"] is True
    assert wire["dirty_reason"] == DirtyMark(MOVE, at="x").reason
    assert MOVE.since is not None and MOVE.since not in repr(wire)


def test_the_layout_the_daemon_writes_is_the_layout_the_engine_reads() -> None:
    wire = protocol.layout_reply(LayoutView.of(_state()))
    assert wire["status"] == protocol.OK
    for request_type in (protocol.ATTACH, protocol.QUERY):
        reply = Reply.from_wire(wire, request_type=request_type, peer="d.sock")
        assert reply.outcome is Outcome.OK
        assert reply.layout is not None
        assert reply.layout.to_wire() == wire["layout"]
        assert reply.layout.pending == PendingMove("engine-b", (0, 1), 2)
    assert (
        LayoutView.from_wire(wire["layout"])
        == Reply.from_wire(wire, request_type=protocol.QUERY, peer="d.sock").layout
    )


def test_requests_are_the_dicts_the_daemon_has_always_read() -> None:
    assert protocol.AttachRequest("e").to_wire() == {
        "type": "expert_layout_attach",
        "engine_id": "e",
    }
    assert protocol.QueryRequest().to_wire() == {"type": "expert_layout_query"}
    assert protocol.BeginRequest("e", 3, (2, 1)).to_wire() == {
        "type": "expert_layout_begin",
        "engine_id": "e",
        "base_version": 3,
        "layers": [2, 1],
    }
    assert protocol.CommitRequest("e", {1: (0, 2, 1, 0)}).to_wire() == {
        "type": "expert_layout_commit",
        "engine_id": "e",
        "rows": {1: [0, 2, 1, 0]},
    }
    assert protocol.AbortRequest("e").to_wire() == {"type": "expert_layout_abort", "engine_id": "e"}
    assert protocol.FetchLayout(None, 0, DIGEST).to_wire() == {
        "engine_id": None,
        "version": 0,
        "digest": DIGEST,
    }


def test_a_commit_reply_reads_back_with_its_version_and_digest_and_trims_to_them() -> None:
    wire = Committed(3, DIGEST).to_wire()
    assert wire == {"status": "ok", "version": 3, "digest": DIGEST}
    reply = Reply.from_wire(wire, request_type=protocol.COMMIT, peer="d.sock")
    assert reply.ok
    assert reply.trimmed() == Reply(Outcome.OK, None, {"version": 3, "digest": DIGEST})


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (protocol.BUSY, Outcome.BUSY),
        (protocol.REFUSED, Outcome.REFUSED),
        (protocol.NO_RECORD, Outcome.NO_RECORD),
        (protocol.ERROR, Outcome.ERROR),
    ],
)
def test_every_non_ok_reply_carries_its_reason_to_the_engine(status: str, outcome: Outcome) -> None:
    wire = protocol.refusal_reply(status, "what to do")
    assert wire == {"status": status, "reason": "what to do"}
    reply = Reply.from_wire(wire, request_type=protocol.BEGIN, peer="d.sock")
    assert reply.outcome is outcome
    assert reply.reason is not None and "what to do" in reply.reason


def test_a_refusal_needs_a_non_ok_status() -> None:
    with pytest.raises(ValueError, match="not a non-ok status"):
        protocol.refusal_reply(protocol.OK, "fine")
    with pytest.raises(ValueError, match="not a non-ok status"):
        protocol.refusal_reply("maybe", "?")
