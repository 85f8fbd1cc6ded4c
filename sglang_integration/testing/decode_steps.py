"""Continuous decoding in an engine rank, each forward pass timed and marked where a rebalance
chunk moved in it (``scripts/bench_forward.py``).

An engine that serves runs one forward pass after another, and sglang's EPLB rebalances from
``EPLBManager.on_forward_pass_end`` at the end of those passes: every
``eplb_rebalance_num_iterations`` passes a rebalance starts, and with
``eplb_rebalance_layers_per_chunk`` set its chunks move one per pass end (with the plugin, at the
pass its agent's result is due). ``decode_segments`` runs that: segment after segment (an EXTEND
over the segment's prompts, then one DECODE per new token, ``greedy.GreedyDecoder.generate``),
with the manager's own pass generator active (nothing drives the rebalances but the passes). Per
pass it returns the seconds ``ModelRunner.forward`` took (the plugin's hook on it included) and
the layers a chunk moved at its end with the seconds that move took: ``MoveClock`` wraps the
rank's expert location updater, which sglang's rebalance and the plugin's both call once per
chunk (``eplb_manager.update_expert_location_with_recovery``), and reads the runner's
``forward_pass_id`` (``ModelRunner.forward`` counts it before the pass) to know the pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# What one pass's record holds, in this order (a list per pass keeps the pipe's pickle small).
PASS_FIELDS = ("kind", "seconds", "moved_layers", "move_seconds")


@dataclass
class _Move:
    layers: int
    seconds: float


@dataclass
class MoveClock:
    """Stands between the rank's updater and sglang's ``ExpertLocationUpdater``: times each
    ``update`` (one chunk's move) and files it under the pass that runs it."""

    inner: Any
    runner: Any  # greedy._Runner: its forward_pass_id is the pass being run
    moves: dict[int, list[_Move]] = field(default_factory=dict)

    def update(self, routed_experts_weights_of_layer: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner.update(routed_experts_weights_of_layer, *args, **kwargs)
        finally:
            layers = len(kwargs.get("update_layer_ids", ()))
            self.moves.setdefault(int(self.runner.forward_pass_id), []).append(
                _Move(layers, time.perf_counter() - started)
            )


def decode_segments(
    decoder: Any, updater: Any, segments: Sequence[tuple[Sequence[Sequence[int]], int]]
) -> dict[str, Any]:
    """Decode each ``(prompts, new_tokens)`` segment greedily, one after another, with EPLB's own
    generator running at every pass end; ``updater`` is the rank's ``StoppableUpdater`` (its
    ``inner`` is timed for the call and restored).

    Returns ``tokens`` (per segment, per prompt) and ``passes``: one ``PASS_FIELDS`` list per
    forward pass in order, ``kind`` ``"extend"`` or ``"decode"``."""
    clock = MoveClock(updater.inner, decoder.runner)
    updater.inner = clock
    tokens: list[list[list[int]]] = []
    passes: list[list[Any]] = []
    try:
        for prompts, new_tokens in segments:
            first = int(decoder.runner.forward_pass_id) + 1
            decoded = decoder.generate([list(p) for p in prompts], int(new_tokens))
            tokens.append(decoded.tokens)
            for offset, seconds in enumerate(decoded.step_seconds):
                moves = clock.moves.pop(first + offset, [])
                passes.append(
                    [
                        "extend" if offset == 0 else "decode",
                        seconds,
                        sum(m.layers for m in moves),
                        sum(m.seconds for m in moves),
                    ]
                )
    finally:
        updater.inner = clock.inner
    return {"tokens": tokens, "passes": passes}
