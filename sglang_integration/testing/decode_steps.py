"""Continuous decoding in an engine rank, each forward pass timed and marked where a rebalance
chunk moved in it (``scripts/bench_forward.py``).

An engine that serves runs one forward pass after another, and sglang's EPLB rebalances from
``EPLBManager.on_forward_pass_end`` at the end of those passes: every
``eplb_rebalance_num_iterations`` passes a rebalance starts, and with
``eplb_rebalance_layers_per_chunk`` set its chunks move one per pass end (with the plugin, at the
pass its agent's result is due). ``decode_segments`` runs that: segment after segment (an EXTEND
over the segment's prompts, then one DECODE per new token, ``greedy.GreedyDecoder.generate``),
with the manager's own pass generator active (nothing drives the rebalances but the passes).

``PassClock`` stands, for the call, in front of the decoder's ``forward`` (sglang's
``ModelRunner.forward``, the plugin's hook on it included) and of the rank's expert location
updater, which sglang's rebalance and the plugin's both call once per chunk
(``eplb_manager.update_expert_location_with_recovery``). Per pass it records the kind, the wall
seconds, the main thread's CPU seconds and its wait for a CPU while runnable (the kernel's run
delay, ``/proc/thread-self/schedstat``; 0 where there is none), and the layers a chunk moved at
the pass's end with the seconds that move took. The rest of a pass's wall time is waiting: for
the GIL, for the other rank in a collective.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_integration.testing.schedstat import run_delay, thread_schedstat

# What one pass's record holds, in this order (a list per pass keeps the pipe's pickle small).
PASS_FIELDS = ("kind", "seconds", "cpu_seconds", "run_delay", "moved_layers", "move_seconds")


def _agent_figures() -> tuple[float, float, int, int] | None:
    """The plugin's rebalance agent in this rank: its thread's schedstat, and the forward passes
    at which the hook waited for it (``blocked``); None without one."""
    from sglang_integration.engine.rebalance_agent import current_agent

    agent = current_agent()
    if agent is None or agent.native_id is None:
        return None
    return (*thread_schedstat(f"/proc/self/task/{agent.native_id}/schedstat"), agent.blocked)


def _process_cpu() -> float:
    times = os.times()
    return times.user + times.system


@dataclass
class PassClock:
    """The timed ``forward`` and ``update`` of one ``decode_segments`` call (the module
    docstring)."""

    forward: Any  # the decoder's own forward
    updater: Any  # sglang's ExpertLocationUpdater (the rank's StoppableUpdater's inner)
    passes: list[list[Any]] = field(default_factory=list)
    _moved_layers: int = 0
    _move_seconds: float = 0.0

    def timed_forward(self, forward_batch: Any) -> Any:
        self._moved_layers, self._move_seconds = 0, 0.0
        kind = "decode" if forward_batch.forward_mode.is_decode() else "extend"
        delay, cpu = run_delay(), time.thread_time()
        started = time.perf_counter()
        output = self.forward(forward_batch)
        seconds = time.perf_counter() - started
        self.passes.append(
            [
                kind,
                seconds,
                time.thread_time() - cpu,
                run_delay() - delay,
                self._moved_layers,
                self._move_seconds,
            ]
        )
        return output

    def update(self, routed_experts_weights_of_layer: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.updater.update(routed_experts_weights_of_layer, *args, **kwargs)
        finally:
            self._moved_layers += len(kwargs.get("update_layer_ids", ()))
            self._move_seconds += time.perf_counter() - started


def decode_segments(
    decoder: Any, updater: Any, segments: Sequence[tuple[Sequence[Sequence[int]], int]]
) -> dict[str, Any]:
    """Decode each ``(prompts, new_tokens)`` segment greedily, one after another, with EPLB's own
    generator running at every pass end. ``updater`` is the rank's ``StoppableUpdater``; its
    ``inner`` and the decoder's ``forward`` are timed for the call and restored.

    Returns ``tokens`` (per segment, per prompt), ``passes``: one ``PASS_FIELDS`` list per
    forward pass in order, ``kind`` ``"extend"`` or ``"decode"``, ``process_cpu``: the CPU
    seconds of the whole rank process (every thread) over the call, and ``agent``: the plugin's
    rebalance agent thread's CPU seconds, run delay and times put on a CPU over the call, and
    the passes at which the hook waited for it (None without the plugin's agent)."""
    clock = PassClock(decoder.forward, updater.inner)
    decoder.forward, updater.inner = clock.timed_forward, clock
    tokens: list[list[list[int]]] = []
    cpu, agent = _process_cpu(), _agent_figures()
    try:
        for prompts, new_tokens in segments:
            tokens.append(decoder.generate([list(p) for p in prompts], int(new_tokens)).tokens)
    finally:
        updater.inner = clock.updater
        del decoder.forward  # the class's again
    agent_after = _agent_figures()
    agent_used = None
    if agent is not None and agent_after is not None:
        agent_used = [after - before for after, before in zip(agent_after, agent, strict=True)]
    return {
        "tokens": tokens,
        "passes": clock.passes,
        "process_cpu": _process_cpu() - cpu,
        "agent": agent_used,
    }
