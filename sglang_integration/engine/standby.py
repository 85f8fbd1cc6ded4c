"""A warm standby's forward passes: no batch runs without a lease on every rank's daemon.

An engine started with ``SGLANG_EXPERT_LAYOUT_ROLE=standby`` attaches to its daemons without a
lease (docs/protocol.md "Roles and leases"), so the active engine keeps moving experts while it
is attached. Before each forward pass (the hook on ``ModelRunner.forward``, ``HOOK_TARGET``) the
standby's ``StandbyGate`` makes sure this rank holds its lease and routes with its daemon's
current map:

- **held**: a flag check (and a clock read for the idle timer);
- **first acquisition** (and after a move changed a daemon, or a daemon turned dirty): every
  rank asks its daemon for a lease, the ranks all-gather the grants; all granted: each rank
  reads its daemon's map, the ranks agree on it as at startup (same version and digest on every
  rank, ``startup_verdict.decide``), and each updates its ``ExpertLocationMetadata`` in place
  for the layers that changed (``standby_metadata``); any rank not granted (``busy``: a move is
  pending): the granted ranks release and all retry together, until ``SGLANG_EXPERT_LAYOUT_WAIT
  _TIMEOUT``, then every rank raises naming the mover; a dirty daemon: what startup does
  (``startup_repair.settle``: repair, or fail on every rank with startup's reason);
- **after an idle release**: each rank asks for its lease again on its own; granted at the
  version it routes with, it runs the batch (no collective: while any rank of this engine held
  its lease, no move could begin on every daemon, so no daemon of this engine moved); a daemon
  that moved meanwhile means every daemon's move began, which needs every rank's lease released,
  so every rank is here and takes the collective path above; ``busy``: wait and retry alone.

Leases end when serving ends: a rank that ran no forward pass for
``SGLANG_EXPERT_LAYOUT_STANDBY_IDLE`` seconds releases its lease on its own (a thread per rank).
While it holds none, a second thread follows its daemon (a query every ``FOLLOW_INTERVAL``
seconds) and builds the metadata of the newest map off the forward path (``prepared``), so the
first forward pass after a failover only copies the changed layers in; a map it has not
prepared yet is built on the forward path (scripts/bench_standby.py measures both).

The collectives run on a gloo group of their own, created at startup with a timeout a little
longer than the wait timeout, so a rank can never wait in one for ever: the one history the
argument above does not cover (a mover killed between its begins on different daemons while
some ranks of this engine still hold their lease) ends with a loud error instead of a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.layout import Map, layout_digest
from layout_ledger.core.startup_verdict import (
    AdoptLayout,
    ExpertLayoutStartupError,
    FailStartup,
    FindingKind,
    KeepInitialLayout,
    RankFinding,
    decide,
    finding_from_layout,
)
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine import client
from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

# Register with HookType.AROUND and ``around_forward`` (the plugin).
HOOK_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"

_RUNNER = "srt/model_executor/model_runner.py"
# The lines of sglang this hook relies on (tests/test_upstream_lines.py checks them): every batch
# crosses ModelRunner.forward, CUDA-graph replay included, on the scheduler's thread.
UPSTREAM_LINES = (
    UpstreamLine(_RUNNER, 1813, "def forward(", "the target"),
    UpstreamLine(_RUNNER, 1860, "output = self._forward_raw(", "forward runs the batch here"),
    UpstreamLine(
        _RUNNER,
        2007,
        "ret = self.decode_cuda_graph_runner.execute(",
        "CUDA-graph replay is inside _forward_raw, so inside forward",
    ),
    UpstreamLine(
        _RUNNER,
        1898,
        "self.eplb_manager.on_forward_pass_end()",
        "a standby's own rebalance runs inside forward, while its lease is held",
    ),
    UpstreamLine(
        "srt/managers/tp_worker.py",
        675,
        "out = self.model_runner.forward(",
        "every generation batch (overlap scheduling included) calls forward",
    ),
    UpstreamLine(
        "srt/managers/scheduler.py",
        4704,
        "batch_result = self.model_worker.forward_batch_generation(",
        "the overlap scheduler launches batches on its forward stream, same thread",
    ),
    UpstreamLine(
        "srt/eplb/expert_location.py",
        312,
        "def update(",
        "ExpertLocationMetadata.update ...",
    ),
    UpstreamLine(
        "srt/eplb/expert_location.py",
        339,
        "self_field[...] = torch.where(mask_update, other_field, self_field)",
        "... writes every field in place: the tensors keep their addresses",
    ),
)

# How often a rank asks again while a move is pending.
POLL_INTERVAL = 0.05
# Seconds the gate's gloo group waits in a collective beyond the wait timeout.
COLLECTIVE_SLACK = 60.0
# How often an idle standby rank looks for a newer map to prepare off the forward path.
FOLLOW_INTERVAL = 1.0


@dataclass(frozen=True)
class _Grant:
    """One rank's lease outcome, small enough to all-gather."""

    rank: int
    outcome: str  # "ok", "busy", "dirty", "older", "error"
    reason: str | None
    version: int | None
    digest: str | None
    # This rank already built the metadata of exactly this version and digest (``prepared``).
    prepared: bool = False


class StandbyGate:
    """One standby rank's lease and the map it routes with (see the module docstring)."""

    def __init__(
        self,
        *,
        session: Any,
        world: Any,
        group: Any,
        model_config: Any,
        metadata: Any,
        moe_ep_rank: int,
        initial_map: Map,
        idle_seconds: float,
        wait_timeout: float,
        on_adopted: Callable[[int, str], None] | None = None,
        poll_interval: float = POLL_INTERVAL,
        start_idle_thread: bool = True,
    ) -> None:
        self.session = session
        self.world = world
        self.group = group
        self.model_config = model_config
        self.metadata = metadata
        self.moe_ep_rank = moe_ep_rank
        self.initial_map = initial_map
        self.idle_seconds = idle_seconds
        self.wait_timeout = wait_timeout
        self.on_adopted = on_adopted
        self.poll_interval = poll_interval
        self.eplb_manager: Any = None  # the runner's, seen at the first forward (rebalance)
        self.held = False  # this rank holds its lease and routes with its daemon's map
        self.agreed = False  # the ranks agreed on a map once (the first acquisition is done)
        self.in_forward = False
        self.last_forward = time.monotonic()
        self.acquisitions = 0  # collective acquisitions
        self.local_acquisitions = 0
        self.prepared_adoptions = 0  # acquisitions that copied a prepared map in
        self.releases = 0
        self._older_warned = False
        self._lock = threading.Lock()  # held, in_forward, last_forward
        # Held across an idle release's request and across an acquisition, so that a release
        # can never reach the daemon after a lease that a forward pass then relies on.
        self._release_lock = threading.Lock()
        self._wake = threading.Event()  # set when the gate closes
        # The metadata of the daemon's newest map, built off the forward path while this rank
        # holds no lease: (version, digest, ExpertLocationMetadata) or None.
        self.prepared: tuple[int, str, Any] | None = None
        self._granted_prepared: tuple[int, str, Any] | None = None
        self._threads: list[threading.Thread] = []
        if start_idle_thread:
            for target, name in (
                (self._idle_loop, "expert-layout-standby-idle"),
                (self._follow_loop, "expert-layout-standby-follow"),
            ):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    # --- the forward pass --------------------------------------------------------------

    def before_forward(self) -> None:
        """Return once this rank may run the batch: it holds its lease and routes with the
        daemon's current map (raises ``ExpertLayoutStartupError`` on every rank otherwise)."""
        with self._lock:
            self.in_forward = True
            if self.held:
                return
        try:
            with self._release_lock:
                self._acquire()
        except BaseException:
            self.after_forward()
            raise

    def after_forward(self) -> None:
        now = time.monotonic()
        with self._lock:
            self.in_forward = False
            self.last_forward = now

    # --- acquisition ---------------------------------------------------------------------

    def _acquire(self) -> None:
        if self.agreed and self._acquire_alone():
            return
        self._acquire_together()

    def _acquire_alone(self) -> bool:
        """After an idle release: the lease again at the version this rank routes with (True),
        or False when the ranks must agree again (a daemon moved, or turned dirty)."""
        deadline = time.monotonic() + self.wait_timeout
        while True:
            grant = self._ask_lease()
            if grant.outcome == "older":
                self._set_held()
                return True
            if grant.outcome == "ok":
                if (grant.version, grant.digest) == (self.session.version, self.session.digest):
                    self.local_acquisitions += 1
                    self._set_held()
                    return True
                return False
            if grant.outcome != "busy":
                return False
            if time.monotonic() >= deadline:
                raise ExpertLayoutStartupError(self._busy_text([grant]))
            time.sleep(self.poll_interval)

    def _acquire_together(self) -> None:
        deadline = time.monotonic() + self.wait_timeout
        while True:
            grant = self._ask_lease()
            grants: list[_Grant] = self._gather(grant)
            if all(g.outcome in ("ok", "older") for g in grants):
                break
            if grant.outcome == "ok":
                self._release_quietly()
            if any(g.outcome in ("dirty", "error") for g in grants):
                self._settle_dirty(grants)
                continue
            if time.monotonic() >= deadline:
                raise ExpertLayoutStartupError(self._busy_text(grants))
            time.sleep(self.poll_interval)
        if self._adopt_prepared(grants):
            return
        self._agree_and_adopt(grants)

    def _adopt_prepared(self, grants: Sequence[_Grant]) -> bool:
        """Every rank was granted at one version and digest, and every rank prepared exactly
        that map's metadata (its digest checked when it was read): the agreement holds without
        reading the maps again; copy the changed layers in. The same answer on every rank (it
        depends on the gathered grants only)."""
        keys = {(g.version, g.digest) for g in grants}
        if len(keys) != 1 or not all(g.outcome == "ok" and g.prepared for g in grants):
            return False
        prepared = self._granted_prepared  # what this rank's own grant found prepared
        if prepared is None:  # cannot happen: this rank's own grant said prepared
            raise RuntimeError("the prepared layout vanished between the grant and its use")
        version, digest, built = prepared
        from sglang_integration.engine.metadata import copy_layers_in_place, map_of
        from sglang_integration.engine.standby_metadata import changed_layers

        layers = changed_layers(map_of(self.metadata), map_of(built))
        copy_layers_in_place(self.metadata, built, layers)
        self.prepared_adoptions += 1
        self._adopted(version, digest, layers)
        return True

    def _ask_lease(self) -> _Grant:
        rank = self.session.rank
        reply = client.lease(self.session.socket_path, self.session.engine_id)
        if reply.outcome is Outcome.OK:
            version, digest = reply.body.get("version"), reply.body.get("digest")
            known = self.prepared  # one read: the follow thread may replace it meanwhile
            ready = known is not None and (known[0], known[1]) == (version, digest)
            self._granted_prepared = known if ready else None
            return _Grant(rank, "ok", None, version, digest, ready)
        if reply.outcome is Outcome.OLDER_DAEMON:
            self._warn_older(reply)
            return _Grant(rank, "older", reply.reason, None, None)
        if reply.outcome is Outcome.BUSY:
            return _Grant(rank, "busy", reply.reason, None, None)
        if reply.outcome is Outcome.REFUSED:
            return _Grant(rank, "dirty", reply.reason, None, None)
        return _Grant(rank, "error", f"lease {reply.outcome.value}: {reply.reason}", None, None)

    def _agree_and_adopt(self, grants: Sequence[_Grant]) -> None:
        """Every rank holds its lease: read the daemons' maps, agree, update in place."""
        from sglang_integration.engine.content_decisions import ContentKind, RankContent
        from sglang_integration.engine.finding_gather import gather_findings

        finding = self._read_finding()
        not_asked = RankContent(self.session.rank, ContentKind.NOT_ASKED)
        findings = gather_findings(self._gather, finding, not_asked).findings
        decision = decide(findings)
        if isinstance(decision, FailStartup):
            self._release_quietly()
            raise ExpertLayoutStartupError(decision.reason)
        if isinstance(decision, AdoptLayout):
            target, version, digest = (
                decision.physical_to_logical_map,
                decision.version,
                decision.digest,
            )
        elif isinstance(decision, KeepInitialLayout):
            target, version, digest = self.initial_map, 0, layout_digest(self.initial_map)
        else:
            raise TypeError(f"decide() returned {decision!r}")
        from sglang_integration.engine.standby_metadata import update_changed_layers

        prepared = self.prepared
        ready = None
        if prepared is not None and (prepared[0], prepared[1]) == (version, digest):
            ready = prepared[2]
        changed = update_changed_layers(
            self.model_config, self.metadata, target, self.moe_ep_rank, prepared=ready
        )
        self._adopted(version, digest, changed)

    def _adopted(self, version: int, digest: str, changed: Sequence[int]) -> None:
        moved_from = self.session.version
        self.session.version, self.session.digest = version, digest
        if self.on_adopted is not None:
            self.on_adopted(version, digest)
        self.acquisitions += 1
        self.agreed = True
        self._set_held()
        if self.session.rank == 0:
            logger.info(
                "standby took its lease on every rank and routes with expert layout version %d "
                "(digest %s; from version %d, %d layers updated in place)",
                version,
                digest[:12],
                moved_from,
                len(changed),
            )

    def _read_finding(self) -> RankFinding:
        socket_path, rank = self.session.socket_path, self.session.rank
        initial_digest = layout_digest(self.initial_map)
        reply = client.query(socket_path)
        if reply.outcome is not Outcome.OK or reply.layout is None:
            return RankFinding(
                rank,
                FindingKind.UNREADABLE,
                socket_path,
                initial_digest,
                reason=f"query {reply.outcome.value}: {reply.reason}",
            )
        return finding_from_layout(
            reply.layout,
            rank=rank,
            socket_path=socket_path,
            initial_digest=initial_digest,
            still_pending=" although this engine held its lease",
        )

    def _settle_dirty(self, grants: Sequence[_Grant]) -> None:
        """A daemon refused the lease (dirty, or not knowing this standby): startup's rule,
        with startup's repair (``startup_repair.settle``), on every rank together."""
        from sglang_integration.engine.finding_gather import gather_findings
        from sglang_integration.engine.startup_repair import StartupRank, read_content, settle
        from sglang_integration.settings import content_check

        finding = self._read_finding()
        this = StartupRank(
            rank=self.session.rank,
            socket_path=self.session.socket_path,
            engine_id=self.session.engine_id,
            mode=content_check(),
            initial_map=self.initial_map,
            engine_shape=(
                len(self.initial_map),
                len(self.initial_map[0]) if self.initial_map else 0,
                int(self.metadata.num_logical_experts),
            ),
        )
        content = read_content(
            self.session.socket_path, finding, rank=self.session.rank, mode=this.mode
        )
        gathered = gather_findings(self._gather, finding, content)
        findings = gathered.findings
        decision, _ = settle(self.world, decide(findings), findings, gathered.contents, this)
        if isinstance(decision, FailStartup):
            raise ExpertLayoutStartupError(decision.reason)
        refused = [g for g in grants if g.outcome in ("dirty", "error")]
        if not any(f.kind is FindingKind.DIRTY for f in findings):
            # Refused, but no daemon is dirty: nothing startup would repair; say why.
            raise ExpertLayoutStartupError(
                "a daemon refused this standby's lease: "
                + "; ".join(f"rank {g.rank}: {g.reason}" for g in refused)
            )

    def _busy_text(self, grants: Sequence[_Grant]) -> str:
        busy = "; ".join(f"rank {g.rank}: {g.reason}" for g in grants if g.outcome == "busy")
        return (
            f"this standby engine waited {self.wait_timeout:g} s for its lease and the "
            f"daemons still have a move pending ({busy}); the mover it names may be hung: "
            f"stop it (its daemons then turn dirty and must be restarted)"
        )

    def _warn_older(self, reply: Reply) -> None:
        if self._older_warned:
            return
        self._older_warned = True
        logger.warning(
            "the weight cache daemon at %s does not know leases (%s): this standby serves "
            "there as an active engine",
            self.session.socket_path,
            reply.reason,
        )

    def _gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        if self.world.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _set_held(self) -> None:
        with self._lock:
            self.held = True

    # --- release -------------------------------------------------------------------------

    def _release_quietly(self) -> None:
        reply = client.release(self.session.socket_path, self.session.engine_id)
        if reply.outcome is not Outcome.OK:
            logger.warning("releasing this standby's lease: %s", reply.reason)

    def release_if_idle(self, now: float | None = None) -> bool:
        """Release this rank's lease when no forward pass ran for the idle time; True if it did."""
        with self._release_lock:
            with self._lock:
                now = time.monotonic() if now is None else now
                idle = now - self.last_forward >= self.idle_seconds
                if not self.held or self.in_forward or not idle:
                    return False
                self.held = False
            self._release_quietly()
            self.releases += 1
        logger.info(
            "standby ran no forward pass for %g s: released its lease (rank %d)",
            self.idle_seconds,
            self.session.rank,
        )
        return True

    def _idle_loop(self) -> None:
        while not self._wake.is_set():
            with self._lock:
                if self.held and not self.in_forward:
                    wait = self.last_forward + self.idle_seconds - time.monotonic()
                else:
                    wait = min(self.idle_seconds, 1.0)
            if wait > 0:
                self._wake.wait(wait)  # a forward pass meanwhile only moves the deadline on
                continue
            try:
                self.release_if_idle()
            except Exception:  # the thread must outlive one failed release
                logger.exception("releasing this standby's idle lease failed")

    def _follow_loop(self) -> None:
        """While this rank holds no lease, build the metadata of its daemon's newest map, so
        that the next acquisition only copies it in (at most once every ``FOLLOW_INTERVAL``)."""
        while not self._wake.wait(FOLLOW_INTERVAL):
            if self.held:
                continue
            try:
                self.prepare()
            except Exception:  # a best effort: the acquisition builds it itself otherwise
                logger.debug("preparing the standby's next layout failed", exc_info=True)

    def prepare(self) -> bool:
        """Build the metadata of the daemon's current map now (True: a new one was built)."""
        from sglang_integration.engine.standby_metadata import prepare_metadata

        layout = client.query(self.session.socket_path).layout
        if layout is None or layout.dirty or layout.pending is not None:
            return False
        known = self.prepared
        if known is not None and (known[0], known[1]) == (layout.version, layout.digest):
            return False
        if (layout.version, layout.digest) == (self.session.version, self.session.digest):
            return False
        if layout_digest(layout.physical_to_logical_map) != layout.digest:
            return False
        built = prepare_metadata(
            self.model_config, self.metadata, layout.physical_to_logical_map, self.moe_ep_rank
        )
        self.prepared = (layout.version, layout.digest, built)
        return True

    def close(self) -> None:
        self._wake.set()


class _ThisRank:
    """The process-wide gate (one engine rank per process); None for an active engine."""

    gate: StandbyGate | None = None


def current_gate() -> StandbyGate | None:
    return _ThisRank.gate


def close_gate() -> None:
    gate, _ThisRank.gate = _ThisRank.gate, None
    if gate is not None:
        gate.close()


def around_forward(original_fn: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook body for ``ModelRunner.forward`` (HOOK_TARGET): an active engine (no gate)
    and a draft worker run the original at once."""
    gate = _ThisRank.gate
    if gate is None or getattr(runner, "is_draft_worker", False):
        return original_fn(runner, *args, **kwargs)
    if gate.eplb_manager is None:
        gate.eplb_manager = getattr(runner, "eplb_manager", None)
    gate.before_forward()
    try:
        return original_fn(runner, *args, **kwargs)
    finally:
        gate.after_forward()


def install_gate(
    *,
    session: Any,
    world: Any,
    model_config: Any,
    metadata: Any,
    moe_ep_rank: int,
    initial_map: Map,
    on_adopted: Callable[[int, str], None] | None = None,
) -> StandbyGate:
    """At the end of a standby's startup, on every rank (its gloo group is made collectively)."""
    from sglang_integration.engine.gloo_groups import new_gloo_group
    from sglang_integration.settings import STANDBY_IDLE, WAIT_TIMEOUT

    wait_timeout = WAIT_TIMEOUT.read()
    group = new_gloo_group(world, wait_timeout + COLLECTIVE_SLACK)
    close_gate()
    gate = StandbyGate(
        session=session,
        world=world,
        group=group,
        model_config=model_config,
        metadata=metadata,
        moe_ep_rank=moe_ep_rank,
        initial_map=initial_map,
        idle_seconds=STANDBY_IDLE.read(),
        wait_timeout=wait_timeout,
        on_adopted=on_adopted,
    )
    _ThisRank.gate = gate
    return gate


def lease_until_not_busy(socket_path: str, engine_id: str, timeout: float) -> Reply:
    """``expert_layout_lease`` asked for again while the daemon answers ``busy`` (a move
    pending), for at most ``timeout`` seconds; the last reply."""
    deadline = time.monotonic() + timeout
    while True:
        reply = client.lease(socket_path, engine_id)
        if reply.outcome is not Outcome.BUSY or time.monotonic() >= deadline:
            return reply
        time.sleep(POLL_INTERVAL)


def lease_at_startup(
    socket_path: str, engine_id: str, attach_reply: Reply, layout: Any, timeout: float
) -> Any:
    """A standby rank's lease while it starts (the daemon named its role ``standby``): asked
    for until granted, busy up to ``timeout``; returns the daemon's layout read after the grant
    (None: keep ``layout``, e.g. a daemon that knows no roles, or a dirty one)."""
    from layout_ledger.wire.protocol import reply_role
    from sglang_integration.settings import ROLE_STANDBY

    if reply_role(attach_reply.body) != ROLE_STANDBY or layout.dirty:
        return None
    lease_until_not_busy(socket_path, engine_id, timeout)
    queried = client.query(socket_path)
    return queried.layout if queried.ok else None


def start_standby(
    *,
    session: Any,
    world: Any,
    roles: Sequence[str],
    model_config: Any,
    metadata: Any,
    moe_ep_rank: int,
    initial_map: Map,
) -> StandbyGate | None:
    """After a standby's startup agreed, on every rank: install the gate when every daemon
    recorded the standby role; else the engine is active (warned once), and a rank whose daemon
    does know roles keeps a lease for the engine's life, so nothing moves under it there."""
    from sglang_integration.settings import ROLE_STANDBY

    if all(role == ROLE_STANDBY for role in roles):
        gate = install_gate(
            session=session,
            world=world,
            model_config=model_config,
            metadata=metadata,
            moe_ep_rank=moe_ep_rank,
            initial_map=initial_map,
            on_adopted=_follow_in_rebalance,
        )
        layout = client.query(session.socket_path).layout
        gate.held = (
            layout is not None
            and session.engine_id in layout.leases
            and (layout.version, layout.digest) == (session.version, session.digest)
        )
        gate.agreed = True
        return gate
    if world.rank_in_group == 0:
        older = [rank for rank, role in enumerate(roles) if role != ROLE_STANDBY]
        logger.warning(
            "SGLANG_EXPERT_LAYOUT_ROLE=standby, but the weight cache daemons of ranks %s know no "
            "roles (their attach replies name none): this engine runs as an active engine, "
            "and the active engine's moves pause while it is attached",
            older,
        )
    if session.role == ROLE_STANDBY:
        from sglang_integration.settings import WAIT_TIMEOUT

        reply = lease_until_not_busy(session.socket_path, session.engine_id, WAIT_TIMEOUT.read())
        if not reply.ok:
            raise ExpertLayoutStartupError(
                f"this engine runs as an active engine on its daemons, but the daemon at "
                f"{session.socket_path} recorded it as a standby and refused its lease: "
                f"{reply.reason}"
            )
    return None


# Called with (the runner's EPLB manager, the version adopted) after each adoption: the plugin
# adds the rebalance hook's (``standby_follow``), so a standby's own moves begin from the
# version it routes with. (Registered from outside: the rebalance hook imports the startup hook,
# which imports this module.)
FOLLOWERS: list[Callable[[Any, int], None]] = []


def _follow_in_rebalance(version: int, digest: str) -> None:
    gate = _ThisRank.gate
    manager = None if gate is None else gate.eplb_manager
    if manager is None:
        return
    for follow in FOLLOWERS:
        follow(manager, version)
