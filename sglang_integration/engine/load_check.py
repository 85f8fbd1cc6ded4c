"""The hook on ``ModelRunner.load_model``: every loaded slot holds the expert the layout names.

sglang's ``ModelRunner.initialize`` calls the startup hook's target (``startup``: the ranks agree
on a map) before ``load_model``; the weights exist only once ``load_model`` has set
``self.model``, and nothing routes a token before ``initialize`` returns (``UPSTREAM_LINES``). So
the hook runs the original, then finishes a convergence the startup hook left to it (the move of
daemons at an older layout to the newest, ``converge.move_after_load``), then, when the startup
hook kept the experts' expected contents
(every daemon records slot fingerprints), checks on every rank what it loaded
(``check_loaded_experts``).

Every sglang internal this hook reads is here: ``runner.is_draft_worker``, ``runner.model``,
sglang's global ``ExpertLocationMetadata`` and ``get_parallel().world_group``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from layout_ledger.core.startup_verdict import ExpertLayoutStartupError
from sglang_integration.engine.content_decisions import loaded_failure, loaded_slot_problems
from sglang_integration.settings import ContentCheck, content_check
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

# Register with HookType.AROUND and ``around_load_model`` (the plugin).
HOOK_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"

_RUNNER = "srt/model_executor/model_runner.py"
# The lines of sglang this hook relies on (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(
        _RUNNER, 708, "self.maybe_init_expert_location_metadata()", "the startup hook runs first"
    ),
    UpstreamLine(_RUNNER, 715, "self.load_model()", "then the target"),
    UpstreamLine(_RUNNER, 1321, "self.model = loaded.model", "the weights exist from here on"),
)


def around_load_model(original_fn: Callable[[Any], Any], runner: Any) -> Any:
    """AROUND hook body for ``ModelRunner.load_model`` (HOOK_TARGET)."""
    result = original_fn(runner)
    if runner.is_draft_worker:
        return result
    from sglang_integration.engine.startup import current_session

    session = current_session()
    if session is None:
        return result
    if session.converge is not None:
        from sglang_integration.engine.converge import move_after_load

        # The daemons at an older layout move to the newest first; the check then sees it.
        pending, session.converge = session.converge, None
        move_after_load(runner.model, pending, session)
    if session.expected_content is None:
        return result
    check_loaded_experts(runner.model, session)
    return result


def check_loaded_experts(model: Any, session: Any) -> None:
    """Check this rank's loaded slots against the layout; a collective over the world group.

    1. fingerprint this rank's local slots (``moe_ep_rank * num_local_physical_experts`` on) of
       ``model.routed_experts_weights_of_layer`` on the weights' device, when its weights came
       from the daemons (weights a client loaded from disk are not the daemons' and are not
       checked; that rank reports nothing);
    2. compare each slot with the fingerprint every daemon recorded for the expert the adopted
       map names there (``content_decisions.loaded_slot_problems``);
    3. all-gather the problems over the world CPU group: any problem fails startup on every rank
       with ``ExpertLayoutStartupError`` naming rank, layer, slot, the expected expert and what
       the slot holds (``--expert-layout-content-check warn``: one warning instead).
    """
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.runtime_context import get_parallel

    from sglang_integration.engine.metadata import map_of

    metadata = get_global_expert_location_metadata()
    problems = _own_problems(model, session, None if metadata is None else map_of(metadata))
    world = get_parallel().world_group
    gathered = world.all_gather_object(problems)
    every = [problem for rank_problems in gathered for problem in rank_problems]
    if not every:
        logger.info(
            "Every loaded expert slot holds the expert the layout names (version %d)",
            session.version,
        )
        return
    failure = loaded_failure(every)
    if content_check() is ContentCheck.WARN:
        if session.rank == 0:
            logger.warning("%s (content check warn: starting anyway)", failure.reason)
        return
    raise ExpertLayoutStartupError(failure.reason)


def _own_problems(model: Any, session: Any, the_map: list[list[int]] | None) -> list[str]:
    """This rank's problems (never raises: every rank must reach the all-gather)."""
    from sglang_integration.content.model_slots import model_slots
    from sglang_integration.engine.weight_source import WeightSource, weight_source

    if weight_source() is not WeightSource.DAEMON:
        return []  # loaded from disk: not the daemons' bytes
    try:
        slots = model_slots(model, session.first_slot, session.num_local_slots)
        if slots is None or the_map is None:
            return [f"rank {session.rank}: the model has no routed-expert tensors to check"]
        local = slots.fingerprints()
    except Exception as exc:
        logger.exception("fingerprinting the loaded expert slots failed")
        return [f"rank {session.rank}: fingerprinting the loaded slots failed: {exc}"]
    return loaded_slot_problems(session.rank, local, the_map, session.expected_content)
