"""What an engine rank that computes tokens adds to a CPU engine rank (``cpu_engine``).

With ``EngineSpec.checkpoint``, an engine rank holds sglang's real model (``engine_model``:
experts mapped from its daemon, or everything from disk) and decodes greedily through sglang's
``ModelRunner.forward`` (``greedy``). Its EPLB is fed as an engine's is: sglang's own expert
distribution recorder (installed by sglang's ``maybe_init_expert_location_metadata``, stat mode
as ``--enable-eplb`` sets it) counts the top-k choices of every forward pass, and each rebalance
runs the way sglang runs it, from ``EPLBManager.on_forward_pass_end`` at the end of forward
passes, one step of the rebalance generator per pass (``rebalance_in_passes``): the first pass
over the step's skewed prompts (``prompts.load_prompts``, so each rebalance has work to do), the
next ones over a one-token prompt until the rebalance has ended (their few choices count
towards the next rebalance).

``prepare_model_parallel`` makes the groups and global state sglang's layers read (after the
world group is joined), as the daemon's ``_init_distributed`` and a ``ModelRunner`` do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_MANAGER = "srt/eplb/eplb_manager.py"
# How sglang drives a rebalance, which rebalance_in_passes does (tests/test_upstream_lines.py).
UPSTREAM_LINES = (
    UpstreamLine(
        _MANAGER, 73, "next(self._main_generator)", "on_forward_pass_end: one step per pass"
    ),
    UpstreamLine(
        _MANAGER,
        94,
        "yield from self.rebalance()",
        "_entrypoint: a rebalance is yielded from the pass generator",
    ),
)

# The one-token prompt of the passes that carry a rebalance on after its first.
FILLER_PROMPT = ((0,),)
# Forward passes one rebalance may take before it is called stuck.
MAX_PASSES_PER_REBALANCE = 10_000


def prepare_model_parallel(server_args: Any, model_config: Any) -> None:
    """sglang's model-parallel groups, MoE config and DP-attention state for this rank."""
    from sglang.srt.distributed.parallel_state import initialize_model_parallel
    from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config

    initialize_moe_config()
    initialize_model_parallel()
    initialize_dp_attention(server_args)
    init_dp_gathered_buffer(model_config)


def release_model_parallel() -> None:
    """sglang's own teardown of the groups ``prepare_model_parallel`` made
    (``destroy_model_parallel``), at a rank's end: the tensor-parallel group's shared-memory
    broadcaster (``sgl_shm_mq_*``, made by its first rank) is unlinked by its owner, not left
    for the resource tracker to find and warn about when the engine's parent exits (a rank's
    process ends in ``os._exit``, which runs no finalizer)."""
    from sglang.srt.distributed.parallel_state import (
        destroy_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        destroy_model_parallel()


def rebalance_in_passes(
    manager: Any,
    forward: Callable[[Sequence[Sequence[int]]], Any],
    first_prompts: Sequence[Sequence[int]],
) -> int:
    """One rebalance of ``manager``, run from ``EPLBManager.on_forward_pass_end`` at the end of
    forward passes (``forward(prompts)`` runs one through ``ModelRunner.forward``): the first
    over ``first_prompts``, the rest over ``FILLER_PROMPT`` until the rebalance generator has
    ended. Afterwards the manager's own pass generator is back (sglang's
    ``reset_generator``). Returns the passes it took."""
    ended = False

    def this_rebalance_now() -> Iterator[None]:
        nonlocal ended
        yield from manager.rebalance()
        ended = True
        while True:
            yield

    manager._main_generator = this_rebalance_now()
    passes = 0
    try:
        forward(first_prompts)
        passes = 1
        while not ended:
            if passes >= MAX_PASSES_PER_REBALANCE:
                raise RuntimeError(f"a rebalance did not end in {passes} forward passes")
            forward(FILLER_PROMPT)
            passes += 1
    finally:
        manager.reset_generator()
    return passes
