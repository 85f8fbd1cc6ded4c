"""How many forward passes ahead a rebalance agent's result is used: the margin it proposes.

Every job of a rank's agent (``rebalance_agent``) ends with an agreement: the agents all-gather
their rank's forward-pass counter and their proposed margin, and every rank uses the result at
``max(counters) + max(margins)``. A rank's hook may run until its own counter plus its own
margin (its deadline) without the result; a hook that gets there first waits for its agent
(``blocked``), which is the one wait on the forward path. So the margin must cover the passes an
agreement takes (its all-gather waits for the slowest agent), and every pass of margin is one more
forward pass each chunk of a rebalance takes.

``MarginPolicy`` proposes, from the passes the last ``WINDOW`` agreements took on this rank, the
largest of them plus ``SLACK`` (at least ``FLOOR``, at most ``CEILING``): an agreement slower than
any recent one still finds ``SLACK`` passes of room before it would hold a pass, and after a slow
spell the window forgets it again. Measured with ``scripts/bench_engine.py``:
docs/benchmarks.md.
"""

from __future__ import annotations

from collections import deque

# The smallest margin: the result is used two passes after the latest rank's counter.
FLOOR = 2
# Passes of room beyond the slowest of the recent agreements.
SLACK = 2
# The largest margin (a rank whose agreements take longer than this waits at its deadline).
CEILING = 12
# Agreements remembered.
WINDOW = 32


class MarginPolicy:
    """One rank's margin proposals; ``taken`` is fed the passes each agreement took."""

    def __init__(
        self,
        floor: int = FLOOR,
        slack: int = SLACK,
        ceiling: int = CEILING,
        window: int = WINDOW,
    ) -> None:
        if not 0 < floor <= ceiling:
            raise ValueError(f"margin floor {floor} must be in 1..ceiling {ceiling}")
        self.floor = floor
        self.slack = slack
        self.ceiling = ceiling
        self._taken: deque[int] = deque(maxlen=window)

    def propose(self) -> int:
        """The margin for the next agreement."""
        if not self._taken:
            return self.floor
        return min(self.ceiling, max(self.floor, max(self._taken) + self.slack))

    def taken(self, passes: int) -> None:
        """An agreement took ``passes`` forward passes from reading the counter to its result."""
        self._taken.append(max(0, passes))
