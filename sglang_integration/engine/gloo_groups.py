"""The one maker of the plugin's own gloo groups over the engine's world ranks.

Two groups use it, and stay two: the rebalance agents' (``rebalance_agent.create_group``, its
collectives on each rank's agent thread) and a standby's gate (``standby.install_gate``, its
collectives on the forward path); collectives of two threads must never interleave on one
group. ``torch.distributed`` names each new group by a process-wide counter, so every rank must
make its groups in the same order: each call is a collective made at one fixed point of the
startup on every rank, with the same ``timeout_seconds``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

# torch's switch for a gloo group that connects each pair of ranks at its first message
# (ProcessGroupGloo.hpp: TORCH_GLOO_LAZY_INIT, read when the group is made); there is no
# argument for it.
LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def new_gloo_group(
    world: Any, timeout_seconds: float, *, connect_lazily: bool = False
) -> Any | None:
    """A new gloo group over ``world``'s ranks (sglang's world ``GroupCoordinator``) whose
    collectives fail after ``timeout_seconds``; None for a single rank (nothing to gather).

    Made at once by default: gloo connects every rank to every other one (``EP - 1``
    connections a rank, each through the store) before it returns. ``connect_lazily``: each
    pair connects at its first message, so making the group costs one store barrier whatever
    the ranks, and its first collectives pay the connections they use."""
    if int(world.world_size) <= 1:
        return None
    import torch.distributed as dist

    with _lazy_connections() if connect_lazily else contextlib.nullcontext():
        return dist.new_group(
            ranks=list(world.ranks), backend="gloo", timeout=timedelta(seconds=timeout_seconds)
        )


@contextlib.contextmanager
def _lazy_connections() -> Iterator[None]:
    before = os.environ.get(LAZY_INIT)
    os.environ[LAZY_INIT] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAZY_INIT, None)
        else:
            os.environ[LAZY_INIT] = before
