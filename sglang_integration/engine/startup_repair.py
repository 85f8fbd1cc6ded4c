"""The content round of engine startup: ask each daemon for its slots' content, repair, expect.

The startup hook (``startup``) calls ``read_content`` and ``settle`` on every rank, with the
world group it uses; the decisions themselves are ``content_decisions``'. A daemon from before
content checks (``Unknown request type``), one with the content check off, or one without
expert tensors: no check and no repair, one warning on the first rank; startup as before. An
engine that keeps its initial layout because some daemon keeps no layout record at all (it
warned about that already) checks no content either.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.content import ExpertContents, LocalFingerprints
from layout_ledger.core.layout import Map
from layout_ledger.core.startup_verdict import (
    AdoptLayout,
    Decision,
    FailStartup,
    FindingKind,
    KeepInitialLayout,
    RankFinding,
)
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import client
from sglang_integration.engine.content_decisions import (
    ContentKind,
    NoContentCheck,
    RankContent,
    RepairPlan,
    expected_contents,
    plan_repair,
)
from sglang_integration.engine.converge_decisions import ConvergeByMove
from sglang_integration.engine.rebalance_decisions import check_commits
from sglang_integration.settings import ContentCheck

logger = logging.getLogger(__name__)

_ASKED = (FindingKind.RECORD, FindingKind.DIRTY)
_KIND_OF_OUTCOME = {
    Outcome.NO_RECORD: ContentKind.NOT_RECORDED,
    Outcome.OLDER_DAEMON: ContentKind.OLDER_DAEMON,
}


@dataclass(frozen=True)
class StartupRank:
    """What the content round needs of this rank's startup."""

    rank: int
    socket_path: str
    engine_id: str
    mode: ContentCheck
    initial_map: Map
    engine_shape: tuple[int, int, int]  # layers, physical slots per layer, logical experts


def read_content(
    socket_path: str, finding: RankFinding, *, rank: int, mode: ContentCheck
) -> RankContent:
    """This rank's daemon's content (never raises: a failure is a finding).

    A rank whose daemon keeps a record (clean or dirty) sends it ``expert_layout_content_check``;
    the daemon fingerprints its slots now and answers with what it recorded and what it found
    (``protocol.ContentView``). The ranks then all-gather it with their layout findings.
    """
    if mode is ContentCheck.OFF or finding.kind not in _ASKED:
        return RankContent(rank, ContentKind.NOT_ASKED)
    try:
        reply = client.content_check(socket_path)
    except Exception as exc:  # every rank must reach the all-gather
        logger.exception("Reading the slot content of the daemon at %s failed", socket_path)
        return RankContent(rank, ContentKind.UNREADABLE, f"{type(exc).__name__}: {exc}")
    if reply.ok and reply.content is not None:
        return RankContent(rank, ContentKind.CONTENT, view=reply.content)
    kind = _KIND_OF_OUTCOME.get(reply.outcome, ContentKind.UNREADABLE)
    return RankContent(rank, kind, f"{reply.outcome.value}: {reply.reason}")


def settle(
    world: Any,
    decision: Decision | ConvergeByMove,
    findings: list[RankFinding],
    contents: list[RankContent],
    this: StartupRank,
) -> tuple[Decision | ConvergeByMove, ExpertContents | None]:
    """The startup decision after the content round, and the experts' expected contents.

    A daemon whose check found content that moved without a commit fails startup. Daemons that
    an engine left mid-move are repaired when ``content_decisions.plan_repair`` derives a valid
    layout from the slots' content: every rank sends its daemon ``expert_layout_repair`` (the
    derived rows of the pending layers and that daemon's fingerprints of them), the ranks
    all-gather the replies, and every daemon must report the new version and the digest of the
    engine's own repaired map (as after a commit), else every rank fails. Last, every logical
    expert's expected fingerprint, for the check after the weights are loaded (``load_check``).

    A collective over ``world`` when a repair is tried; every rank reaches the same result.
    """
    if this.mode is ContentCheck.OFF:
        return decision, None
    moved = _moved_without_commit(contents)
    if moved is not None:
        return moved, None
    extra: dict[int, LocalFingerprints] | None = None
    if isinstance(decision, FailStartup):
        plan = plan_repair(findings, contents, decision, this.engine_shape)
        if isinstance(plan, FailStartup):
            return plan, None
        decision = _repair(world, plan, this)
        extra = {
            rank: LocalFingerprints(_first_slot(contents, rank), _as_tuples(prints))
            for rank, prints in plan.fingerprints.items()
        }
    if isinstance(decision, FailStartup):
        return decision, None
    the_map = this.initial_map
    if isinstance(decision, AdoptLayout):
        the_map = decision.physical_to_logical_map
    elif isinstance(decision, ConvergeByMove):
        # What the daemons hold now: each daemon's record names its own local slots so.
        the_map = decision.plan.held_map
    return _expected(decision, contents, the_map, extra, this.rank)


def _moved_without_commit(contents: list[RankContent]) -> FailStartup | None:
    """A clean daemon whose content check just found moved content is dirty now."""
    found = [
        f"rank {c.rank}: {c.view.dirty_reason}"
        for c in contents
        if c.view is not None and c.view.dirty and c.view.dirty_move is None
    ]
    if not found:
        return None
    return FailStartup(
        "a weight cache daemon's slots do not hold what its layout record says: "
        + "; ".join(found)
        + ". Restart the weight cache daemons (they reload the weights from disk), then start "
        "the engine again."
    )


def _repair(world: Any, plan: RepairPlan, this: StartupRank) -> AdoptLayout | FailStartup:
    rank, socket_path = this.rank, this.socket_path
    try:
        reply = client.repair(
            socket_path,
            this.engine_id,
            plan.rows,
            plan.fingerprints.get(rank, {}),
            expected_fingerprints=plan.expected.get(rank, {}),
        ).trimmed()
    except Exception as exc:  # every rank must reach the all-gather
        logger.exception("Repairing the layout of the daemon at %s failed", socket_path)
        reply = Reply(Outcome.ERROR, f"{type(exc).__name__}: {exc}")
    replies = world.all_gather_object(reply)
    check = check_commits(replies, base_version=plan.base_version, engine_digest=plan.digest)
    if not check.ok:
        return FailStartup(
            "repairing the weight cache daemons' expert layout failed: "
            + "; ".join(check.problems)
            + ". Restart the weight cache daemons (they reload the weights from disk), then "
            "start the engine again."
        )
    if rank == 0:
        logger.warning(
            "Repaired the expert layout of the weight cache daemons that engine %r left "
            "mid-move: the slots of layers %s hold whole experts, recorded as version %d "
            "(digest %s); no daemon restart needed",
            plan.mover,
            list(plan.layers),
            plan.base_version + 1,
            plan.digest[:12],
        )
    return AdoptLayout(plan.base_version + 1, plan.digest, plan.physical_to_logical_map)


def _expected(
    decision: Decision | ConvergeByMove,
    contents: list[RankContent],
    the_map: Map,
    extra: dict[int, LocalFingerprints] | None,
    rank: int,
) -> tuple[Decision | ConvergeByMove, ExpertContents | None]:
    if isinstance(decision, KeepInitialLayout):
        # Some daemon keeps no layout record (the startup hook warned once): no content check.
        return decision, None
    expected = expected_contents(contents, the_map, extra=extra)
    if isinstance(expected, FailStartup):
        return expected, None
    if isinstance(expected, NoContentCheck):
        if rank == 0:
            logger.warning(
                "Starting without the expert content check: some weight cache daemons record "
                "no slot fingerprints (%s); the engine cannot confirm that each slot holds the "
                "expert its layout names",
                "; ".join(expected.reasons),
            )
        return decision, None
    return decision, expected


def _first_slot(contents: list[RankContent], rank: int) -> int:
    (view,) = [c.view for c in contents if c.rank == rank and c.view is not None]
    return view.first_slot


def _as_tuples(prints: dict[int, list[str]]) -> dict[int, tuple[str, ...]]:
    return {layer: tuple(values) for layer, values in prints.items()}
