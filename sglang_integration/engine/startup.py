"""The hook on ``ModelRunner.maybe_init_expert_location_metadata``: start from the daemons' layout.

sglang's ``ModelRunner.initialize`` calls the target before ``load_model``; the original builds
the engine's initial expert-location metadata and the expert distribution recorder. With the
weight cache on (``--weight-cache-mode client|daemon``) and a model with routed experts, the
hook then has every rank attach to its own daemon, agree with the others on the daemons'
layout, and route with it (``start_from_daemon_layout``), or fail on every rank with the
reason. Dense models, draft workers and the weight cache off run the original untouched.

Every sglang internal the hook reads is read here (``UPSTREAM_LINES``, ``_expert_rank``,
``daemon_socket_path``, ``_world_group``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.content import ExpertContents
from layout_ledger.core.layout import layout_digest
from layout_ledger.core.startup_verdict import (
    AdoptLayout,
    Decision,
    ExpertLayoutStartupError,
    FailStartup,
    FindingKind,
    KeepInitialLayout,
    RankFinding,
    decide,
    finding_from_layout,
)
from layout_ledger.wire.protocol import LayoutView, Outcome
from sglang_integration.engine import client
from sglang_integration.engine.converge import PendingConvergence, converge_at_startup
from sglang_integration.engine.converge_decisions import ConvergeByMove, needs_convergence
from sglang_integration.engine.finding_gather import gather_findings, world_gather
from sglang_integration.engine.rebalance_agent import create_group
from sglang_integration.engine.startup_repair import StartupRank, read_content, settle
from sglang_integration.settings import ROLE, ROLE_ACTIVE, ROLE_STANDBY, WAIT_TIMEOUT, content_check
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

# Register with HookType.AROUND and ``around_maybe_init_expert_location_metadata`` (the plugin).
HOOK_TARGET = (
    "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_expert_location_metadata"
)

_RUNNER = "srt/model_executor/model_runner.py"
# The lines of sglang this hook relies on (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(
        _RUNNER, 708, "self.maybe_init_expert_location_metadata()", "initialize calls the target"
    ),
    UpstreamLine(_RUNNER, 715, "self.load_model()", "... before it loads the weights"),
    UpstreamLine(
        _RUNNER,
        795,
        "if get_exec().moe.enable_eplb and (not self.is_draft_worker)",
        "an EPLBManager (so a rebalance, so the agents' group) only with --enable-eplb",
    ),
    UpstreamLine(
        _RUNNER, 753, "def maybe_init_expert_location_metadata(self", "the target, run first"
    ),
    UpstreamLine(
        _RUNNER,
        756,
        "expert_rank = get_parallel().moe_ep_rank + (",
        "the expert rank the original passes to the metadata, repeated by _expert_rank",
    ),
    UpstreamLine(
        "srt/weight_cache/ipc_loader.py",
        458,
        "if self.socket_path is None:",
        "the IPC loader's socket rule, repeated by daemon_socket_path: the configured one...",
    ),
    UpstreamLine(
        "srt/weight_cache/ipc_loader.py",
        460,
        "self.socket_path = get_socket_path(device_uuid)",
        "... else sglang's path for the GPU's device UUID",
    ),
    UpstreamLine(
        "srt/model_loader/loader.py",
        4291,
        "socket_path=load_config.weight_cache_socket,",
        "the configured socket is --weight-cache-socket",
    ),
)

# How often a waiting rank asks its daemon again.
POLL_INTERVAL = 0.5


@dataclass
class EngineLayoutSession:
    """This rank's standing with its daemon after startup; read by the loader and rebalance hooks.

    ``attachment`` is open exactly when this rank's daemon keeps a record and the engine
    started; ``version`` and ``digest`` describe the layout the engine routes with (version 0,
    the engine's own digest, when it kept its initial layout).
    """

    engine_id: str
    rank: int
    socket_path: str
    finding: FindingKind
    attachment: client.Attachment | None
    version: int
    digest: str
    # What every logical expert's slot must hold (None: no content check, see startup_repair),
    # and this rank's local physical slots, for the check after the weights are loaded.
    expected_content: ExpertContents | None = None
    first_slot: int = 0
    num_local_slots: int = 0
    # The role this rank's daemon recorded for the attach (``engine.standby``): ``standby`` only
    # when the engine asked for it and the daemon knows roles.
    role: str = ROLE_ACTIVE
    # Daemons at different layouts this engine brings to the newest once its weights are loaded
    # (``converge.move_after_load``, from the ``load_model`` hook); None once they agree.
    converge: PendingConvergence | None = None

    @property
    def attached(self) -> bool:
        return self.attachment is not None and self.attachment.is_open


class _ThisRank:
    """The process-wide session (one engine rank per process); it holds the attach connection."""

    session: EngineLayoutSession | None = None


def current_session() -> EngineLayoutSession | None:
    """This rank's session, or None (weight cache off, dense model, or startup not run)."""
    return _ThisRank.session


def close_session() -> None:
    """Detach from the daemon now and forget the session (an engine detaches by exiting)."""
    from sglang_integration.engine.rebalance_agent import shut_down
    from sglang_integration.engine.standby import close_gate

    close_gate()
    shut_down()  # the rebalance agent, its kept connection and its group
    session, _ThisRank.session = _ThisRank.session, None
    if session is not None and session.attachment is not None:
        session.attachment.close()


def around_maybe_init_expert_location_metadata(
    original_fn: Callable[[Any], Any], runner: Any
) -> None:
    """AROUND hook body for ``ModelRunner.maybe_init_expert_location_metadata`` (HOOK_TARGET)."""
    original_fn(runner)
    if runner.is_draft_worker:
        return
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.runtime_context import get_model

    if get_model().weight_cache_mode == "off":
        return
    metadata = get_global_expert_location_metadata()
    if metadata is None:
        return  # a model without routed experts: nothing to lay out
    start_from_daemon_layout(
        model_config=runner.model_config,
        metadata=metadata,
        moe_ep_rank=_expert_rank(),
        socket_path=daemon_socket_path(runner.gpu_id),
    )


def start_from_daemon_layout(
    *, model_config: Any, metadata: Any, moe_ep_rank: int, socket_path: str
) -> EngineLayoutSession:
    """This rank's start from its daemon's layout; a collective over the world group.

    1. rank 0 makes a fresh engine id and broadcasts it over the world CPU group (one id per
       engine start, shared by all ranks, unique: a uuid; the host and pid in it are only for
       people reading the daemon's ledger; one broadcast of ``ENGINE_ID_BYTES``); with
       ``--enable-eplb`` (sglang's ``EPLBManager``, whose rebalances the agents serve) every
       rank then makes the rebalance agents' gloo group (``rebalance_agent.create_group``);
    2. each rank attaches to its own daemon at the socket path the IPC loader will use, and
       keeps the attach connection open for the engine's lifetime (the session holds it);
    3. if another engine's move is pending there, it polls ``expert_layout_query`` until the
       move ends, for at most ``settings.WAIT_TIMEOUT`` seconds (``read_daemon``);
    4. with the content check on, it asks its daemon for its slots' content
       (``startup_repair.read_content``);
    5. the ranks all-gather what they found, what the decision needs
       (``finding_gather.gather_findings``: versions and digests; a map only where daemons
       disagree, the slots' current content only where one is dirty), and all compute the same
       ``layout_ledger.core.startup_verdict.decide``; clean daemons at different layouts are
       brought to the newest (``converge.converge_at_startup``: reloads now, a move once the
       weights are loaded, ``converge.move_after_load``); then ``startup_repair.settle``: daemons an
       engine left mid-move are repaired when their slots hold whole experts of a valid layout
       (one more all-gather, of the repair replies), and every expert's expected fingerprint is
       kept for the check after the weights are loaded (``load_check``);
    6. the rank adopts the daemons' map (``metadata.adopt_map``: sglang's ``init_by_mapping``
       of it, copied into the engine's metadata in place; one log line naming the version),
       keeps the initial layout, or raises ``ExpertLayoutStartupError`` with the reason, as
       every rank does. The engine's initial map is read from its metadata once (its digest
       for the attach, the comparison in ``adopt_map``).

    A daemon that answers the attach with "Unknown request type" (sglang without this plugin)
    keeps no record: the engine starts with its own layout, logs one warning, and its shared
    weights are never rebalanced (``current_session().finding`` says why, for the rebalance
    hook).
    """
    from sglang_integration.engine.metadata import map_of

    world = _world_group()
    rank = world.rank_in_group
    engine_id = _shared_engine_id(world)
    if _rebalances():
        # The rebalance agents' own gloo group, after sglang's: made where the broadcast has
        # just brought every rank together, so no rank waits long for another to join it.
        create_group(world)
    initial_map = map_of(metadata)
    initial_digest = layout_digest(initial_map)
    this = StartupRank(
        rank=rank,
        socket_path=socket_path,
        engine_id=engine_id,
        mode=content_check(),
        initial_map=initial_map,
        engine_shape=_engine_shape(metadata),
    )
    asked_role = ROLE.read()
    finding, attachment = read_daemon(
        socket_path, engine_id, rank=rank, initial_digest=initial_digest, role=asked_role
    )
    role = _granted_role(asked_role, attachment)
    content = read_content(socket_path, finding, rank=rank, mode=this.mode)
    gathered = gather_findings(world_gather(world), finding, content, role)
    findings, contents = gathered.findings, gathered.contents
    local = int(metadata.num_local_physical_experts)
    try:
        first: Decision | ConvergeByMove = decide(findings)
        if needs_convergence(findings):
            findings, contents, first = converge_at_startup(
                world,
                this,
                findings,
                contents,
                num_local_slots=local,
                standby=asked_role == ROLE_STANDBY,
            )
        decision, expected = settle(world, first, findings, contents, this)
        version, digest = _apply(
            decision,
            model_config=model_config,
            metadata=metadata,
            moe_ep_rank=moe_ep_rank,
            initial_map=initial_map,
            initial_digest=initial_digest,
        )
    except BaseException:
        if attachment is not None:
            attachment.close()
        raise
    session = EngineLayoutSession(
        engine_id=engine_id,
        rank=rank,
        socket_path=socket_path,
        # a repaired daemon keeps a clean record again
        finding=FindingKind.RECORD if finding.kind is FindingKind.DIRTY else finding.kind,
        attachment=attachment if attachment is not None and attachment.is_open else None,
        version=version,
        digest=digest,
        expected_content=expected,
        first_slot=moe_ep_rank * local,
        num_local_slots=local,
        role=role,
        converge=PendingConvergence(decision.plan, model_config, moe_ep_rank)
        if isinstance(decision, ConvergeByMove)
        else None,
    )
    _ThisRank.session = session
    if asked_role == ROLE_STANDBY and session.attached:
        from sglang_integration.engine.standby import start_standby

        start_standby(
            session=session,
            world=world,
            roles=gathered.extras,
            model_config=model_config,
            metadata=metadata,
            moe_ep_rank=moe_ep_rank,
            initial_map=initial_map,
        )
    return session


def _granted_role(asked: str, attachment: client.Attachment | None) -> str:
    """The role the daemon recorded: ``standby`` only when asked for and named in the reply (a
    daemon from before roles names none: the engine is active there)."""
    from layout_ledger.wire.protocol import reply_role

    if asked != ROLE_STANDBY or attachment is None or not attachment.reply.ok:
        return ROLE_ACTIVE
    return reply_role(attachment.reply.body) or ROLE_ACTIVE


def _apply(
    decision: Decision | ConvergeByMove,
    *,
    model_config: Any,
    metadata: Any,
    moe_ep_rank: int,
    initial_map: list[list[int]],
    initial_digest: str,
) -> tuple[int, str]:
    """Act on the decision on this rank: raise, adopt the map or keep the initial one."""
    from sglang_integration.engine.metadata import adopt_map

    if isinstance(decision, FailStartup):
        raise ExpertLayoutStartupError(decision.reason)
    if isinstance(decision, ConvergeByMove):
        plan = decision.plan
        adopt_map(model_config, plan.held_map, moe_ep_rank, metadata, current_map=initial_map)
        own = plan.step_of(_world_group().rank_in_group)
        logger.info(
            "Routing with what the weight cache daemons hold (this rank's daemon at version %d, "
            "digest %s) until the move to version %d once the weights are loaded",
            own.version,
            own.digest[:12],
            plan.version,
        )
        return own.version, own.digest
    if isinstance(decision, AdoptLayout):
        changed = adopt_map(
            model_config,
            decision.physical_to_logical_map,
            moe_ep_rank,
            metadata,
            current_map=initial_map,
        )
        logger.info(
            "Routing with the weight cache daemon's expert layout at version %d "
            "(digest %s, %s the engine's initial layout)",
            decision.version,
            decision.digest[:12],
            "replacing" if changed else "equal to",
        )
        return decision.version, decision.digest
    _log_kept_initial(decision, _world_group().rank_in_group)
    return 0, initial_digest


def _engine_shape(metadata: Any) -> tuple[int, int, int]:
    shape = tuple(metadata.physical_to_logical_map_cpu.shape)
    return int(shape[0]), int(shape[1]), int(metadata.num_logical_experts)


def read_daemon(
    socket_path: str,
    engine_id: str,
    *,
    rank: int,
    initial_digest: str,
    wait_timeout: float | None = None,
    poll_interval: float = POLL_INTERVAL,
    role: str | None = None,
) -> tuple[RankFinding, client.Attachment | None]:
    """Attach and wait out another engine's move; never raises (a failure is a finding).

    Returns the finding and the attachment (its connection still open when the daemon accepted
    it). A RECORD finding's map hashes to its digest (checked here).
    """

    def found(kind: FindingKind, reason: str | None) -> RankFinding:
        return RankFinding(
            rank=rank,
            kind=kind,
            socket_path=socket_path,
            initial_digest=initial_digest,
            reason=reason,
        )

    attachment: client.Attachment | None = None
    try:
        timeout = WAIT_TIMEOUT.read() if wait_timeout is None else wait_timeout
        attachment = client.attach(
            socket_path, engine_id, role=None if role in (None, ROLE_ACTIVE) else role
        )
        reply = attachment.reply
        kind = _KIND_OF_ATTACH_OUTCOME.get(reply.outcome)
        if kind is not None:
            return found(kind, reply.reason), attachment
        if reply.outcome is not Outcome.OK or reply.layout is None:
            reason = f"attach {reply.outcome.value}: {reply.reason}"
            return found(FindingKind.UNREADABLE, reason), attachment
        layout = _wait_for_pending_move(socket_path, reply.layout, timeout, poll_interval)
        if role == ROLE_STANDBY and not isinstance(layout, _WaitFailure):
            from sglang_integration.engine.standby import lease_at_startup

            # A standby starts holding its lease (a mover's begins are busy while it loads the
            # weights); it releases it once idle (engine.standby).
            layout = lease_at_startup(socket_path, engine_id, reply, layout, timeout) or layout
    except Exception as exc:  # every rank must reach the all-gather
        logger.exception("Reading the expert layout of the daemon at %s failed", socket_path)
        reason = f"{type(exc).__name__}: {exc}"
        return found(FindingKind.UNREADABLE, reason), attachment
    if isinstance(layout, _WaitFailure):
        return found(layout.kind, layout.reason), attachment
    finding = finding_from_layout(
        layout,
        rank=rank,
        socket_path=socket_path,
        initial_digest=initial_digest,
        still_pending=f" after {timeout:g} s ({WAIT_TIMEOUT.env})",
    )
    return finding, attachment


_KIND_OF_ATTACH_OUTCOME = {
    Outcome.NO_DAEMON: FindingKind.NO_DAEMON,
    Outcome.NO_RECORD: FindingKind.NO_RECORD,
    Outcome.OLDER_DAEMON: FindingKind.OLDER_DAEMON,
}


@dataclass(frozen=True)
class _WaitFailure:
    kind: FindingKind
    reason: str


def _wait_for_pending_move(
    socket_path: str, layout: LayoutView, timeout: float, poll_interval: float
) -> LayoutView | _WaitFailure:
    """The daemon's layout once no move is pending (or it is dirty, or the wait timed out:
    then still pending), else a failure to read it."""
    if layout.pending is None or layout.dirty:
        return layout
    pending = layout.pending
    logger.info(
        "Engine %r is moving layers %s of the daemon at %s (from version %d); waiting up to "
        "%g s (%s) for the move to end",
        pending.engine_id,
        list(pending.layers),
        socket_path,
        pending.base_version,
        timeout,
        WAIT_TIMEOUT.env,
    )
    deadline = time.monotonic() + timeout
    while layout.pending is not None and not layout.dirty:
        pending = layout.pending
        if time.monotonic() >= deadline:
            return layout
        time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))
        reply = client.query(socket_path)
        if reply.outcome is not Outcome.OK or reply.layout is None:
            return _WaitFailure(
                FindingKind.UNREADABLE,
                f"while waiting for engine {pending.engine_id!r}'s move: query "
                f"{reply.outcome.value}: {reply.reason}",
            )
        layout = reply.layout
    logger.info(
        "The pending move on the daemon at %s ended (version %d)", socket_path, layout.version
    )
    return layout


def daemon_socket_path(gpu_id: int) -> str:
    """The socket the IPC loader connects to (its rule, ``UPSTREAM_LINES``)."""
    from sglang.srt.runtime_context import get_model

    configured = get_model().weight_cache_socket
    if configured is not None:
        return str(configured)
    from sglang.srt.platforms import current_platform
    from sglang.srt.weight_cache.protocol import get_socket_path

    return str(get_socket_path(current_platform.get_device_uuid(int(gpu_id))))


def _expert_rank() -> int:
    """The ``moe_ep_rank`` the original passes to the metadata (``UPSTREAM_LINES``)."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    parallel = get_parallel()
    offset = parallel.ep_join_rank_offset if get_exec().moe.is_ep_scale_joiner else 0
    return int(parallel.moe_ep_rank + offset)


def _rebalances() -> bool:
    """Whether sglang runs an ``EPLBManager``, whose rebalances the agents serve: only with
    ``--enable-eplb`` (``UPSTREAM_LINES``); a draft worker never reaches the hook's body."""
    from sglang.srt.runtime_context import get_exec

    return bool(get_exec().moe.enable_eplb)


def _world_group() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().world_group


# The engine id's bytes on the wire: room for "engine-", a 64-character host name (Linux's
# HOST_NAME_MAX), a pid and 16 hex digits; zeros after the id.
ENGINE_ID_BYTES = 128


def new_engine_id() -> str:
    """A fresh engine id: unique by its uuid; the host and pid are for people reading a ledger."""
    return f"engine-{socket.gethostname()[:64]}-{os.getpid()}-{uuid.uuid4().hex[:16]}"


def _shared_engine_id(world: Any) -> str:
    """A new id made on the world group's first rank and broadcast to the others: one
    collective of ``ENGINE_ID_BYTES`` bytes (``broadcast_object_list`` makes two, its sizes then
    its pickles)."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(ENGINE_ID_BYTES, dtype=torch.uint8)
    if world.rank_in_group == 0:
        encoded = new_engine_id().encode()[:ENGINE_ID_BYTES]
        buffer[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    if world.world_size > 1:
        dist.broadcast(buffer, src=world.ranks[0], group=world.cpu_group)
    raw = bytes(buffer.tolist()).rstrip(b"\0")
    try:
        engine_id = raw.decode()
    except UnicodeDecodeError:
        engine_id = ""
    if not engine_id:
        raise ExpertLayoutStartupError(f"rank 0 broadcast no engine id ({raw!r})")
    return engine_id


def _log_kept_initial(decision: KeepInitialLayout, rank: int) -> None:
    if rank != 0:
        return
    kinds = {f.kind for f in decision.without_record}
    listed = "; ".join(f.describe() for f in decision.without_record)
    if kinds & {FindingKind.OLDER_DAEMON, FindingKind.NO_RECORD}:
        logger.warning(
            "Starting with this engine's own initial expert layout: some weight cache daemons "
            "keep no expert layout record (%s). Experts in weights shared through these "
            "daemons will not be rebalanced.",
            listed,
        )
    else:
        logger.info("Starting with this engine's own initial expert layout (%s)", listed)
