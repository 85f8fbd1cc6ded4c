"""The rebalance agent's thread never preempts the forward path when it wakes (``SCHED_BATCH``),
and never wakes while it waits for its next job.

A real agent thread (a one-rank group: no collective to make), its policy and its times on a CPU
read from the kernel. ``scripts/bench_engine.py --agent-policy-ab`` and
``scripts/bench_forward.py --handover-ab`` measure what each changes (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from test_rebalance_margin import NoDaemonRequests

from sglang_integration.engine import client
from sglang_integration.engine.rebalance import DaemonClient
from sglang_integration.engine.rebalance_agent import BeginJob, PluginGroup, RebalanceAgent
from sglang_integration.engine.rebalance_decisions import BeginAction
from sglang_integration.testing.daemon_control import start_daemon
from sglang_integration.testing.schedstat import thread_schedstat


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_an_agent_whose_commit_job_is_due_sleeps_until_the_move_hands_it_over(
    tmp_path: Path,
) -> None:
    """Between a begin that moves and the move's commit job, the agent sleeps on its queue: it
    is not put on a CPU (a 0.5 ms poll for the job, the design before, woke it some 1,000 times
    in the half second this waits; ``testing.polling_agent``)."""
    daemon = start_daemon(tmp_path, num_layers=4, num_logical_experts=8, num_physical_experts=10)
    attachment = client.attach(daemon.socket_path, "engine-a")
    connection = client.LayoutConnection(daemon.socket_path, "engine-a")
    agent = RebalanceAgent(DaemonClient(connection), PluginGroup(None, 1, 0))
    try:
        assert attachment.reply.ok
        layout = client.query(daemon.socket_path).layout
        assert layout is not None
        agent.submit(BeginJob(layout.version, [0]))
        result = agent.wait()
        assert result is not None and result.begin is not None
        assert result.begin.decision.action is BeginAction.MOVE  # its commit job is now due
        schedstat = f"/proc/self/task/{agent.native_id}/schedstat"
        put_on_a_cpu = thread_schedstat(schedstat)[2]
        time.sleep(0.5)
        assert thread_schedstat(schedstat)[2] - put_on_a_cpu <= 5
        assert agent.alive
    finally:
        agent.stop()
        connection.close()
        attachment.close()
        daemon.stop()
