"""The ``EPLBManager.rebalance`` hook: move daemon-shared experts in two phases, chunk by chunk.

Rules (../shared/DESIGN.md "Engine side", the proposal's "Rebalance" section):

- Weight cache off, or weights from disk on every rank: sglang's own ``rebalance``, unchanged.
- Weights from the daemons on every rank, each attached to a daemon that keeps a record: per
  chunk of ``--eplb-rebalance-layers-per-chunk`` layers,

  1. every rank sends begin to its daemon; the ranks all-gather the replies over the world CPU
     group. All ``ok`` -> move. Any ``refused`` (or an error) -> rebalancing is off for good, with
     one warning. Otherwise any ``busy`` -> this rebalance stops and the next interval retries.
     When not moving, the ranks whose begin succeeded send abort (so do ranks whose begin failed
     in transport, in case it landed; the refusal of that abort is expected).
  2. the experts move with sglang's ``update_expert_location_with_recovery``, unchanged;
  3. a device synchronize, so the moved bytes have landed before a daemon serves them;
  4. every rank commits the new rows of the chunk's layers; the ranks all-gather the replies and
     check that every daemon recorded the same new version (base + 1) and that each daemon's
     digest equals the digest this engine computes from its own whole map (the daemon's digest
     is never trusted). If not, an error says to restart the daemons before another engine uses
     them; the engine keeps serving and never rebalances again.

- Otherwise (an older daemon, a daemon without ``--enable-eplb``, an engine that did not attach,
  ranks mixing disk and daemon weights, elastic EP) shared weights are never rebalanced; one
  warning per reason.

Every decision is a pure function of all-gathered values, so every rank takes the same branch and
no rank is left waiting in a collective. This module is the one place that knows the internals of
``EPLBManager.rebalance`` (sglang 0.5.23, eplb_manager.py:96-185); the two-phase path repeats its
steps around each chunk because the original has no seam between its chunks.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from layout_ledger import messages
from layout_ledger.layout import layout_digest
from sglang_integration.weight_source import WeightSource

logger = logging.getLogger(__name__)

# Register with HookType.AROUND and ``rebalance_around``.
HOOK_TARGET = "sglang.srt.eplb.eplb_manager.EPLBManager.rebalance"

# Where a rank's weights came from (what the loader recorded), as all-gathered strings.
WEIGHTS_FROM_DISK = WeightSource.DISK.value
WEIGHTS_FROM_DAEMON = WeightSource.DAEMON.value

# What a rank's attach at startup found.
ATTACHED = "attached"  # attached to a daemon that keeps a record
OLDER_DAEMON = "older_daemon"  # the daemon answered "Unknown request type"
NO_RECORD = "no_record"  # the daemon runs without --enable-eplb
NOT_ATTACHED = "not_attached"  # no attachment (no daemon, or the attach failed)

# Why shared-weights rebalancing stays off: one warning per reason.
REASON_ELASTIC_EP = (
    "elastic EP is on; rebalancing of daemon-shared weights is not coordinated with elastic EP"
)
REASON_MIXED_SOURCES = "some ranks loaded their weights from disk and others from the daemons"
REASON_UNKNOWN_SOURCE = "the loader recorded no weight source"
REASON_OLDER_DAEMON = "the daemon is an older version without the expert layout protocol"
REASON_NO_RECORD = "the daemon runs without --enable-eplb and keeps no expert layout record"
REASON_NOT_ATTACHED = "the engine did not attach to its daemon at startup"
REASON_VERSIONS_DIFFER = "the daemons are at different layout versions"

RESTART_DAEMONS_ADVICE = (
    "Restart the weight cache daemons before another engine uses them; "
    "this engine keeps serving and will not rebalance again."
)


class RankLayoutClient(Protocol):
    """This rank's layout requests to its own daemon, bound to this engine's id.

    Each returns a reply summary: ``{"status": str, "reason": str | None}`` plus ``version`` and
    ``digest`` for an ``ok`` commit. ``status`` is a PROTOCOL.md status or one of the client's
    local outcomes (``older_daemon``, ``error``, ``no_daemon``, ``unreachable``). It may raise;
    the hook turns that into an ``error`` reply so the rank still joins the all-gather.
    """

    def begin(self, base_version: int, layers: list[int]) -> dict[str, Any]: ...

    def commit(self, rows: dict[int, list[int]]) -> dict[str, Any]: ...

    def abort(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RankLayoutStatus:
    """What one rank knows at its first rebalance; all-gathered, so plain picklable values."""

    weights_from: str | None
    attach: str
    version: int | None = None


class Mode(enum.Enum):
    ORIGINAL = "original"  # sglang's rebalance, unchanged
    TWO_PHASE = "two_phase"  # begin/move/synchronize/commit/verify per chunk
    OFF = "off"  # never rebalance the shared weights


@dataclass(frozen=True)
class ModeDecision:
    mode: Mode
    reasons: tuple[str, ...] = ()
    version: int | None = None


def decide_mode(statuses: Sequence[RankLayoutStatus], *, elastic_ep: bool) -> ModeDecision:
    """How this engine rebalances, from every rank's status (index = world rank)."""
    sources = {status.weights_from for status in statuses}
    if sources == {WEIGHTS_FROM_DISK}:
        return ModeDecision(Mode.ORIGINAL)
    reasons: list[str] = []

    def add(reason: str, ranks: Sequence[int]) -> None:
        reasons.append(f"{reason} (rank {', '.join(str(rank) for rank in ranks)})")

    if elastic_ep:
        reasons.append(REASON_ELASTIC_EP)
    disk_ranks = _ranks_where(statuses, lambda s: s.weights_from == WEIGHTS_FROM_DISK)
    if disk_ranks:
        add(REASON_MIXED_SOURCES, disk_ranks)
    unknown = _ranks_where(
        statuses,
        lambda s: s.weights_from not in (WEIGHTS_FROM_DISK, WEIGHTS_FROM_DAEMON),
    )
    if unknown:
        add(REASON_UNKNOWN_SOURCE, unknown)
    daemon_statuses = [
        (rank, s) for rank, s in enumerate(statuses) if s.weights_from == WEIGHTS_FROM_DAEMON
    ]
    for attach, reason in (
        (OLDER_DAEMON, REASON_OLDER_DAEMON),
        (NO_RECORD, REASON_NO_RECORD),
    ):
        ranks = [rank for rank, s in daemon_statuses if s.attach == attach]
        if ranks:
            add(reason, ranks)
    not_attached = [
        rank
        for rank, s in daemon_statuses
        if s.attach not in (ATTACHED, OLDER_DAEMON, NO_RECORD)
        or (s.attach == ATTACHED and not isinstance(s.version, int))
    ]
    if not_attached:
        add(REASON_NOT_ATTACHED, not_attached)
    versions = {s.version for _, s in daemon_statuses if s.attach == ATTACHED}
    if len(versions) > 1:
        reasons.append(f"{REASON_VERSIONS_DIFFER} ({sorted(versions, key=str)})")
    if reasons:
        return ModeDecision(Mode.OFF, tuple(reasons))
    (version,) = versions
    return ModeDecision(Mode.TWO_PHASE, version=version)


def _ranks_where(
    statuses: Sequence[RankLayoutStatus], predicate: Callable[[RankLayoutStatus], bool]
) -> list[int]:
    return [rank for rank, status in enumerate(statuses) if predicate(status)]


class BeginAction(enum.Enum):
    MOVE = "move"
    SKIP = "skip"  # some daemon is busy: stop this rebalance, the next interval retries
    DISABLE = "disable"  # some daemon refused: rebalancing off for good


@dataclass(frozen=True)
class BeginDecision:
    action: BeginAction
    reason: str = ""


def decide_begin(replies: Sequence[Mapping[str, Any]]) -> BeginDecision:
    """What every rank does with the all-gathered begin replies (index = world rank).

    A refusal is permanent, so it wins over busy; a reply that is neither ok nor busy (an error,
    a transport failure, a malformed reply) counts as a refusal.
    """
    refusals = [
        f"rank {rank}: {_status_of(reply)}: {_reason_of(reply)}"
        for rank, reply in enumerate(replies)
        if _status_of(reply) not in (messages.OK, messages.BUSY)
    ]
    if refusals:
        return BeginDecision(BeginAction.DISABLE, "; ".join(refusals))
    busy = [
        f"rank {rank}: {_reason_of(reply)}"
        for rank, reply in enumerate(replies)
        if _status_of(reply) == messages.BUSY
    ]
    if busy:
        return BeginDecision(BeginAction.SKIP, "; ".join(busy))
    return BeginDecision(BeginAction.MOVE)


@dataclass(frozen=True)
class CommitCheck:
    ok: bool
    version: int | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)


def check_commits(
    replies: Sequence[Mapping[str, Any]], *, base_version: int, engine_digest: str
) -> CommitCheck:
    """Did every daemon record this chunk at the same new version, with the engine's digest?

    ``engine_digest`` is the digest of the engine's own whole map after the move; each daemon's
    digest is compared with it, never the other way round.
    """
    problems: list[str] = []
    versions = set()
    for rank, reply in enumerate(replies):
        status = _status_of(reply)
        if status != messages.OK:
            problems.append(f"rank {rank}: commit {status}: {_reason_of(reply)}")
            continue
        version = reply.get("version")
        versions.add(version)
        if version != base_version + 1:
            problems.append(
                f"rank {rank}: daemon recorded version {version!r}, expected {base_version + 1}"
            )
        if reply.get("digest") != engine_digest:
            problems.append(
                f"rank {rank}: daemon digest {reply.get('digest')!r} differs from the engine's "
                f"{engine_digest}"
            )
    if len(versions) > 1:
        problems.append(f"daemons recorded different versions {sorted(versions, key=str)}")
    if problems:
        return CommitCheck(False, problems=tuple(problems))
    return CommitCheck(True, version=base_version + 1)


def _status_of(reply: Mapping[str, Any]) -> str:
    status = reply.get("status") if isinstance(reply, Mapping) else None
    return status if isinstance(status, str) else messages.ERROR


def _reason_of(reply: Mapping[str, Any]) -> str:
    if not isinstance(reply, Mapping):
        return f"malformed reply {reply!r}"
    return str(reply.get("reason") or reply.get("message"))


# ---------------------------------------------------------------- the hook ------------------


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


def rank_status(weights_from: str | None, session: Any) -> RankLayoutStatus:
    """This rank's status from the loader's weight source and the startup hook's session.

    ``session`` is ``engine_startup.EngineLayoutSession`` or None (startup did not attach).
    """
    from sglang_integration.startup_agreement import FindingKind

    if session is None:
        return RankLayoutStatus(weights_from, NOT_ATTACHED)
    if session.finding is FindingKind.OLDER_DAEMON:
        return RankLayoutStatus(weights_from, OLDER_DAEMON)
    if session.finding is FindingKind.NO_RECORD:
        return RankLayoutStatus(weights_from, NO_RECORD)
    if session.finding is FindingKind.RECORD and session.attached:
        return RankLayoutStatus(weights_from, ATTACHED, session.version)
    return RankLayoutStatus(weights_from, NOT_ATTACHED)


class DaemonClient:
    """``RankLayoutClient`` over ``sglang_integration.client``, for one daemon and engine id."""

    def __init__(self, socket_path: str, engine_id: str) -> None:
        self.socket_path = socket_path
        self.engine_id = engine_id

    def begin(self, base_version: int, layers: list[int]) -> dict[str, Any]:
        from sglang_integration import client

        return _summary(client.begin(self.socket_path, self.engine_id, base_version, layers))

    def commit(self, rows: dict[int, list[int]]) -> dict[str, Any]:
        from sglang_integration import client

        return _summary(client.commit(self.socket_path, self.engine_id, rows))

    def abort(self) -> dict[str, Any]:
        from sglang_integration import client

        return _summary(client.abort(self.socket_path, self.engine_id))


def _summary(reply: Any) -> dict[str, Any]:
    """A ``client.Reply`` as the small picklable dict the ranks all-gather."""
    summary: dict[str, Any] = {"status": reply.outcome.value, "reason": reply.reason}
    if reply.ok:
        for key in ("version", "digest"):
            if key in reply.body:
                summary[key] = reply.body[key]
    return summary


def _current_status_and_client() -> tuple[RankLayoutStatus, RankLayoutClient | None]:
    from sglang_integration.engine_startup import current_session
    from sglang_integration.weight_source import weight_source

    source = weight_source()
    session = current_session()
    status = rank_status(None if source is None else source.value, session)
    if status.attach != ATTACHED:
        return status, None
    return status, DaemonClient(session.socket_path, session.engine_id)


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
    """EPLBManager.rebalance (eplb_manager.py:115-185) without elastic EP, two-phase per chunk."""
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
    """One chunk: begin, move, synchronize, commit, verify. True if the next chunk may follow."""
    from sglang.srt.eplb import eplb_manager
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.model_executor.model_runner_components.moe_ep_setup import (
        init_lplb_solvers,
    )
    from sglang.srt.runtime_context import get_exec, get_parallel

    _, client = _current_status_and_client()
    base_version = state.version
    if client is None or base_version is None:
        raise RuntimeError("two-phase rebalance without a daemon client; this is a plugin bug")
    my_begin = _call(lambda: client.begin(base_version, chunk))
    decision = decide_begin(_all_gather(my_begin))
    if decision.action is not BeginAction.MOVE:
        _abort_own_begin(client, my_begin, chunk)
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
        return False

    # A failure inside the move propagates as in sglang: the daemons keep the move pending and
    # become dirty when this engine exits, which is right, since the bytes may be half moved.
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
    _device_synchronize()

    engine_map = get_global_expert_location_metadata().physical_to_logical_map_cpu.tolist()
    rows = {layer: [int(x) for x in engine_map[layer]] for layer in chunk}
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


def _abort_own_begin(
    client: RankLayoutClient, my_begin: Mapping[str, Any], chunk: list[int]
) -> None:
    """Abort this rank's begin when it succeeded, or when it may have landed (an error reply).

    busy and refused leave nothing pending; after an error the abort is a precaution whose
    refusal ("no move pending") is expected and not logged.
    """
    begin_status = _status_of(my_begin)
    if begin_status in (messages.BUSY, messages.REFUSED):
        return
    abort_reply = _call(client.abort)
    if begin_status == messages.OK and _status_of(abort_reply) != messages.OK:
        logger.error(
            "abort of the expert move of layers %s failed (%s); the daemon keeps the move "
            "pending and becomes dirty when this engine exits. %s",
            chunk,
            abort_reply.get("reason"),
            RESTART_DAEMONS_ADVICE,
        )


def _call(request: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one request; a transport failure becomes an error reply so the all-gather still runs."""
    try:
        reply = request()
    except Exception as exc:  # every rank must reach the all-gather that follows
        logger.warning("expert layout request failed: %s", exc)
        return {"status": messages.ERROR, "reason": f"request failed: {exc}"}
    if not isinstance(reply, dict):
        return {"status": messages.ERROR, "reason": f"malformed reply {reply!r}"}
    return reply


def _all_gather(value: Any) -> list[Any]:
    """All-gather a small object over sglang's world CPU (gloo) group; index = world rank."""
    from sglang.srt.runtime_context import get_parallel

    gathered: list[Any] = get_parallel().world_group.all_gather_object(value)
    return gathered


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
