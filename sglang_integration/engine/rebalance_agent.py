"""Each engine rank's rebalance agent: the daemon round trips of a chunked rebalance, off the
forward path.

sglang moves a chunked rebalance one chunk per forward pass (``EPLBManager.rebalance`` yields
between chunks). The two-phase rules need, per chunk, a begin granted by every rank's daemon
before the move and a commit checked on every daemon after it. Done on the rank's main thread
between two forward passes, those round trips and their all-gathers stall serving; here a
thread per rank does them:

- it owns the rank's kept connection (``rank_connection``) and the plugin's own gloo group
  (``create_group``, made at startup by every rank, so its collectives never interleave with
  sglang's on the world group);
- for a ``BeginJob`` it sends begin, all-gathers the replies, decides (``decide_begin``) and,
  when the chunk does not move, aborts its own begin as the rules say;
- between jobs it sleeps on its queue, woken by the next job (never polling);
- for a ``CommitJob`` (handed over right after the move) it waits until the moved bytes have
  landed (the device event recorded after the move; on a CPU the move is synchronous), builds
  the rows and the whole-map digest from the engine's map (no move changes it before this
  job's result), sends commit, all-gathers
  and checks the replies (``check_commits``) and, when the check passed and a chunk follows,
  sends that chunk's begin at once;
- every job ends with an agreement on the forward pass at which every rank uses its result:
  the agents all-gather their rank's pass counter and proposed margin and take
  ``max(counters) + max(margins)`` (``target``; the margin: ``rebalance_margin``).

The main thread (``rebalance``) polls ``result()`` once per forward pass and yields while no
result is there or its target pass has not come, so every rank moves a chunk at the same pass
(sglang's move is a collective). It never waits on a daemon: a slow daemon only delays the
pass at which the chunk moves. It waits on the agent only if the agent took more than its
margin's passes from reading its counter to publishing the agreed target (``deadline``), which
keeps every rank at or before the target; ``blocked`` counts those waits.

An agent that fails (a bug, a collective that failed because a peer's agent died) publishes
nothing more; the main thread sees it dead and turns rebalancing off with an error. The agent
then tears down its group so that the peers' collectives fail at once instead of at the
group's timeout.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from layout_ledger.core.layout import layout_digest
from layout_ledger.wire.protocol import Outcome, Reply
from sglang_integration.engine.rank_connection import close_rank_connection
from sglang_integration.engine.rebalance_decisions import (
    BeginAction,
    BeginDecision,
    CommitCheck,
    check_commits,
    decide_begin,
)
from sglang_integration.engine.rebalance_margin import MarginPolicy
from sglang_integration.engine.reply_gather import all_gather_small

logger = logging.getLogger(__name__)

THREAD_NAME = "expert-layout-rebalance-agent"
# The plugin group's collectives fail after this many seconds (a peer whose agent is gone).
GROUP_TIMEOUT = 120.0
# Seconds a group being dropped waits for the all-gather that connects it (a peer gone).
CONNECTED_WAIT = 5.0


class RankLayoutClient(Protocol):
    """This rank's layout requests to its own daemon, bound to this engine's id.

    Each returns the typed ``Reply``. It may raise; the agent turns that into an ``ERROR``
    reply so the rank still joins the all-gather.
    """

    def begin(self, base_version: int, layers: list[int]) -> Reply: ...

    def commit(self, rows: dict[int, list[int]]) -> Reply: ...

    def abort(self) -> Reply: ...


# --- the plugin's gloo group -------------------------------------------------------------------


class PluginGroup:
    """The plugin's own gloo group over the engine's world ranks, in the shape
    ``all_gather_small`` reads (``world_size``, ``rank_in_group``, ``ranks``, ``cpu_group``);
    ``ranks``: the global ranks, the world group's (0 .. world_size - 1 when not given)."""

    def __init__(
        self,
        cpu_group: Any,
        world_size: int,
        rank_in_group: int,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.cpu_group = cpu_group
        self.world_size = world_size
        self.rank_in_group = rank_in_group
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)

        self._connecting: threading.Thread | None = None

    def connect_in_the_background(self) -> None:
        """One all-gather on a thread of its own, every rank at once, so that a group made with
        lazy connections (``create_group``) connects the pairs the agents' all-gathers use
        while the engine starts, not at its first rebalance; ``all_gather`` waits for it."""
        if self.world_size <= 1:
            return

        def connect() -> None:
            try:
                all_gather_small(self, None)
            except Exception:  # the agents' first all-gather fails the same way, and says so
                logger.warning("connecting the rebalance agents' group failed", exc_info=True)

        self._connecting = threading.Thread(
            target=connect, name="expert-layout-agents-connect", daemon=True
        )
        self._connecting.start()

    def all_gather(self, value: Any) -> list[Any]:
        self._connected(GROUP_TIMEOUT)
        return all_gather_small(self, value)

    def _connected(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the background all-gather to end."""
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.join(timeout)

    def destroy(self) -> None:
        """Drop this rank's end of the group; a peer's collective in flight fails."""
        import torch.distributed as dist

        # Not while its own first all-gather is on the wire, unless a peer never joins it.
        self._connected(CONNECTED_WAIT)
        group, self.cpu_group = self.cpu_group, None
        if group is not None and self.world_size > 1:
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # the default group may already be gone at exit
                logger.debug("destroying the rebalance agents' group: %s", exc)
            # gloo closes its connections (a peer's collective fails at once) when the last
            # reference to the process group goes.
            del group
            gc.collect()


class _ThisRank:
    """Process-wide (one engine rank per process): the group and the agent."""

    group: PluginGroup | None = None
    agent: RebalanceAgent | None = None


def create_group(world: Any) -> PluginGroup:
    """Make the plugin's gloo group over ``world``'s ranks (sglang's world ``GroupCoordinator``).

    A collective: every rank calls it at the same point of the startup (``startup``), after
    sglang made its own groups, when sglang runs an ``EPLBManager`` (``--enable-eplb``). Its
    pairs connect lazily (one store barrier makes it, whatever the ranks), and one all-gather on
    a thread of its own connects the ones the agents use while the engine starts
    (``PluginGroup.connect_in_the_background``): gloo's full mesh of ``EP - 1`` connections a
    rank, each through the store, is no longer part of the start.
    """
    from sglang_integration.engine.gloo_groups import new_gloo_group

    cpu_group = new_gloo_group(world, GROUP_TIMEOUT, connect_lazily=True)
    group = PluginGroup(
        cpu_group, int(world.world_size), int(world.rank_in_group), [int(r) for r in world.ranks]
    )
    group.connect_in_the_background()
    if _ThisRank.group is not None:
        _ThisRank.group.destroy()
    _ThisRank.group = group
    return group


def current_group() -> PluginGroup | None:
    return _ThisRank.group


def start_agent(moves: RankLayoutClient) -> RebalanceAgent:
    """This rank's agent on ``moves`` and the startup's group (one per process)."""
    group = _ThisRank.group
    if group is None:
        raise RuntimeError("no rebalance agents' group was made at startup; this is a plugin bug")
    if _ThisRank.agent is not None:
        _ThisRank.agent.stop()
    agent = _ThisRank.agent = RebalanceAgent(moves, group)
    return agent


def current_agent() -> RebalanceAgent | None:
    return _ThisRank.agent


def shut_down() -> None:
    """The engine's session ends: stop the agent, close the kept connection, drop the group."""
    agent, _ThisRank.agent = _ThisRank.agent, None
    if agent is not None:
        agent.stop()
    close_rank_connection()
    group, _ThisRank.group = _ThisRank.group, None
    if group is not None:
        group.destroy()


# --- jobs and results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BeginJob:
    base_version: int
    layers: list[int]


@dataclass(slots=True)
class CommitJob:
    """Commit the chunk just moved; then, if the check passed, begin ``next_layers``.

    Made on the forward path at a move, so a plain slotted class (a frozen dataclass's
    ``__init__`` costs several microseconds more); the agent never changes it.
    """

    base_version: int
    layers: list[int]
    landed: Any  # the device event recorded after the move; None on a CPU
    engine_map: Any  # the engine's physical_to_logical_map_cpu, unchanged until the result
    next_layers: list[int] | None = None


@dataclass(frozen=True)
class BeginOutcome:
    decision: BeginDecision
    mine: Reply
    abort_problem: str | None = None  # this rank's granted begin could not be aborted


@dataclass(frozen=True)
class AgentResult:
    """What every rank uses at forward pass ``target`` (the same on every rank)."""

    target: int
    commit: CommitCheck | None = None
    begin: BeginOutcome | None = None


# --- the agent ------------------------------------------------------------------------------------


class RebalanceAgent:
    """One rank's agent thread (see the module's docstring). ``step`` is written by the main
    thread: the forward passes since the current rebalance started."""

    def __init__(
        self,
        moves: RankLayoutClient,
        group: PluginGroup,
        margins: MarginPolicy | None = None,
        wait_landed: Callable[[Any], None] | None = None,
    ) -> None:
        self.moves = moves
        self.group = group
        # The margin this agent proposes at each agreement (``rebalance_margin``).
        self.margins = margins or MarginPolicy()
        self.step = 0
        self.deadline: int | None = None
        self.failure: str | None = None
        self.blocked = 0  # forward passes at which the main thread waited on this agent
        self.jobs_done = 0
        self._wait_landed = wait_landed or wait_until_landed
        # The handoff, both ways, costs the forward path as little as it can: one C queue put
        # (it wakes the agent) to hand a job over, one attribute the agent writes to publish its
        # result. ``_published`` is set after each result, only for ``wait``; the main thread
        # never clears it on the forward path (an Event's clear takes its Condition's lock).
        #
        # Between jobs the agent sleeps in the queue's get, woken only by the next job: it
        # never polls. A poll for the commit job (every 0.5 ms while one was due, the design
        # before) saved the move pass the wake's system call but woke the agent some 60 times
        # a forward pass on every pass of a rebalance, each wake taking a CPU and the GIL from
        # the forward path (scripts/bench_forward.py, docs/benchmarks.md).
        self._jobs: queue.SimpleQueue[BeginJob | CommitJob | None] = queue.SimpleQueue()
        self._stopping = False
        self._published = threading.Event()
        self._result: AgentResult | None = None
        self._running = True  # False once _run returned or raised
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The kernel's id of the agent's thread (its scheduling policy is set by it)."""
        return self._thread.native_id

    @property
    def alive(self) -> bool:
        return self.failure is None and self._running

    def submit(self, job: BeginJob | CommitJob) -> None:
        """Hand the agent its next job (the main thread, once it used the previous result): one
        queue put, which wakes the agent."""
        self._result = None
        self.deadline = None
        self._jobs.put(job)

    def result(self) -> AgentResult | None:
        """The last job's result once published, else None. Never waits."""
        return self._result

    def wait(self) -> AgentResult | None:
        """Wait for the result (the agent passed its deadline); None if the agent died."""
        self.blocked += 1
        while True:
            result = self._result
            if result is not None:
                return result
            if not self.alive:
                return None
            # Set after every result: a stale set only costs one more turn of this loop.
            self._published.wait(0.05)
            self._published.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._jobs.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the rebalance agent did not stop within %.0f s", timeout)

    # --- on the agent's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            yield_to_the_forward_path()
            while True:
                job = self._next_job()
                if job is None:
                    self._running = False
                    return
                result = self._work(job)
                self.jobs_done += 1
                self._result = result
                self._published.set()
        except BaseException as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            self._running = False
            logger.error("the rebalance agent of this engine rank failed", exc_info=True)
        else:
            return
        # Out of the handler, so that no traceback frame still holds the group's process group.
        self._published.set()
        self.group.destroy()

    def _next_job(self) -> BeginJob | CommitJob | None:
        """The next job, waited for on the queue (asleep until it comes); None to stop."""
        if self._stopping:
            return None
        return self._jobs.get()

    def _work(self, job: BeginJob | CommitJob) -> AgentResult:
        commit: CommitCheck | None = None
        begin: BeginOutcome | None = None
        if isinstance(job, CommitJob):
            commit = self._commit(job)
            if commit.ok and job.next_layers is not None:
                begin = self._begin(BeginJob(job.base_version + 1, job.next_layers))
        else:
            begin = self._begin(job)
        return AgentResult(self._agree_on_target(), commit, begin)

    def _begin(self, job: BeginJob) -> BeginOutcome:
        mine = call(lambda: self.moves.begin(job.base_version, job.layers))
        decision = decide_begin(self.group.all_gather(mine))
        problem = None
        if decision.action is not BeginAction.MOVE:
            problem = self._abort_own_begin(mine)
        return BeginOutcome(decision, mine, problem)

    def _abort_own_begin(self, mine: Reply) -> str | None:
        """Abort this rank's begin when it succeeded, or when it may have landed (an error).

        busy and refused leave nothing pending; after an error the abort is a precaution whose
        refusal ("no move pending") is expected and not reported.
        """
        if mine.outcome in (Outcome.BUSY, Outcome.REFUSED):
            return None
        aborted = call(self.moves.abort)
        if mine.ok and not aborted.ok:
            return aborted.reason or aborted.outcome.value
        return None

    def _commit(self, job: CommitJob) -> CommitCheck:
        # The moved bytes must have landed before any daemon records (and then serves) them.
        self._wait_landed(job.landed)
        # An integer tensor's tolist() is already Python ints (the protocol's values).
        engine_map = job.engine_map.tolist()
        rows = {layer: engine_map[layer] for layer in job.layers}
        mine = call(lambda: self.moves.commit(rows))
        return check_commits(
            self.group.all_gather(mine),
            base_version=job.base_version,
            engine_digest=layout_digest(engine_map),
        )

    def _agree_on_target(self) -> int:
        """The pass at which every rank uses this job's result: the latest rank's counter plus the
        largest margin any agent proposed. Each agent's deadline (its counter plus its own
        margin) is at or before that target, so no rank is past it when the result arrives.

        Each agent proposes its own margin from the passes its recent agreements took
        (``rebalance_margin.MarginPolicy``), so ranks may propose different ones.
        """
        here = self.step
        margin = self.margins.propose()
        self.deadline = here + margin
        gathered = self.group.all_gather((here, margin))
        self.margins.taken(self.step - here)
        return int(max(counter for counter, _ in gathered)) + int(
            max(proposed for _, proposed in gathered)
        )


def yield_to_the_forward_path() -> None:
    """Make the calling thread (the agent's) ``SCHED_BATCH``: the kernel never lets it preempt
    a running thread when it wakes (the main thread in a forward pass's hook, say, when the
    hook's hand-over of a job or a daemon's reply wakes it), while it keeps its fair
    share of the CPU. Allowed without privileges on Linux; elsewhere nothing changes."""
    import os

    set_scheduler = getattr(os, "sched_setscheduler", None)
    batch = getattr(os, "SCHED_BATCH", None)
    if set_scheduler is None or batch is None:
        return
    try:
        set_scheduler(0, batch, os.sched_param(0))  # 0: the calling thread
    except OSError as exc:
        logger.debug("the rebalance agent keeps its scheduling policy: %s", exc)


def wait_until_landed(landed: Any) -> None:
    """Wait for the device event recorded after the move; on a CPU the move is synchronous
    (``torch.cpu.synchronize`` is a no-op, called so that the order is the same everywhere)."""
    if landed is None:
        import torch

        torch.cpu.synchronize()
        return
    landed.synchronize()


def call(request: Callable[[], Reply]) -> Reply:
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
