"""The ``EPLBManager.rebalance`` hook: move daemon-shared experts in two phases, chunk by chunk.

Weights from disk on every rank, or the weight cache off: sglang's own ``rebalance``,
unchanged. Weights from the daemons on every rank, each attached to a daemon that keeps a
record: each chunk is begun on every daemon, moved by sglang's own
``update_expert_location_with_recovery``, and committed (``_rebalance_two_phase``), the daemons'
round trips and their all-gathers on this rank's agent thread (``rebalance_agent``), never on
the forward path. Otherwise (an older
daemon, a daemon without ``--enable-eplb``, an engine that did not attach, ranks mixing disk
and daemon weights, elastic EP) shared weights are never rebalanced; one warning per reason.

The decisions are pure functions of all-gathered values (``rebalance_decisions``), so every
rank takes the same branch and none is left waiting in a collective. This module holds the
hook: the state it keeps per engine, the requests, the collectives and the steps of a chunk.
It is the one place that knows the internals of ``EPLBManager.rebalance``: the two-phase path
repeats its steps around each chunk, since the original has no seam between its chunks
(``UPSTREAM_LINES``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from layout_ledger.wire.protocol import Reply
from sglang_integration.engine.rebalance_agent import (
    AgentResult,
    BeginJob,
    BeginOutcome,
    CommitJob,
    RankLayoutClient,
    RebalanceAgent,
    start_agent,
)
from sglang_integration.engine.rebalance_decisions import (
    RESTART_DAEMONS_ADVICE,
    BeginAction,
    BeginDecision,
    CommitCheck,
    Mode,
    RankLayoutStatus,
    WeightSource,
    decide_mode,
)
from sglang_integration.engine.reply_gather import all_gather_small
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

# Register with HookType.AROUND and ``rebalance_around`` (the plugin).
HOOK_TARGET = "sglang.srt.eplb.eplb_manager.EPLBManager.rebalance"

_MANAGER = "srt/eplb/eplb_manager.py"
# The steps of sglang's rebalance that _rebalance_two_phase repeats, without elastic EP
# (tests/test_upstream_lines.py checks the lines).
UPSTREAM_LINES = (
    UpstreamLine(_MANAGER, 96, "def rebalance(self", "the target"),
    UpstreamLine(
        _MANAGER,
        97,
        "if self._rebalance_disabled_reason is not None:",
        "sglang's own pause, left to the original",
    ),
    UpstreamLine(_MANAGER, 115, 'logger.info("[EPLBManager] rebalance start")', "the start"),
    UpstreamLine(
        _MANAGER,
        117,
        "enable_timing = self._rebalance_layers_per_chunk is None",
        "timed only without chunks",
    ),
    UpstreamLine(
        _MANAGER,
        123,
        "dump_record_output = get_global_expert_distribution_recorder().dump_record(",
        "the load the new layout is computed from",
    ),
    UpstreamLine(
        _MANAGER,
        132,
        "if not self._check_rebalance_needed(average_utilization_rate_over_window):",
        "nothing to do",
    ),
    UpstreamLine(
        _MANAGER,
        135,
        "expert_location_metadata = self._compute_expert_location_metadata(",
        "the new layout",
    ),
    UpstreamLine(
        _MANAGER,
        144,
        "update_layer_ids_chunks = self._compute_update_layer_ids_chunks()",
        "the chunks",
    ),
    UpstreamLine(
        _MANAGER, 148, "self._log_rebalance_layout_before_update(", "the layout logged before"
    ),
    UpstreamLine(_MANAGER, 154, "yield", "one chunk per step of the generator"),
    UpstreamLine(
        _MANAGER,
        155,
        "update_expert_location_with_recovery(",
        "the move of a chunk, called with the same arguments by _move_experts",
    ),
    UpstreamLine(
        _MANAGER,
        178,
        "self._log_rebalance_layout_after_update(update_layer_ids=all_update_layer_ids)",
        "the layout logged after",
    ),
    UpstreamLine(_MANAGER, 185, "logger.info(msg)", "the end"),
    UpstreamLine(
        "srt/eplb/expert_location_updater.py",
        505,
        "req.wait()",
        "the move waits for its P2P requests on the current stream: the event recorded after "
        "it covers them",
    ),
)


@dataclass
class RebalanceState:
    """Per engine process (one rank): the decided mode and the version its daemons are at."""

    mode: Mode | None = None
    version: int | None = None
    stopped_reason: str | None = None
    rebalances_done: int = 0  # rebalances whose every chunk was committed
    rebalances_paused: int = 0  # rebalances stopped because a daemon was busy
    chunks_committed: int = 0
    agent: RebalanceAgent | None = None  # this rank's agent (two-phase mode)
    last_passes: int = 0  # forward passes the last two-phase rebalance took on this rank


_STATE_ATTR = "_expert_layout_rebalance_state"


def rank_status(weights_from: WeightSource | None, session: Any) -> RankLayoutStatus:
    """This rank's status from the loader's weight source and the startup hook's session.

    ``session`` is ``startup.EngineLayoutSession`` or None (startup did not attach).
    """
    if session is None:
        return RankLayoutStatus(weights_from, None)
    attached = bool(session.attached)
    return RankLayoutStatus(
        weights_from, session.finding, attached, session.version if attached else None
    )


class DaemonClient:
    """``RankLayoutClient`` over this rank's one ``client.LayoutConnection`` (kept for its life)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def begin(self, base_version: int, layers: list[int]) -> Reply:
        reply: Reply = self.connection.begin(base_version, layers)
        return reply

    def commit(self, rows: dict[int, list[int]]) -> Reply:
        reply: Reply = self.connection.commit(rows)
        return reply

    def abort(self) -> Reply:
        reply: Reply = self.connection.abort()
        return reply


def _current_status_and_client() -> tuple[RankLayoutStatus, RankLayoutClient | None]:
    from sglang_integration.engine.rank_connection import rank_connection
    from sglang_integration.engine.startup import current_session
    from sglang_integration.engine.weight_source import weight_source

    session = current_session()
    status = rank_status(weight_source(), session)
    if session is None or not status.on_record:
        return status, None
    return status, DaemonClient(rank_connection(session.socket_path, session.engine_id))


def rebalance_state(manager: Any) -> RebalanceState:
    """This engine's rebalance state (created on first use)."""
    state = getattr(manager, _STATE_ATTR, None)
    if state is None:
        state = RebalanceState()
        setattr(manager, _STATE_ATTR, state)
    return state


def rebalance_around(original_fn: Callable[[Any], Any], manager: Any) -> Iterator[None]:
    """AROUND hook body for ``EPLBManager.rebalance`` (a generator, like the original)."""
    from sglang.srt.runtime_context import get_model

    if get_model().weight_cache_mode == "off":
        yield from original_fn(manager)
        return
    if manager._rebalance_disabled_reason is not None:
        # sglang's own pause (elastic EP scale-up); the original logs it and returns.
        yield from original_fn(manager)
        return
    state = rebalance_state(manager)
    if state.mode is None:
        _decide_mode_once(state)
    if state.mode is Mode.ORIGINAL:
        yield from original_fn(manager)
        return
    if state.mode is Mode.OFF or state.stopped_reason is not None:
        return
    yield from _rebalance_two_phase(manager, state)


def _decide_mode_once(state: RebalanceState) -> None:
    status, client = _current_status_and_client()
    statuses = _all_gather(status)
    decision = decide_mode(statuses, elastic_ep=_elastic_ep_enabled())
    state.mode = decision.mode
    state.version = decision.version
    # The reasons name every rank they apply to, so the engine's first rank says them once.
    for reason in decision.reasons if _is_first_rank() else ():
        logger.warning(
            "EPLB rebalancing of the daemon-shared expert weights stays off, and the engine "
            "keeps its current expert layout: %s",
            reason,
        )
    if decision.mode is Mode.TWO_PHASE:
        if client is None:
            raise RuntimeError("two-phase rebalance without a daemon client; this is a plugin bug")
        state.agent = start_agent(client)
    logger.info(
        "expert layout rebalance mode: %s (version %s)",
        decision.mode.value,
        state.version,
    )


def _rebalance_two_phase(manager: Any, state: RebalanceState) -> Iterator[None]:
    """sglang's ``EPLBManager.rebalance`` without elastic EP, two-phase per chunk, with the
    daemons' round trips on this rank's agent (``rebalance_agent``).

    1. the agent sends the first chunk's begin; every forward pass until its result's target
       pass, the hook yields (a pass at which the agent is past its deadline waits for it);
    2. at the target pass every rank acts on the same all-gathered decision: all ``ok`` ->
       move; any ``refused`` (or an error) -> rebalancing is off for good, with one warning;
       otherwise any ``busy`` -> this rebalance stops and the next interval retries (the agent
       already aborted what its rank's begin left pending);
    3. the experts move with sglang's ``update_expert_location_with_recovery``, unchanged; a
       device event is recorded after the move and handed to the agent with the map;
    4. the agent waits for the event, commits the chunk's rows, all-gathers the replies and
       checks that every daemon recorded the same new version (base + 1) with the digest of
       this engine's own whole map (the daemon's digest is never trusted), then begins the next
       chunk. The check is used at the next target pass, before that chunk's grant: a failed
       check turns rebalancing off for good with an error that says to restart the daemons.
    """
    import time

    from sglang.srt.eplb.expert_distribution import (
        get_global_expert_distribution_recorder,
    )

    agent = state.agent
    base_version = state.version
    if agent is None or base_version is None:
        raise RuntimeError("two-phase rebalance without an agent; this is a plugin bug")
    logger.info("[EPLBManager] rebalance start (through the weight cache daemons)")
    enable_timing = manager._rebalance_layers_per_chunk is None
    if enable_timing:
        _device_synchronize()
        time_start = time.time()
    dump_record_output = get_global_expert_distribution_recorder().dump_record(output_mode="object")
    if not manager._check_rebalance_needed(
        dump_record_output["average_utilization_rate_over_window"]
    ):
        return
    new_metadata = manager._compute_expert_location_metadata(
        dump_record_output["logical_count"], broadcast_over_world=False
    )
    chunks = [list(chunk) for chunk in manager._compute_update_layer_ids_chunks()]
    all_layer_ids = [layer_id for chunk in chunks for layer_id in chunk]
    manager._log_rebalance_layout_before_update(new_metadata, update_layer_ids=all_layer_ids)
    moved: list[int] = []
    # What the move pass needs, made here once: the move's arguments, the device event's
    # maker, the map the agent reads (sglang's move updates it in place). The pass at which a
    # chunk moves then only moves it and hands the agent its job.
    move_arguments = _move_arguments(manager, new_metadata)
    record_moved_event = _moved_event_recorder()
    engine_map = _engine_map()
    agent.step = 0
    agent.submit(BeginJob(base_version, chunks[0]))
    next_chunk = 0
    while True:
        result = yield from _await_agent(agent)
        if result is None:
            _agent_lost(state, agent, chunks[next_chunk - 1] if next_chunk else chunks[0])
            break
        if result.commit is not None:
            if not _use_commit_check(state, result.commit, chunks[next_chunk - 1]):
                break
            moved.extend(chunks[next_chunk - 1])
        if next_chunk == len(chunks):
            state.rebalances_done += 1
            break
        begin = result.begin
        if begin is None:
            raise RuntimeError("the agent sent no begin decision; this is a plugin bug")
        if begin.decision.action is not BeginAction.MOVE:
            _report_abort_problem(begin, chunks[next_chunk])
            _stand_down(state, begin.decision)
            break
        chunk = chunks[next_chunk]
        next_chunk += 1
        # A failure inside the move propagates as in sglang: the daemons keep the move pending
        # and become dirty when this engine exits, which is right, since the bytes may be half
        # moved.
        _move_experts(move_arguments, chunk)
        agent.submit(
            CommitJob(
                state.version,  # type: ignore[arg-type]
                chunk,
                None if record_moved_event is None else record_moved_event(),
                engine_map,
                chunks[next_chunk] if next_chunk < len(chunks) else None,
            )
        )
    state.last_passes = agent.step
    manager._log_rebalance_layout_after_update(update_layer_ids=moved)
    message = f"[EPLBManager] rebalance end, layers moved {len(moved)}/{len(all_layer_ids)}"
    if enable_timing:
        _device_synchronize()
        message += f" time={time.time() - time_start:.3f}s"
    logger.info(
        "%s in %d forward passes, expert layout version %s", message, agent.step, state.version
    )


def _await_agent(agent: RebalanceAgent) -> Generator[None, None, AgentResult | None]:
    """Yield one forward pass at a time until the agent's result and its target pass are here.

    Returns the result at its target pass (the same pass on every rank), or None when the agent
    died. Waits on the agent only at its deadline (``rebalance_agent``).
    """
    while True:
        result = agent.result()
        if result is None:
            if not agent.alive:
                return None
            deadline = agent.deadline
            if deadline is not None and agent.step >= deadline:
                result = agent.wait()
                if result is None:
                    return None
        if result is not None:
            if agent.step == result.target:
                return result
            if agent.step > result.target:
                agent.failure = (
                    f"the agreed pass {result.target} was already behind this rank "
                    f"(pass {agent.step}); this is a plugin bug"
                )
                return None
        yield
        agent.step += 1


def _agent_lost(state: RebalanceState, agent: RebalanceAgent, chunk: list[int]) -> None:
    state.stopped_reason = f"the rebalance agent stopped: {agent.failure or 'its thread ended'}"
    logger.error(
        "EPLB rebalancing of the daemon-shared expert weights is off for good near the move of "
        "layers %s: %s. %s",
        chunk,
        state.stopped_reason,
        RESTART_DAEMONS_ADVICE,
    )


def _use_commit_check(state: RebalanceState, check: CommitCheck, chunk: list[int]) -> bool:
    """What every daemon recorded for the chunk: the next version, or rebalancing off."""
    if not check.ok:
        state.stopped_reason = "; ".join(check.problems)
        logger.error(
            "the weight cache daemons did not record the expert move of layers %s as this engine "
            "made it: %s. %s",
            chunk,
            state.stopped_reason,
            RESTART_DAEMONS_ADVICE,
        )
        return False
    state.version = check.version
    state.chunks_committed += 1
    return True


def _report_abort_problem(begin: BeginOutcome, chunk: list[int]) -> None:
    if begin.abort_problem is not None:
        logger.error(
            "abort of the expert move of layers %s failed (%s); the daemon keeps the move "
            "pending and becomes dirty when this engine exits. %s",
            chunk,
            begin.abort_problem,
            RESTART_DAEMONS_ADVICE,
        )


def _moved_event_recorder() -> Callable[[], Any] | None:
    """What records a device event on the current stream after the move; None on a CPU (the
    move is synchronous there, and the hook then hands the agent None).

    sglang's move waits for its P2P requests (``req.wait()``) and copies on the current stream,
    so an event recorded there afterwards covers the moved bytes (``UPSTREAM_LINES``).
    """
    import torch
    from sglang.srt.runtime_context import get_device

    kind = torch.device(get_device().device).type
    if kind == "cpu":
        return None
    event_class = torch.get_device_module(kind).Event

    def record() -> Any:
        event = event_class()
        event.record()
        return event

    return record


def _engine_map() -> Any:
    """The map this rank routes with, for the agent to read after each move.

    Not a copy: only sglang's move changes it (in place: ``ExpertLocationMetadata.update``
    assigns ``self_field[...]``), and the next move comes only after the agent's result, which
    it publishes after it read the map (``RebalanceAgent._commit``).
    """
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    return get_global_expert_location_metadata().physical_to_logical_map_cpu


def _stand_down(state: RebalanceState, decision: BeginDecision) -> None:
    """A chunk that does not move: pause this rebalance (busy) or stop for good (refused)."""
    if decision.action is BeginAction.DISABLE:
        state.stopped_reason = decision.reason
    if decision.action is BeginAction.SKIP:
        state.rebalances_paused += 1
        logger.info(
            "EPLB rebalance paused, another engine uses the daemons (%s); "
            "the next interval tries again",
            decision.reason,
        )
    elif _is_first_rank():
        logger.warning(
            "EPLB rebalancing of the daemon-shared expert weights is off for good: a daemon "
            "refused the move (%s)",
            decision.reason,
        )


def _move_arguments(manager: Any, new_metadata: Any) -> dict[str, Any]:
    """The arguments sglang's rebalance passes its move of a chunk, but the chunk's layers.

    Made once per rebalance: sglang reads the same getters per chunk, and nothing they return
    changes between the chunks of one rebalance (the model, its updater, the backup client,
    the weight updater, the dispatch algorithm, the tensor-parallel rank).
    """
    from sglang.srt.model_executor.model_runner_components.moe_ep_setup import (
        init_lplb_solvers,
    )
    from sglang.srt.runtime_context import get_exec, get_parallel

    return {
        "expert_location_updater": manager._get_expert_location_updater(),
        "model": manager._get_model(),
        "new_expert_location_metadata": new_metadata,
        "tp_rank": get_parallel().tp_rank,
        "use_flat_topology": False,
        "expert_backup_client": manager._get_expert_backup_client(),
        "update_weights_from_disk_callable": manager._get_weight_updater().update_weights_from_disk,
        "ep_dispatch_algorithm": get_exec().moe.ep_dispatch_algorithm,
        "init_lplb_solvers_callable": lambda: init_lplb_solvers(model_config=manager._model_config),
    }


def _move_experts(move_arguments: dict[str, Any], chunk: list[int]) -> None:
    """sglang's own move of the chunk's experts, with the arguments its rebalance passes."""
    from sglang.srt.eplb import eplb_manager

    eplb_manager.update_expert_location_with_recovery(update_layer_ids=chunk, **move_arguments)


def _all_gather(value: Any) -> list[Any]:
    """All-gather a small object over sglang's world CPU (gloo) group; index = world rank."""
    from sglang.srt.runtime_context import get_parallel

    return all_gather_small(get_parallel().world_group, value)


def _is_first_rank() -> bool:
    from sglang.srt.runtime_context import get_parallel

    return bool(get_parallel().world_group.rank_in_group == 0)


def _device_synchronize() -> None:
    """Wait for the device's queued copies; ``torch.cpu.synchronize`` is a no-op on a CPU."""
    import torch
    from sglang.srt.runtime_context import get_device

    torch.get_device_module(get_device().device).synchronize()


def _elastic_ep_enabled() -> bool:
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.runtime_context import get_exec

    return (
        ElasticEPStateManager.instance() is not None
        or get_exec().moe.elastic_ep_backend is not None
    )
