"""Converging: an engine whose clean daemons hold different layouts starts on the newest one.

The decision is ``converge_decisions.plan_convergence``'s (pure, the same on every rank); this
module applies it, in two places of the engine's start:

- ``converge_at_startup`` (the startup hook, before the weights load): every rank asks its
  daemon who is attached and the ranks all-gather it; daemons that must reload get
  ``expert_layout_reload`` (all-gathered, checked: each must report the target's version and
  digest), then every rank reads its daemon again and plans again. What is left is a move: the
  engine routes with what the daemons hold (``ConvergeByMove``'s held map: each rank's local
  slots as its own daemon's map names them), and each rank's fetch declares its own daemon's
  version and digest (the held map agrees with that daemon's map on its local slots, which are
  all the daemon serves).
- ``move_after_load`` (the ``load_model`` hook, once the weights are mapped, before the content
  check): the daemons that move begin at their version the layers where their map differs from
  the target's, every rank runs sglang's own expert move (``ExpertLocationUpdater.update``: the
  P2P copy the rebalance runs, ``UPSTREAM_LINES``) from the held map to the target over the
  layers whose held rows differ, synchronizes, and those daemons commit the target's rows; each
  must report the target's version and digest. A refusal or a wrong reply fails startup on
  every rank, naming daemons, versions and the reason; a failure inside the move leaves the
  moves pending (the daemons become dirty when the engine exits: the bytes may be half moved).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.startup_verdict import (
    Decision,
    ExpertLayoutStartupError,
    FailStartup,
    FindingKind,
    RankFinding,
    decide,
    finding_from_layout,
)
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import client
from sglang_integration.engine.content_decisions import RankContent
from sglang_integration.engine.converge_decisions import (
    RESTART_HINT,
    ConvergeByMove,
    ConvergePlan,
    Way,
    check_steps,
    needs_convergence,
    plan_convergence,
    why_reload,
)
from sglang_integration.engine.finding_gather import gather_findings, world_gather
from sglang_integration.engine.reply_gather import all_gather_small
from sglang_integration.engine.startup_repair import StartupRank, read_content
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_UPDATER = "srt/eplb/expert_location_updater.py"
# The lines of sglang the move relies on (tests/test_upstream_lines.py checks them).
UPSTREAM_LINES = (
    UpstreamLine(_UPDATER, 42, "def update(", "sglang's move of experts between ranks"),
    UpstreamLine(
        _UPDATER,
        61,
        "old_expert_location_metadata = get_global_expert_location_metadata()",
        "it moves from the layout the engine routes with (the held map, adopted at startup)",
    ),
    UpstreamLine(
        _UPDATER,
        73,
        "old_expert_location_metadata.update(",
        "... and routes with the new one afterwards",
    ),
    UpstreamLine(
        "srt/model_executor/model_runner.py",
        711,
        "self.expert_location_updater = ExpertLocationUpdater()",
        "the runner's own updater exists before load_model",
    ),
)

# Plans at most this many times: once, and once more after the reloads.
_ROUNDS = 2


@dataclass
class PendingConvergence:
    """What the ``load_model`` hook needs to finish a convergence (kept on the session)."""

    plan: ConvergePlan
    model_config: Any
    moe_ep_rank: int


def converge_at_startup(
    world: Any,
    this: StartupRank,
    findings: list[RankFinding],
    contents: list[RankContent],
    *,
    num_local_slots: int,
    standby: bool,
) -> tuple[list[RankFinding], list[RankContent], Decision | ConvergeByMove]:
    """The findings, contents and decision after the reloads; a collective over ``world``.

    Called on every rank when ``needs_convergence(findings)``. A standby engine never changes
    its daemons: today's failure, saying so.
    """
    if standby:
        verdict = decide(findings)
        reason = verdict.reason if isinstance(verdict, FailStartup) else "they disagree"
        return findings, contents, FailStartup(f"{reason} A standby engine never changes them.")
    reloaded: set[int] = set()
    for _ in range(_ROUNDS):
        if not needs_convergence(findings):
            break
        attached = world.all_gather_object(_attached(this.socket_path))
        plan = plan_convergence(
            findings,
            attached,
            engine_id=this.engine_id,
            num_local_slots=num_local_slots,
            reloaded=sorted(reloaded),
        )
        if isinstance(plan, FailStartup):
            return findings, contents, plan
        if this.rank == 0:
            logger.warning(
                "The weight cache daemons hold different expert layouts; converging on version "
                "%d (digest %s), the newest: %s",
                plan.version,
                plan.digest[:12],
                plan.describe(),
            )
        reloads = plan.of_way(Way.RELOAD)
        if not reloads:
            return findings, contents, ConvergeByMove(plan)
        failure = _reload(world, plan, this, num_local_slots)
        if failure is not None:
            return findings, contents, failure
        reloaded |= {step.rank for step in reloads}
        findings, contents = _read_again(world, this, findings)
    return findings, contents, decide(findings)


def move_after_load(model: Any, pending: PendingConvergence, session: Any) -> None:
    """Begin, move, commit: the daemons that move reach the target; a collective over the world
    group. Raises ``ExpertLayoutStartupError`` on every rank when a daemon does not."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_integration.engine.rank_connection import rank_connection

    plan = pending.plan
    world = get_parallel().world_group
    step = plan.step_of(session.rank)
    connection = rank_connection(session.socket_path, session.engine_id)
    begin_moves(world, plan, session.rank, connection)
    _move(model, pending)
    committed = None
    if step.way is Way.MOVE:
        rows = {layer: plan.physical_to_logical_map[layer] for layer in step.layers}
        committed = _safely(lambda: connection.commit(rows)).trimmed()
    problems = check_steps(plan, Way.MOVE, all_gather_small(world, (session.rank, committed)))
    if problems:
        raise ExpertLayoutStartupError(_failure(plan, "the commit of the move", problems))
    session.version, session.digest = plan.version, plan.digest
    if session.rank == 0:
        logger.warning(
            "Converged the weight cache daemons on version %d (digest %s): moved layers %s of %s",
            plan.version,
            plan.digest[:12],
            list(plan.move_layers),
            ", ".join(f"rank {s.rank}" for s in plan.of_way(Way.MOVE)),
        )


def begin_moves(world: Any, plan: ConvergePlan, rank: int, connection: Any) -> None:
    """Every daemon that moves begins its layers; a collective over ``world``. When a begin is
    not granted anywhere, every rank fails with the reason, and each rank whose begin was
    granted aborts it first: its daemon would otherwise keep the move pending, and be dirty
    (its slots unknown) once the engine exits. ``connection``: this rank's kept connection."""
    step = plan.step_of(rank)
    begun = None
    if step.way is Way.MOVE:
        begun = _safely(lambda: connection.begin(step.version, list(step.layers))).trimmed()
    begins = all_gather_small(world, (rank, begun))
    problems = check_begins(plan, begins)
    if problems:
        if begun is not None and begun.ok:
            _safely(connection.abort)
        raise ExpertLayoutStartupError(_failure(plan, "the begin of the move", problems))


def check_begins(plan: ConvergePlan, replies: Sequence[tuple[int, Reply | None]]) -> list[str]:
    """Every daemon that moves granted its begin."""
    wanted = {step.rank: step for step in plan.of_way(Way.MOVE)}
    problems = []
    for rank, reply in sorted(replies, key=lambda pair: pair[0]):
        step = wanted.get(rank)
        if step is None or (reply is not None and reply.ok):
            continue
        what = "sent no begin" if reply is None else f"begin {reply.outcome.value}: {reply.reason}"
        problems.append(
            f"rank {rank} (daemon {step.socket_path}, at version {step.version}): {what}"
        )
    return problems


def _move(model: Any, pending: PendingConvergence) -> None:
    """sglang's own move from the held map (the metadata the engine routes with) to the target,
    over the layers whose held rows differ, then a device synchronize."""
    import torch
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.runtime_context import get_device, get_parallel

    from sglang_integration.engine.metadata import metadata_from_map

    plan = pending.plan
    layers = list(plan.move_layers)
    if not layers:
        return
    target = metadata_from_map(
        pending.model_config, plan.physical_to_logical_map, pending.moe_ep_rank
    )
    parallel = get_parallel()
    missing = ExpertLocationUpdater().update(
        model.routed_experts_weights_of_layer,
        target,
        update_layer_ids=layers,
        nnodes=parallel.nnodes,
        rank=parallel.tp_rank,
    )
    torch.get_device_module(get_device().device).synchronize()
    if missing:
        raise ExpertLayoutStartupError(
            f"sglang's move found no slot holding {missing}; this is a plugin bug. " + RESTART_HINT
        )


def _reload(
    world: Any, plan: ConvergePlan, this: StartupRank, num_local_slots: int
) -> FailStartup | None:
    step = plan.step_of(this.rank)
    reply = None
    if step.way is Way.RELOAD:
        logger.info(
            "Reloading the daemon at %s from version %d to version %d: %s",
            this.socket_path,
            step.version,
            plan.version,
            why_reload(plan, step, num_local_slots),
        )
        reply = _small(
            _safely(
                lambda: client.reload(
                    this.socket_path,
                    this.engine_id,
                    base_version=step.version,
                    version=plan.version,
                    digest=plan.digest,
                    physical_to_logical_map=plan.physical_to_logical_map,
                )
            )
        )
    problems = check_steps(plan, Way.RELOAD, world.all_gather_object((this.rank, reply)))
    if not problems:
        return None
    return FailStartup(_failure(plan, "the reload", problems))


def _read_again(
    world: Any, this: StartupRank, findings: list[RankFinding]
) -> tuple[list[RankFinding], list[RankContent]]:
    """Every rank's finding and content after the reloads (all-gathered)."""
    mine = next(f for f in findings if f.rank == this.rank)
    reply = _safely(lambda: client.query(this.socket_path))
    if reply.ok and reply.layout is not None:
        finding = finding_from_layout(
            reply.layout,
            rank=this.rank,
            socket_path=this.socket_path,
            initial_digest=mine.initial_digest,
        )
    else:
        finding = RankFinding(
            this.rank,
            FindingKind.UNREADABLE,
            this.socket_path,
            mine.initial_digest,
            reason=f"query {reply.outcome.value}: {reply.reason}",
        )
    content = read_content(this.socket_path, finding, rank=this.rank, mode=this.mode)
    gathered = gather_findings(world_gather(world), finding, content)
    return gathered.findings, gathered.contents


def _attached(socket_path: str) -> tuple[str, ...]:
    """The engines attached to this rank's daemon now (none known: an empty tuple, which the
    plan reads as not alone)."""
    reply = _safely(lambda: client.query(socket_path))
    if not reply.ok or reply.layout is None:
        return ()
    return tuple(reply.layout.attached)


def _failure(plan: ConvergePlan, what: str, problems: list[str]) -> str:
    return (
        f"converging the weight cache daemons on version {plan.version} (digest "
        f"{plan.digest[:12]}, the newest any of them committed) failed at {what}: "
        + "; ".join(problems)
        + ". "
        + RESTART_HINT
    )


def _small(reply: Reply) -> Reply:
    """A reload reply with only what the check reads (its layout's version and digest)."""
    if reply.ok and reply.layout is not None:
        return Reply(
            Outcome.OK, None, {"version": reply.layout.version, "digest": reply.layout.digest}
        )
    return reply.trimmed()


def _safely(request: Any) -> Reply:
    """A request's reply, or an ``error`` one (every rank must reach the all-gather)."""
    try:
        reply: Reply = request()
    except Exception as exc:
        logger.exception("A convergence request to the weight cache daemon failed")
        return Reply(Outcome.ERROR, f"{type(exc).__name__}: {exc}")
    return reply
