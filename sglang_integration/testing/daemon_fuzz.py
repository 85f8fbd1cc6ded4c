"""Generated requests against a model-less daemon, each judged by the protocol's rules.

The core of ``scripts/fuzz_daemon.py`` (and of its smoke test). A daemon with a ledger
(sglang's serve loop with the hooks) runs in its own process; Hypothesis draws, step by step,
either a malformed or must-fail request (``sglang_integration.testing.fuzz_requests``) or a valid
step of several engines (attach through a separate engine process, begin, commit, abort, query,
fetch, the SIGKILL or clean exit of an engine). Every ~``restart_every`` requests, and soon after a
dirty mark or a non-following fetch, the daemon is stopped (SIGTERM, or SIGKILL every other
time), the ledger verified, and a new daemon started on the same ledger. Each request is judged
against a shadow: the same rules (``LayoutService`` over a ``LayoutRecord``) in this process, fed
the same requests and detaches, whose journal only counts what it is handed
(``FuzzSession.judge``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sqlite3
import struct
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from layout_ledger.core import events as ev
from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.service import LayoutService
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
    send_raw,
    start_daemon,
)
from sglang_integration.testing.fuzz_requests import (
    LAYERS,
    LOGICAL,
    PHYSICAL,
    bad_engine_ids,
    requests_strategy,
)

REFUSAL_STATUSES = frozenset({msg.REFUSED, msg.BUSY, msg.LAYOUT_REFUSED})
STEPS_PER_EXAMPLE = 10
MAX_ENGINES = 3
DETACH_WAIT = 60.0  # returns as soon as the daemon detached; generous for a loaded machine
# Requests a daemon keeps running once dirty or with moves disabled (a non-following fetch),
# both of which only a restart ends.
STUCK_FOR = 100
GEOMETRY = Geometry(num_layers=LAYERS, num_physical_slots=PHYSICAL, num_logical_experts=LOGICAL)
NOT_A_FRAME = object()  # what the daemon reads from bytes that are not one whole request


@dataclass
class FuzzTally:
    """What a run counted; ``problems`` describes the first few faults."""

    requests: int = 0
    daemon_crashes: int = 0
    rule_breaks: int = 0
    refused_changes: int = 0
    verify_failures: int = 0
    verifies: int = 0
    engine_kills: int = 0
    engine_exits: int = 0
    daemon_runs: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def fault(self, counter: str, text: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.problems) < 20:
            self.problems.append(f"{counter}: {text[:600]}")

    @property
    def faults(self) -> int:
        return self.daemon_crashes + self.rule_breaks + self.refused_changes + self.verify_failures


def _is_refusal(kind: str) -> bool:
    return kind.endswith(ev.REFUSED_SUFFIX) or kind == ev.BEGIN_BUSY


class CountingJournal:
    """The shadow record's journal: counts refusal entries and other events, keeps nothing."""

    def __init__(self) -> None:
        self.refusals = 0
        self.others = 0

    def append(
        self,
        events: Sequence[ev.Event],
        rows: Mapping[int, str] | None = None,
        fingerprints: object = None,
    ) -> None:
        for event in events:
            if _is_refusal(event.kind):
                self.refusals += 1
            else:
                self.others += 1

    def counts(self) -> tuple[int, int]:
        return self.refusals, self.others


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!I", len(data)) + data


def read_frame(data: bytes) -> Any:
    """What the daemon's ``recv_msg`` reads from ``data`` (``NOT_A_FRAME`` if it fails)."""
    from sglang.srt.utils.common import safe_pickle_loads

    if len(data) < 4:
        return NOT_A_FRAME
    (length,) = struct.unpack("!I", data[:4])
    if length > 256 * 1024 * 1024 or len(data) < 4 + length:
        return NOT_A_FRAME
    try:
        return safe_pickle_loads(data[4 : 4 + length])
    except Exception:
        return NOT_A_FRAME


@dataclass
class Expected:
    """What the rules say of one request: ``kind`` layout, fetch or other, and the reply."""

    kind: str
    reply: dict[str, Any] | None = None
    counts: tuple[int, int] = (0, 0)
    request_type: str = ""


class FuzzSession:
    """One daemon at a time on one ledger, its engines, and the shadow of its record."""

    def __init__(self, directory: Path, tally: FuzzTally, restart_every: int) -> None:
        self.directory = directory
        self.ledger_path = str(directory / "fuzz.sqlite")
        self.tally = tally
        self.restart_every = restart_every
        self.daemon: DaemonProcess | None = None
        self.engines: dict[str, EngineStandIn] = {}
        self.engine_serial = 0
        self.crash_next_stop = False
        self.requests_at_start = 0
        self.stuck_since: int | None = None
        self._new_shadow()

    # --- the daemon ---------------------------------------------------------------------------

    def _new_shadow(self) -> None:
        self.journal = CountingJournal()
        initial = trivial_map(LAYERS, PHYSICAL, LOGICAL)
        self.shadow_record = LayoutRecord(self.journal, 1, GEOMETRY, initial)
        self.shadow = LayoutService(self.shadow_record)

    def start(self) -> None:
        self.daemon = start_daemon(
            self.directory,
            "fuzz",
            ledger_path=self.ledger_path,
            num_layers=LAYERS,
            num_logical_experts=LOGICAL,
            num_physical_experts=PHYSICAL,
            extra=["--log-level", "CRITICAL", "--prune-every", str(10**9)],
        )
        self.tally.daemon_runs += 1
        self._new_shadow()
        self.config = request(self.daemon.socket_path, {"type": "query_config"})["config"]
        self.ledger = sqlite3.connect(f"file:{self.ledger_path}?mode=ro", uri=True)
        (self.last_event_id,) = self.ledger.execute(
            "SELECT coalesce(max(event_id), 0) FROM ledger_events"
        ).fetchone()
        self.first_event_id = self.last_event_id
        self.counts = (0, 0)
        self.requests_at_start = self.tally.requests
        self.stuck_since = None

    def stop(self) -> None:
        """Stop the daemon (SIGTERM, or SIGKILL every other time), end its engines, verify."""
        daemon = self.daemon
        if daemon is None:
            return
        self.ledger.close()
        if self.crash_next_stop:
            daemon.kill()
        else:
            code = daemon.stop()
            if code != 0:
                self.tally.fault("daemon_crashes", f"the daemon exited {code} on SIGTERM")
        self.crash_next_stop = not self.crash_next_stop
        for engine in self.engines.values():
            engine.kill()
        self.engines.clear()
        self.daemon = None
        self.verify()

    def restart_if_due(self) -> None:
        state = self.shadow_record
        since_start = self.tally.requests - self.requests_at_start
        if state.dirty is not None or state.non_following_fetch:
            self.stuck_since = self.stuck_since or self.tally.requests
        if since_start >= self.restart_every or (
            self.stuck_since is not None and self.tally.requests - self.stuck_since > STUCK_FOR
        ):
            self.stop()
            self.start()

    def verify(self) -> None:
        from layout_ledger.cli.app import main as cli_main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli_main(["verify", self.ledger_path])
        self.tally.verifies += 1
        if code != 0:
            self.tally.fault("verify_failures", out.getvalue())

    def ledger_counts(self) -> tuple[int, int]:
        """Refusals recorded and other events this daemon added (prune bookkeeping aside).

        Identical consecutive refusals share a row whose ``count`` grows, so refusals are the
        sum of the counts of this daemon's refusal rows."""
        _, others = self.counts
        refusals = 0
        for event_id, kind, count in self.ledger.execute(
            "SELECT event_id, kind, count FROM ledger_events WHERE event_id > ? ORDER BY event_id",
            (self.first_event_id,),
        ):
            if _is_refusal(kind):
                refusals += count
            elif kind != ev.PRUNE and event_id > self.last_event_id:
                others += 1
            self.last_event_id = max(self.last_event_id, event_id)
        return refusals, others

    def check_alive(self, after: str) -> bool:
        if self.daemon is not None and self.daemon.is_alive():
            return True
        self.tally.fault("daemon_crashes", f"the daemon died after {after}")
        self.crash_next_stop = True  # it is gone: no exit status to judge
        with contextlib.suppress(Exception):
            self.stop()
        self.start()
        return False

    # --- one request, judged ------------------------------------------------------------------

    def expect(self, message: Any) -> Expected:
        before = self.journal.counts()
        if isinstance(message, dict):
            kind = message.get("type")
            if isinstance(kind, str) and kind in msg.LAYOUT_REQUEST_TYPES:
                reply = self.shadow.handle(message)
                return Expected("layout", reply, _minus(self.journal.counts(), before), kind)
            if kind == msg.FETCH_STATE and self.config_matches(message):
                refusal = self.shadow.check_fetch(message)
                return Expected("fetch", refusal, _minus(self.journal.counts(), before), kind)
        return Expected("other")

    def config_matches(self, message: dict[str, Any]) -> bool:
        """sglang's own fetch_state config test, as the daemon applies it."""
        from sglang.srt.weight_cache.protocol import CacheConfig

        try:
            mine = CacheConfig.from_dict(self.config)
            return bool(mine.matches(CacheConfig.from_dict(message["config"])))
        except Exception:
            return False

    def send(self, data: bytes) -> None:
        """Send one generated request and judge its reply and the ledger's change."""
        if self.daemon is None:
            raise RuntimeError("no daemon is running")
        message = read_frame(data)
        expected = self.expect(message)
        raw = send_raw(self.daemon.socket_path, data)
        self.tally.requests += 1
        reply = read_frame(raw) if raw else None
        if not self.check_alive(f"a request {_describe(message, data)}"):
            return
        counts = self.ledger_counts()
        added = _minus(counts, self.counts)
        self.counts = counts
        self.judge(expected, reply, added, _describe(message, data))
        attached = expected.request_type == msg.ATTACH and reply == expected.reply
        if attached and isinstance(reply, dict) and reply.get("status") == msg.OK:
            # The short connection attached an engine; its end detaches it.
            self.await_detach(str(message["engine_id"]))

    def judge(self, expected: Expected, reply: Any, added: tuple[int, int], described: str) -> None:
        """One request's reply and ledger growth against the shadow's, by the rules:

        - **protocol**: a layout request's reply must equal the shadow's, read as a valid reply
          by the engine's own parser (``protocol.Reply.from_wire``), carry a ``reason`` unless
          ``ok``, never be ``error``; a fetch the shadow serves must be served (``ok``), one it
          refuses refused alike; anything else gets a dict with a ``status``, or nothing (sglang
          closes the connection);
        - **record**: the ledger's new events, refusal audit entries and others counted apart
          (read from ``ledger_events``), must be what the shadow's journal took; a refused
          request adds exactly one refusal entry and nothing else, and a request that is no
          layout request adds none.

        Two more rules hold after the request: the daemon process must be alive
        (``check_alive``), and ``layout-ledger verify`` must pass after each daemon's run
        (``verify``).
        """
        status = reply.get("status") if isinstance(reply, dict) else None
        self.tally.statuses[str(status)] += 1
        if expected.kind == "other":
            if reply is not None and not isinstance(status, str):
                self.tally.fault("rule_breaks", f"{described} got {reply!r}, no status")
            if added != (0, 0):
                self.tally.fault("refused_changes", f"{described} (no layout request) {added}")
            return
        problem = self.reply_problem(expected, reply)
        if problem:
            self.tally.fault("rule_breaks", f"{described}: {problem}")
        refused = status in REFUSAL_STATUSES
        if refused and added != (1, 0):
            self.tally.fault("refused_changes", f"{described} was {status} and added {added}")
        elif added != expected.counts:
            self.tally.fault(
                "rule_breaks", f"{described} added {added}, the rules add {expected.counts}"
            )

    def reply_problem(self, expected: Expected, reply: Any) -> str | None:
        if expected.kind == "fetch" and expected.reply is None:
            served = isinstance(reply, dict) and reply.get("status") == msg.OK
            return None if served else f"the rules serve it, the daemon answered {reply!r}"
        if reply != expected.reply:
            return f"the daemon answered {reply!r}, the rules {expected.reply!r}"
        if not isinstance(reply, dict):
            return f"no dict reply: {reply!r}"
        status = reply.get("status")
        if status == msg.ERROR:
            return f"error: {reply.get('reason')!r}"
        if status != msg.OK and not reply.get("reason"):
            return f"{status} without a reason"
        if expected.kind == "layout":
            read = msg.Reply.from_wire(reply, request_type=expected.request_type, peer="fuzz")
            if read.outcome is msg.Outcome.ERROR:
                return f"the engine cannot read it: {read.reason}"
        return None

    # --- engines ------------------------------------------------------------------------------

    def attach_engine(self) -> None:
        if self.daemon is None:
            return
        self.engine_serial += 1
        engine_id = f"engine-{self.engine_serial}"
        expected = self.expect({"type": msg.ATTACH, "engine_id": engine_id})
        engine = EngineStandIn.start(self.daemon.socket_path, engine_id)
        self.tally.requests += 1
        if not self.check_alive(f"the attach of {engine_id}"):
            engine.kill()
            return
        self.engines[engine_id] = engine
        counts = self.ledger_counts()
        added, self.counts = _minus(counts, self.counts), counts
        reply = engine.attach_reply
        body = dict(reply.body) if isinstance(reply, msg.Reply) else reply
        self.judge(expected, body, added, f"the attach of {engine_id}")

    def end_engine(self, engine_id: str, kill: bool) -> None:
        engine = self.engines.pop(engine_id)
        if kill:
            engine.kill()
            self.tally.engine_kills += 1
        else:
            engine.exit()
            self.tally.engine_exits += 1
        self.await_detach(engine_id)

    def await_detach(self, engine_id: str) -> None:
        """Wait until the daemon has detached ``engine_id``; the shadow detaches it too."""
        if self.daemon is None:
            return
        deadline = time.monotonic() + DETACH_WAIT
        while engine_id in self.query()["attached"]:
            if time.monotonic() > deadline:
                self.tally.fault("rule_breaks", f"{engine_id!r} is still attached after its end")
                return
            time.sleep(0.005)
        before = self.journal.counts()
        self.shadow.detach(engine_id)
        counts = self.ledger_counts()
        added, self.counts = _minus(counts, self.counts), counts
        expected = _minus(self.journal.counts(), before)
        if added != expected:
            self.tally.fault("rule_breaks", f"the detach of {engine_id!r} added {added}")
        theirs, ours = self.query(), msg.LayoutView.of(self.shadow_record.state()).to_wire()
        if theirs != ours:
            self.tally.fault("rule_breaks", f"after a detach the daemon holds {theirs!r}")

    def query(self) -> dict[str, Any]:
        if self.daemon is None:
            raise RuntimeError("no daemon is running")
        layout: dict[str, Any] = request(self.daemon.socket_path, {"type": msg.QUERY})["layout"]
        return layout


def _minus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] - b[0], a[1] - b[1]


def _describe(message: Any, data: bytes) -> str:
    if message is NOT_A_FRAME:
        return f"{len(data)} bytes that are no request ({data[:24]!r}...)"
    return repr(message)[:200]


# --- the steps: drawn without looking at the daemon, read against its state -----------------
#
# Hypothesis requires that the same choices draw the same values, so nothing drawn depends on
# the daemon's state: a step names engines by index, layers and rows for every layer, and is
# read against the shadow's state when it runs.


@dataclass(frozen=True)
class AttachedEngine:
    """In a malformed attach: the id of an attached engine (index modulo their number)."""

    index: int


@dataclass(frozen=True)
class ValidStep:
    """One step an engine could take (``kind``), with every choice it may need."""

    kind: str
    engine: int
    kill: bool
    base_offset: int
    layers: list[int]
    rows: list[list[int]]
    short_row: bool
    plain_fetch: bool
    stale_digest: bool


ROW = st.lists(st.integers(0, LOGICAL - 1), min_size=PHYSICAL, max_size=PHYSICAL)
VALID_STEPS = st.builds(
    ValidStep,
    kind=st.sampled_from(
        ["attach", "begin", "begin", "commit", "commit", "abort", "query", "fetch", "end"]
    ),
    engine=st.integers(0, 7),
    kill=st.booleans(),
    base_offset=st.sampled_from([0, 0, 0, 0, 1]),
    layers=st.one_of(
        st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True),
        st.lists(st.integers(-1, LAYERS), max_size=3),
    ),
    rows=st.lists(ROW, min_size=LAYERS, max_size=LAYERS),
    short_row=st.integers(0, 9).map(lambda n: n == 0),
    plain_fetch=st.integers(0, 19).map(lambda n: n == 0),
    stale_digest=st.integers(0, 3).map(lambda n: n == 0),
)


def steps_strategy(config: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Half malformed or must-fail requests, half valid steps of several engines.

    A coin picks which (Hypothesis would favour one branch of a ``one_of``).
    """
    attach_ids = st.one_of(bad_engine_ids, st.integers(0, 7).map(AttachedEngine))
    malformed = requests_strategy(config, attach_ids)
    return st.booleans().flatmap(lambda heads: malformed if heads else VALID_STEPS)


def run_step(session: FuzzSession, step: Any) -> None:
    if isinstance(step, ValidStep):
        run_valid_step(session, step)
        return
    how, payload = step
    if how == "raw":
        session.send(payload)
        return
    if isinstance(payload, dict) and isinstance(payload.get("engine_id"), AttachedEngine):
        attached = sorted(session.engines)
        index = payload["engine_id"].index
        payload = {**payload, "engine_id": attached[index % len(attached)] if attached else ""}
    session.send(frame(payload))


def run_valid_step(session: FuzzSession, step: ValidStep) -> None:
    state = session.shadow_record
    attached = sorted(session.engines)
    if step.kind == "attach" and len(attached) < MAX_ENGINES:
        session.attach_engine()
    elif step.kind == "end" and attached:
        session.end_engine(attached[step.engine % len(attached)], kill=step.kill)
    elif step.kind in ("begin", "commit", "abort"):
        session.send(frame(_move_request(step, state, attached)))
    elif step.kind == "fetch":
        session.send(frame(_fetch_request(session.config, state, attached, step)))
    else:
        session.send(frame({"type": msg.QUERY}))


def _move_request(step: ValidStep, state: LayoutRecord, attached: list[str]) -> dict[str, Any]:
    owner = [state.pending.engine_id] if state.pending is not None else []
    candidates = owner + attached + ["engine-gone"]
    engine_id = candidates[step.engine % len(candidates)]
    if step.kind == "abort":
        return {"type": msg.ABORT, "engine_id": engine_id}
    if step.kind == "begin":
        return {
            "type": msg.BEGIN,
            "engine_id": engine_id,
            "base_version": state.version + step.base_offset,
            "layers": step.layers,
        }
    pending = list(state.pending.layers) if state.pending is not None else [0]
    rows = {layer: step.rows[layer] for layer in pending}
    if step.short_row:
        rows[pending[0]] = rows[pending[0]][:-1]
    return {"type": msg.COMMIT, "engine_id": engine_id, "rows": rows}


def _fetch_request(
    config: dict[str, Any], state: LayoutRecord, attached: list[str], step: ValidStep
) -> dict[str, Any]:
    if step.plain_fetch:  # an engine without the plugin
        return {"type": msg.FETCH_STATE, "config": config}
    candidates: list[str | None] = [*attached, None]
    field = {
        "engine_id": candidates[step.engine % len(candidates)],
        "version": state.version,
        "digest": "0" * 64 if step.stale_digest else state.digest,
    }
    return {"type": msg.FETCH_STATE, "config": config, msg.FETCH_LAYOUT_FIELD: field}


# --- the run ----------------------------------------------------------------------------------


def run_fuzz(
    directory: str | os.PathLike[str],
    requests: int,
    *,
    seed: int | None = None,
    restart_every: int = 1500,
    progress: Callable[[FuzzTally], None] | None = None,
) -> FuzzTally:
    """Send at least ``requests`` generated requests to fresh daemons in ``directory``."""
    tally = FuzzTally()
    session = FuzzSession(Path(directory), tally, restart_every)
    session.start()
    strategy = st.lists(
        steps_strategy(session.config), min_size=STEPS_PER_EXAMPLE, max_size=STEPS_PER_EXAMPLE
    )

    @settings(
        max_examples=requests // STEPS_PER_EXAMPLE + 10,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def steps(batch: list[Any]) -> None:
        for step in batch:
            if tally.requests >= requests:
                return
            run_step(session, step)
            session.restart_if_due()
        if progress is not None:
            progress(tally)

    try:
        while tally.requests < requests:
            (steps if seed is None else hypothesis_seed(seed + tally.requests)(steps))()
    finally:
        session.stop()
    return tally
