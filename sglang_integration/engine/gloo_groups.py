"""The one maker of the plugin's own gloo groups over the engine's world ranks.

Two groups use it, and stay two: the rebalance agents' (``rebalance_agent.create_group``, its
collectives on each rank's agent thread) and a standby's gate (``standby.install_gate``, its
collectives on the forward path); collectives of two threads must never interleave on one
group. ``torch.distributed`` names each new group by a process-wide counter, so every rank must
make its groups in the same order: each call is a collective made at one fixed point of the
startup on every rank, with the same ``timeout_seconds``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def new_gloo_group(world: Any, timeout_seconds: float) -> Any | None:
    """A new gloo group over ``world``'s ranks (sglang's world ``GroupCoordinator``) whose
    collectives fail after ``timeout_seconds``; None for a single rank (nothing to gather)."""
    if int(world.world_size) <= 1:
        return None
    import torch.distributed as dist

    return dist.new_group(
        ranks=list(world.ranks), backend="gloo", timeout=timedelta(seconds=timeout_seconds)
    )
