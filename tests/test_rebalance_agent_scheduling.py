"""The rebalance agent's thread never preempts the forward path when it wakes: ``SCHED_BATCH``.

A real agent thread (a one-rank group: no collective to make), its policy read from the kernel.
``scripts/bench_engine.py --agent-policy-ab`` measures what it changes (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from test_rebalance_margin import NoDaemonRequests

from sglang_integration.engine.rebalance_agent import PluginGroup, RebalanceAgent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")
def test_the_agent_thread_runs_sched_batch_and_the_main_thread_keeps_its_policy() -> None:
    main_policy = os.sched_getscheduler(0)
    agent = RebalanceAgent(NoDaemonRequests(), PluginGroup(None, 1, 0))
    try:
        assert agent.native_id is not None
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(agent.native_id) != os.SCHED_BATCH:
            assert time.monotonic() < deadline, "the agent thread never became SCHED_BATCH"
            time.sleep(0.01)
        assert os.sched_getscheduler(0) == main_policy
    finally:
        agent.stop()
