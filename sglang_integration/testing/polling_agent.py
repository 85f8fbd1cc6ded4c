"""The rebalance agent's hand-over as it was before, for side-by-side runs
(``scripts/bench_forward.py --handover-ab``): ``install`` in an engine rank
(``EngineSpec.rank_setup``) makes that rank's agent poll for its next job every
``POLL_SECONDS`` while a commit job is due (its last result's begin moves), as
``rebalance_agent.RebalanceAgent._next_job`` did until the agent slept on its queue between
jobs.

The hook hands every job over with one queue put in both designs; while this agent polls, the
queue has no waiter and the put wakes no thread (the design before put the commit job in a list
instead: no wake either), so the move pass costs what it cost then.
"""

from __future__ import annotations

import queue
import time
from typing import Any

# The design before: seconds between two looks for the due commit job.
POLL_SECONDS = 0.0005


def _next_job_polling(agent: Any) -> Any:
    from sglang_integration.engine.rebalance_decisions import BeginAction

    result = agent._result
    due = (
        result is not None
        and result.begin is not None
        and result.begin.decision.action is BeginAction.MOVE
    )
    while due and not agent._stopping:
        try:
            return agent._jobs.get_nowait()
        except queue.Empty:
            time.sleep(POLL_SECONDS)
    if agent._stopping:
        return None
    return agent._jobs.get()


def install() -> None:
    """Make every rebalance agent of this process poll for a due commit job (the design before)."""
    from sglang_integration.engine.rebalance_agent import RebalanceAgent

    RebalanceAgent._next_job = _next_job_polling  # type: ignore[method-assign,assignment]
