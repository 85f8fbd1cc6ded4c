"""Rules of the engine's decisions that a plausible bug could break without any other test
noticing; each test names its rule.

- After a commit (or a repair), each daemon's digest must equal the digest of the engine's own
  whole map: the daemons' digests are never trusted, even when they all agree with each other
  (``rebalance_decisions.check_commits``).
- A repair is all daemons or none as far as the engine can make it: the ranks all-gather the
  repair replies, and every rank fails unless every daemon recorded the new version with the
  engine's digest (``startup_repair``), whatever its own daemon answered.

The repair tests run ``startup_repair``'s repair step on two threads, one per rank, whose world
group all-gathers between them (the stand-in for sglang's world group on gloo; the real one is
in tests/test_guarded_rules_processes.py), with each rank's daemon reply scripted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.core.startup_verdict import AdoptLayout, FailStartup
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import startup_repair
from sglang_integration.engine.content_decisions import RepairPlan
from sglang_integration.engine.rebalance_decisions import check_commits
from sglang_integration.settings import ContentCheck

ENGINE_MAP = trivial_map(4, 12, 8)
ENGINE_DIGEST = layout_digest(ENGINE_MAP)
# A map the daemons could all hold if the engine's and theirs parted (a layer the engine moved
# that they did not record, a lying relay in front of every daemon): not the engine's.
THEIR_DIGEST = layout_digest(trivial_map(4, 12, 7))


def _ok(version: int, digest: str) -> Reply:
    return Reply(Outcome.OK, None, {"version": version, "digest": digest})


# --- the daemons' digests are compared with the engine's own, never with each other -----------


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_daemons_that_all_agree_on_a_digest_other_than_the_engines_fail_the_commit_check(
    ranks: int,
) -> None:
    replies = [_ok(4, THEIR_DIGEST) for _ in range(ranks)]
    check = check_commits(replies, base_version=3, engine_digest=ENGINE_DIGEST)
    assert not check.ok and check.version is None
    assert check.problems == tuple(
        f"rank {rank}: daemon digest {THEIR_DIGEST!r} differs from the engine's {ENGINE_DIGEST}"
        for rank in range(ranks)
    )


def test_only_the_engines_own_digest_passes_the_commit_check() -> None:
    replies = [_ok(4, ENGINE_DIGEST), _ok(4, ENGINE_DIGEST)]
    assert check_commits(replies, base_version=3, engine_digest=ENGINE_DIGEST).ok
    assert not check_commits(replies, base_version=3, engine_digest=THEIR_DIGEST).ok


def test_rank_0s_daemon_is_not_the_reference_of_the_commit_check() -> None:
    # Rank 0's daemon is the one that is wrong; the others hold the engine's map.
    replies = [_ok(4, THEIR_DIGEST), _ok(4, ENGINE_DIGEST), _ok(4, ENGINE_DIGEST)]
    check = check_commits(replies, base_version=3, engine_digest=ENGINE_DIGEST)
    assert check.problems == (
        f"rank 0: daemon digest {THEIR_DIGEST!r} differs from the engine's {ENGINE_DIGEST}",
    )


# --- a repair: every rank checks every daemon's reply ---------------------------------------------


class _ThreadWorld:
    """A world group of ``size`` ranks on threads: ``all_gather_object`` as sglang's does (every
    rank gets every rank's object, by rank)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._objects: list[Any] = [None] * size

    def rank(self, rank: int) -> Any:
        world = self

        class _Rank:
            rank_in_group = rank
            world_size = world.size

            def all_gather_object(self, obj: Any) -> list[Any]:
                world._objects[rank] = obj
                world._barrier.wait()
                gathered = list(world._objects)
                world._barrier.wait()
                return gathered

        return _Rank()


def _plan() -> RepairPlan:
    return RepairPlan(
        base_version=3,
        layers=(1,),
        mover="engine-a",
        rows={1: ENGINE_MAP[1]},
        physical_to_logical_map=ENGINE_MAP,
        fingerprints={0: {1: []}, 1: {1: []}},
    )


def _repair_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, replies: Sequence[Reply]
) -> list[AdoptLayout | FailStartup]:
    """Each rank sends its repair (its daemon answers ``replies[rank]``); what each decides."""
    by_socket = {f"/daemon{rank}.sock": reply for rank, reply in enumerate(replies)}
    monkeypatch.setattr(
        startup_repair.client,
        "repair",
        lambda socket_path, engine_id, rows, fingerprints, **_: by_socket[socket_path],
    )
    world = _ThreadWorld(len(replies))
    results: list[Any] = [None] * len(replies)

    def run(rank: int) -> None:
        this = startup_repair.StartupRank(
            rank=rank,
            socket_path=f"/daemon{rank}.sock",
            engine_id="engine-b",
            mode=ContentCheck.ENFORCE,
            initial_map=trivial_map(4, 12, 8),
            engine_shape=(4, 12, 8),
        )
        results[rank] = startup_repair._repair(world.rank(rank), _plan(), this)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(replies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.mark.parametrize(
    ("other", "problem"),
    [
        (
            _ok(4, THEIR_DIGEST),
            f"rank 1: daemon digest {THEIR_DIGEST!r} differs from the engine's {ENGINE_DIGEST}",
        ),
        (_ok(5, ENGINE_DIGEST), "rank 1: daemon recorded version 5, expected 4"),
        (
            Reply(Outcome.REFUSED, "the content changed"),
            "rank 1: commit refused: the content changed",
        ),
        (Reply(Outcome.UNREACHABLE, "connection refused"), "rank 1: commit unreachable"),
    ],
    ids=["other digest", "other version", "refused", "unreachable"],
)
def test_every_rank_fails_a_repair_unless_every_daemon_recorded_the_engines_version_and_digest(
    monkeypatch: pytest.MonkeyPatch, other: Reply, problem: str
) -> None:
    results = _repair_on_every_rank(monkeypatch, [_ok(4, ENGINE_DIGEST), other])
    assert all(isinstance(result, FailStartup) for result in results), results
    reasons = [result.reason for result in results if isinstance(result, FailStartup)]
    assert reasons[0] == reasons[1]
    assert reasons[0].startswith("repairing the weight cache daemons' expert layout failed: ")
    assert problem in reasons[0]


def test_a_rank_whose_own_daemon_failed_the_repair_fails_with_the_others_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = _repair_on_every_rank(
        monkeypatch, [Reply(Outcome.REFUSED, "not dirty"), _ok(4, ENGINE_DIGEST)]
    )
    assert [type(result) for result in results] == [FailStartup, FailStartup]


def test_every_rank_adopts_the_repair_when_every_daemon_recorded_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = _repair_on_every_rank(monkeypatch, [_ok(4, ENGINE_DIGEST), _ok(4, ENGINE_DIGEST)])
    assert results == [AdoptLayout(4, ENGINE_DIGEST, ENGINE_MAP)] * 2
