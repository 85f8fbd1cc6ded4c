"""The agents' margin: how many passes ahead a result is used, and that ranks share one target.

The policy is pure (``rebalance_margin.MarginPolicy``). The agreement runs on two real processes
in a real gloo group, each with its own ``RebalanceAgent`` (its thread idle: no job is handed to
it, so its daemon client is never called) and a different proposed margin and pass counter.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import pytest

from layout_ledger.wire.protocol import Reply
from sglang_integration.engine.rebalance_margin import MarginPolicy
from sglang_integration.testing.cpu_engine import free_port, one_result_per_rank
from sglang_integration.testing.sglang_env import set_quiet_sglang_env


def test_a_margin_starts_at_its_floor() -> None:
    assert MarginPolicy(floor=2, slack=2, ceiling=12).propose() == 2


def test_a_slow_agreement_widens_the_margin_beyond_the_slowest_recent_one() -> None:
    policy = MarginPolicy(floor=2, slack=2, ceiling=12, window=4)
    for taken in (0, 1, 0):
        policy.taken(taken)
    assert policy.propose() == 3  # the slowest recent (1) + slack
    policy.taken(4)
    assert policy.propose() == 6


def test_the_margin_narrows_again_once_a_slow_agreement_left_the_window() -> None:
    policy = MarginPolicy(floor=2, slack=2, ceiling=12, window=4)
    policy.taken(5)
    for _ in range(3):
        policy.taken(0)
        assert policy.propose() == 7
    policy.taken(0)
    assert policy.propose() == 2


def test_the_margin_never_exceeds_its_ceiling() -> None:
    policy = MarginPolicy(floor=2, slack=2, ceiling=12)
    policy.taken(40)
    assert policy.propose() == 12


def test_a_margin_policy_refuses_a_floor_outside_one_to_its_ceiling() -> None:
    with pytest.raises(ValueError, match=r"must be in 1\.\.ceiling"):
        MarginPolicy(floor=0)
    with pytest.raises(ValueError, match=r"must be in 1\.\.ceiling"):
        MarginPolicy(floor=5, ceiling=4)


class NoDaemonRequests:
    """An agent's daemon client where no job is handed to the agent, so no request is sent."""

    def begin(self, base_version: int, layers: list[int]) -> Reply:
        raise AssertionError("no begin in this test")

    def commit(self, rows: dict[int, list[int]]) -> Reply:
        raise AssertionError("no commit in this test")

    def abort(self) -> Reply:
        raise AssertionError("no abort in this test")


# (counter, the slowest recent agreement in passes) per rank: rank 1 proposes the larger margin,
# rank 0 has the larger counter.
RANKS = {0: (11, 0), 1: (10, 5)}


def _agreeing_rank(rank: int, port: int, out: Connection) -> None:
    import torch.distributed as dist

    from sglang_integration.engine.rebalance_agent import PluginGroup, RebalanceAgent

    set_quiet_sglang_env()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = PluginGroup(dist.new_group([0, 1], backend="gloo"), 2, rank)
        counter, slowest = RANKS[rank]
        margins = MarginPolicy()
        margins.taken(slowest)
        agent = RebalanceAgent(NoDaemonRequests(), group, margins=margins)
        try:
            agent.step = counter
            proposed = margins.propose()
            target = agent._agree_on_target()
            report: dict[str, Any] = {
                "proposed": proposed,
                "deadline": agent.deadline,
                "target": target,
                "next": margins.propose(),
            }
        finally:
            agent.stop()
        out.send(report)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_proposing_different_margins_agree_on_one_target_at_or_after_every_deadline() -> None:
    port = free_port()
    reports = one_result_per_rank(2, _agreeing_rank, lambda rank: (rank, port))
    assert [report["proposed"] for report in reports] == [2, 7]
    # the largest counter (rank 0's 11) plus the largest margin (rank 1's 7), on both ranks
    assert [report["target"] for report in reports] == [18, 18]
    # each rank's hook may run to its own deadline without the result: never past the target
    assert [report["deadline"] for report in reports] == [13, 17]
    for report in reports:
        assert report["deadline"] <= report["target"]
