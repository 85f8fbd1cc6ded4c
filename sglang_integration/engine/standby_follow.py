"""The rebalance hook follows what a standby adopted: its base version is the adopted one.

Registered by the plugin in ``standby.FOLLOWERS`` (the standby module cannot import the
rebalance hook, which imports the startup hook, which imports the standby module).
"""

from __future__ import annotations

from typing import Any


def follow_adopted_version(manager: Any, version: int) -> None:
    """A rebalance whose mode is decided begins its next move from ``version``."""
    from sglang_integration.engine.rebalance import rebalance_state

    state = rebalance_state(manager)
    if state.version is not None:
        state.version = version
