"""The ``EPLBManager.rebalance`` hook: move daemon-shared experts in two phases, chunk by chunk.

Weights from disk on every rank, or the weight cache off: sglang's own ``rebalance``,
unchanged. Weights from the daemons on every rank, each attached to a daemon that keeps a
record: each chunk is begun on every daemon, moved by sglang's own
``update_expert_location_with_recovery``, and committed (``_move_chunk``). Otherwise (an older
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from layout_ledger.core.layout import layout_digest
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine.rebalance_decisions import (
    RESTART_DAEMONS_ADVICE,
    BeginAction,
    BeginDecision,
    Mode,
    RankLayoutStatus,
    WeightSource,
    check_commits,
    decide_begin,
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
)


class RankLayoutClient(Protocol):
    """This rank's layout requests to its own daemon, bound to this engine's id.

    Each returns the typed ``Reply``. It may raise; the hook turns that into an ``ERROR`` reply
    so the rank still joins the all-gather.
    """

    def begin(self, base_version: int, layers: list[int]) -> Reply: ...

    def commit(self, rows: dict[int, list[int]]) -> Reply: ...

    def abort(self) -> Reply: ...


@dataclass
class RebalanceState:
    """Per engine process (one rank): the decided mode and the version its daemons are at."""

    mode: Mode | None = None
    version: int | None = None
    stopped_reason: str | None = None
    rebalances_done: int = 0  # rebalances whose every chunk was committed
    rebalances_paused: int = 0  # rebalances stopped because a daemon was busy
    chunks_committed: int = 0


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
    status, _ = _current_status_and_client()
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
    logger.info(
        "expert layout rebalance mode: %s (version %s)",
        decision.mode.value,
        state.version,
    )


def _rebalance_two_phase(manager: Any, state: RebalanceState) -> Iterator[None]:
    """sglang's ``EPLBManager.rebalance`` without elastic EP, two-phase per chunk."""
    import time

    from sglang.srt.eplb.expert_distribution import (
        get_global_expert_distribution_recorder,
    )

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
    chunks = manager._compute_update_layer_ids_chunks()
    all_layer_ids = [layer_id for chunk in chunks for layer_id in chunk]
    manager._log_rebalance_layout_before_update(new_metadata, update_layer_ids=all_layer_ids)
    moved: list[int] = []
    for chunk in chunks:
        if len(chunks) > 1:
            yield
        if not _move_chunk(manager, state, new_metadata, list(chunk)):
            break
        moved.extend(chunk)
    else:
        state.rebalances_done += 1
    manager._log_rebalance_layout_after_update(update_layer_ids=moved)
    message = f"[EPLBManager] rebalance end, layers moved {len(moved)}/{len(all_layer_ids)}"
    if enable_timing:
        _device_synchronize()
        message += f" time={time.time() - time_start:.3f}s"
    logger.info("%s, expert layout version %s", message, state.version)


def _move_chunk(manager: Any, state: RebalanceState, new_metadata: Any, chunk: list[int]) -> bool:
    """One chunk: begin, move, synchronize, commit, verify. True if the next chunk may follow.

    1. every rank sends begin to its daemon; the ranks all-gather the replies over the world
       CPU group. All ``ok`` -> move. Any ``refused`` (or an error) -> rebalancing is off for
       good, with one warning. Otherwise any ``busy`` -> this rebalance stops and the next
       interval retries. When not moving, the ranks whose begin succeeded send abort (so do
       ranks whose begin failed in transport, in case it landed; the refusal of that abort is
       expected);
    2. the experts move with sglang's ``update_expert_location_with_recovery``, unchanged;
    3. a device synchronize, so the moved bytes have landed before a daemon serves them;
    4. every rank commits the new rows of the chunk's layers; the ranks all-gather the replies
       and check that every daemon recorded the same new version (base + 1) and that each
       daemon's digest equals the digest this engine computes from its own whole map (the
       daemon's digest is never trusted). If not, an error says to restart the daemons before
       another engine uses them; the engine keeps serving and never rebalances again.
    """
    _, client = _current_status_and_client()
    base_version = state.version
    if client is None or base_version is None:
        raise RuntimeError("two-phase rebalance without a daemon client; this is a plugin bug")
    my_begin = _call(lambda: client.begin(base_version, chunk))
    decision = decide_begin(_all_gather(my_begin))
    if decision.action is not BeginAction.MOVE:
        _abort_own_begin(client, my_begin, chunk)
        _stand_down(state, decision)
        return False
    # A failure inside the move propagates as in sglang: the daemons keep the move pending and
    # become dirty when this engine exits, which is right, since the bytes may be half moved.
    _move_experts(manager, new_metadata, chunk)
    # The moved bytes must have landed before any daemon records (and then serves) them.
    _device_synchronize()
    return _commit_chunk(client, state, chunk, base_version)


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


def _move_experts(manager: Any, new_metadata: Any, chunk: list[int]) -> None:
    """sglang's own move of the chunk's experts, with the arguments its rebalance passes."""
    from sglang.srt.eplb import eplb_manager
    from sglang.srt.model_executor.model_runner_components.moe_ep_setup import (
        init_lplb_solvers,
    )
    from sglang.srt.runtime_context import get_exec, get_parallel

    eplb_manager.update_expert_location_with_recovery(
        expert_location_updater=manager._get_expert_location_updater(),
        model=manager._get_model(),
        new_expert_location_metadata=new_metadata,
        update_layer_ids=chunk,
        tp_rank=get_parallel().tp_rank,
        use_flat_topology=False,
        expert_backup_client=manager._get_expert_backup_client(),
        update_weights_from_disk_callable=manager._get_weight_updater().update_weights_from_disk,
        ep_dispatch_algorithm=get_exec().moe.ep_dispatch_algorithm,
        init_lplb_solvers_callable=lambda: init_lplb_solvers(model_config=manager._model_config),
    )


def _commit_chunk(
    client: RankLayoutClient, state: RebalanceState, chunk: list[int], base_version: int
) -> bool:
    """Commit the chunk's rows on every rank and check what the daemons recorded."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    # An integer tensor's tolist() is already Python ints (the protocol's values).
    engine_map = get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
    rows = {layer: engine_map[layer] for layer in chunk}
    my_commit = _call(lambda: client.commit(rows))
    check = check_commits(
        _all_gather(my_commit),
        base_version=base_version,
        engine_digest=layout_digest(engine_map),
    )
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


def _abort_own_begin(client: RankLayoutClient, my_begin: Reply, chunk: list[int]) -> None:
    """Abort this rank's begin when it succeeded, or when it may have landed (an error reply).

    busy and refused leave nothing pending; after an error the abort is a precaution whose
    refusal ("no move pending") is expected and not logged.
    """
    if my_begin.outcome in (Outcome.BUSY, Outcome.REFUSED):
        return
    abort_reply = _call(client.abort)
    if my_begin.ok and not abort_reply.ok:
        logger.error(
            "abort of the expert move of layers %s failed (%s); the daemon keeps the move "
            "pending and becomes dirty when this engine exits. %s",
            chunk,
            abort_reply.reason,
            RESTART_DAEMONS_ADVICE,
        )


def _call(request: Callable[[], Reply]) -> Reply:
    """Run one request; a failure becomes an ``ERROR`` reply so the all-gather still runs.

    The reply is trimmed (``Reply.trimmed``) to what the ranks all-gather.
    """
    try:
        reply = request()
    except Exception as exc:  # every rank must reach the all-gather that follows
        logger.warning("expert layout request failed: %s", exc)
        return Reply(Outcome.ERROR, f"request failed: {exc}")
    if not isinstance(reply, Reply):
        return Reply(Outcome.ERROR, f"malformed reply {reply!r}")
    return reply.trimmed()


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
