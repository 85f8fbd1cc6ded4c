"""The proposal's three GPU cases, run on the CPU with real processes (``scripts/demo.py``).

Per EP rank a model-less daemon (``sglang_integration.testing.daemon``: sglang's real
``WeightCacheDaemon`` serve loop with this plugin's hooks and a ledger) and shared-memory expert
tensors that every engine maps (``shared_experts``: each expert's bytes carry its logical id, so
any process can tell which expert a slot holds). Engines of 2 ranks on gloo
(``cpu_engine``) run sglang's real startup method, ``EPLBManager``, ``init_by_eplb`` and
``ExpertLocationUpdater``, through the plugin's real hooks.

- Case 1: engine A rebalances N times and stops; engine B starts on the same daemons. With the
  plugin B adopts the ledger's version and every slot holds the expert B's metadata names. The
  same run with the plugin disabled (sglang's own daemon and engines, no hook) shows the bug:
  B routes with the initial layout over moved experts.
- Case 2: a warm standby C attaches; A's begins come back busy and nothing moves; C matches A;
  after C exits, A rebalances again.
- Case 3: A is SIGKILLed between two chunks (B adopts the committed version) and, on fresh
  daemons, inside a move after begin (B refuses to start with the dirty reason).
- Forensics: ``layout-ledger status``, ``history`` and ``verify`` on the dirty daemon's ledger,
  and the README's ``sqlite3`` query naming the engine that left it dirty.

Every function returns data (``CaseResult``: checks with expected and measured values, notes,
seconds); ``scripts/demo.py`` renders it. A check whose expectation fails is a failed check,
never an exception; a process that fails or hangs raises (``EngineRankError`` and friends).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cpu_engine import (
    CpuEngine,
    EngineSpec,
    engine_process_context,
    free_port,
    write_tiny_moe_config,
)
from layout_ledger.layout import Map, layout_digest, trivial_map

# How long the parent waits for a daemon to see an engine's EOF (a thread of its own does).
DETACH_TIMEOUT = 30.0


@dataclass(frozen=True)
class DemoConfig:
    """The model shape and how many rebalances each case runs."""

    num_layers: int = 8
    num_logical_experts: int = 8
    num_redundant_experts: int = 4  # 2 per EP rank
    ep_size: int = 2
    layers_per_chunk: int = 4  # 8 layers -> 2 chunks (2 versions) per rebalance
    case1_rebalances: int = 10
    case2_rebalances: tuple[int, int, int] = (3, 3, 3)  # alone, with the standby, after it
    case3_rebalances_before_kill: int = 2
    load_seed: int = 11

    @property
    def num_physical_slots(self) -> int:
        return self.num_logical_experts + self.num_redundant_experts

    @property
    def all_slots(self) -> int:
        return self.num_layers * self.num_physical_slots

    @property
    def chunks_per_rebalance(self) -> int:
        return -(-self.num_layers // self.layers_per_chunk)

    def initial_map(self) -> Map:
        return trivial_map(self.num_layers, self.num_physical_slots, self.num_logical_experts)

    def describe(self) -> str:
        per_rank_slots = self.num_physical_slots // self.ep_size
        per_rank_redundant = self.num_redundant_experts // self.ep_size
        return (
            f"{self.num_layers} MoE layers x {self.num_physical_slots} physical slots "
            f"({self.num_logical_experts} logical experts + {self.num_redundant_experts} "
            f"redundant), EP {self.ep_size} ({self.ep_size} gloo ranks, {per_rank_slots} slots "
            f"and {per_rank_redundant} redundant per rank), {self.layers_per_chunk} layers per "
            f"chunk ({self.chunks_per_rebalance} chunks = {self.chunks_per_rebalance} versions "
            "per rebalance)"
        )


@dataclass(frozen=True)
class Check:
    """One expected outcome; ``ok`` is None for a measurement shown for information only."""

    what: str
    expected: str
    measured: str
    ok: bool | None


@dataclass
class CaseResult:
    title: str
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)  # values tests assert on

    def check(self, what: str, expected: Any, measured: Any, ok: bool) -> bool:
        self.checks.append(Check(what, str(expected), str(measured), bool(ok)))
        return bool(ok)

    def info(self, what: str, measured: Any) -> None:
        self.checks.append(Check(what, "-", str(measured), None))

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if check.ok is False]


# ---------------------------------------------------------------- the workspace -------------


class Workspace:
    """A temp dir for everything, the processes started in it, and their cleanup.

    Expert tensors live in a second temp dir under ``/dev/shm`` (shared memory) where there is
    one. ``close`` kills every engine rank still running, stops every daemon and removes both
    dirs (unless ``keep``); it runs on success, failure and Ctrl-C alike.
    """

    def __init__(self, config: DemoConfig, keep: bool = False) -> None:
        self.config = config
        self.keep = keep
        self.root = Path(tempfile.mkdtemp(prefix="layout-ledger-demo-"))
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            self.shm_root = Path(tempfile.mkdtemp(prefix="layout-ledger-demo-", dir=shm))
        else:
            self.shm_root = self.root / "shared-memory"
        self.model_dir = write_tiny_moe_config(
            self.root / "model", config.num_layers, config.num_logical_experts
        )
        self.context: Any = None
        self.startup_seconds = 0.0
        self._engines: list[CpuEngine] = []
        self._daemons: list[Any] = []

    def start_processes(self) -> float:
        """Start the forkserver (it imports sglang once); the seconds it took.

        Meanwhile this process imports what it needs to talk to daemons and read the experts
        (sglang's framing, torch): seconds of imports that then overlap the server's.
        """
        started = time.monotonic()
        importer = threading.Thread(target=_import_parent_side, daemon=True)
        importer.start()
        # The server inherits this process's stdout and stderr when it starts: send its import
        # noise (sglang's warnings about CUDA-only kernels) to a log file instead.
        with _output_to(self.root / "forkserver.log"):
            self.context = engine_process_context()
        warm = self.context.Process(target=_nothing)
        warm.start()
        warm.join(300)
        importer.join(300)
        if warm.exitcode != 0:
            raise RuntimeError(f"the forkserver's first process failed (exit {warm.exitcode})")
        self.startup_seconds = time.monotonic() - started
        return self.startup_seconds

    def case_dir(self, case: str) -> Path:
        path = self.root / case
        path.mkdir(parents=True, exist_ok=True)
        return path

    def daemons(self, case: str, record: str = "ledger") -> list[Any]:
        """One model-less daemon per EP rank, serving when this returns.

        As ``daemon_control.start_daemon`` starts them, except that each releases its copy of
        the forkserver's keep-alive pipe first (``release_forkserver``), so that no daemon
        outlives this process even when it is SIGKILLed.
        """
        from harness.daemon_control import (
            DaemonProcess,
            daemon_argv,
            wait_until_serving,
        )

        config = self.config
        directory = self.case_dir(case)
        started = []
        for rank in range(config.ep_size):
            name = f"daemon{rank}"
            socket_path = str(directory / f"{name}.sock")
            ledger = str(directory / f"{name}.sqlite") if record == "ledger" else None
            argv = daemon_argv(
                socket_path,
                ledger,
                num_layers=config.num_layers,
                num_logical_experts=config.num_logical_experts,
                num_physical_experts=config.num_physical_slots,
                record=record,
            )
            daemon = DaemonProcess(socket_path, ledger, str(directory / f"{name}.log"), argv)
            daemon.process = self.context.Process(
                target=_run_daemon, args=(argv, daemon.log_path), daemon=True
            )
            daemon.process.start()
            self._daemons.append(daemon)
            wait_until_serving(socket_path, daemon.is_alive, describe=daemon.log)
            started.append(daemon)
        return started

    def experts(self, case: str) -> Path:
        """New shared-memory experts in the daemons' initial layout (a daemon's fresh load)."""
        from harness.shared_experts import (
            ExpertTensorShape,
            create_shared_experts,
        )

        config = self.config
        directory = self.shm_root / case
        shape = ExpertTensorShape(
            config.num_layers, config.num_logical_experts, config.num_physical_slots, config.ep_size
        )
        for rank in range(config.ep_size):
            create_shared_experts(directory, rank, shape, config.initial_map())
        return directory

    def launch(
        self,
        case: str,
        name: str,
        daemons: Sequence[Any],
        expert_dir: Path,
        *,
        plugin: bool = True,
    ) -> CpuEngine:
        spec = EngineSpec(
            name=name,
            model_dir=str(self.model_dir),
            expert_dir=str(expert_dir),
            sockets=tuple(daemon.socket_path for daemon in daemons),
            port=free_port(),
            num_redundant=self.config.num_redundant_experts,
            layers_per_chunk=self.config.layers_per_chunk,
            plugin=plugin,
            load_seed=self.config.load_seed,
            log_dir=str(self.case_dir(case)),
        )
        engine = CpuEngine.launch(spec, self.context)
        self._engines.append(engine)
        return engine

    def processes_alive(self) -> list[str]:
        """The engine ranks and daemons this workspace started that still run."""
        alive = [
            f"engine {engine.spec.name} rank {rank} (pid {process.pid})"
            for engine in self._engines
            for rank, process in enumerate(engine.processes)
            if process.is_alive()
        ]
        alive += [f"daemon {d.socket_path} (pid {d.pid})" for d in self._daemons if d.is_alive()]
        return alive

    def close(self) -> None:
        from harness.shared_experts import remove_shared_experts

        for engine in self._engines:
            with contextlib.suppress(Exception):
                engine.kill()
        for daemon in self._daemons:
            with contextlib.suppress(Exception):
                daemon.stop(timeout=10.0)
        for directory in self.shm_root.glob("*"):
            remove_shared_experts(directory, self.config.ep_size)
        if not self.keep:
            _remove_tree(self.shm_root)
            _remove_tree(self.root)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 point at ``path`` inside the block (for processes it starts)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)


def _import_parent_side() -> None:
    import importlib

    # sglang's framing of every daemon request (it imports sglang), and torch.
    for module in ("sglang.srt.weight_cache.protocol", "harness.shared_experts"):
        importlib.import_module(module)


def _run_daemon(argv: list[str], log_path: str) -> None:
    """Forkserver child: the model-less daemon's ``main``, output to ``log_path``."""
    from harness.cpu_engine import release_forkserver
    from harness.daemon_control import redirect_output
    from sglang_integration.testing import daemon

    release_forkserver()
    redirect_output(log_path)
    raise SystemExit(daemon.main(argv))


def _nothing() -> None:
    """The forkserver's warm-up process."""


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- reading state -------------


def query_daemons(daemons: Sequence[Any]) -> list[Any]:
    """Each daemon's ``expert_layout_query`` reply (``client.Reply``)."""
    from sglang_integration import client

    return [client.query(daemon.socket_path) for daemon in daemons]


def wait_for_daemons(
    daemons: Sequence[Any], condition: Callable[[Any], bool], what: str
) -> list[Any]:
    """Poll every daemon until ``condition(layout)`` holds on each; the layouts."""
    deadline = time.monotonic() + DETACH_TIMEOUT
    while True:
        replies = query_daemons(daemons)
        layouts = [reply.layout for reply in replies]
        if all(layout is not None and condition(layout) for layout in layouts):
            return layouts
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemons did not reach {what} within {DETACH_TIMEOUT} s")
        time.sleep(0.05)


def held_map(expert_dir: Path) -> Map:
    """Which logical expert every slot's bytes hold, read by this process from shared memory."""
    from harness.shared_experts import read_physical_to_logical_map

    return read_physical_to_logical_map(expert_dir)


def matching(held: Map, the_map: Map) -> int:
    from harness.shared_experts import count_matching_slots

    return count_matching_slots(held, the_map)


def per_rank(values: Iterable[Any]) -> str:
    """One value per EP rank, in rank order; the same value on every rank is said once."""
    texts = [str(value) for value in values]
    if len(texts) > 1 and len(set(texts)) == 1:
        return f"{'both' if len(texts) == 2 else f'all {len(texts)}'}: {texts[0]}"
    return ", ".join(texts)


def both(value: Any, ep_size: int) -> str:
    """What ``per_rank`` shows when every rank has ``value``."""
    return per_rank([value] * ep_size)


def slots(count: int, config: DemoConfig) -> str:
    return f"{count}/{config.all_slots}"


def startup_line(report: dict[str, Any]) -> str | None:
    for _, line in report.get("logs", []):
        if line.startswith("Routing with the weight cache daemon's expert layout"):
            return str(line)
    return None


# ---------------------------------------------------------------- case 1 --------------------


def run_case1(workspace: Workspace) -> CaseResult:
    """A rebalances N times and stops; B starts on the same daemons (plugin on)."""
    config = workspace.config
    result = CaseResult("Case 1: restart on the same daemons (plugin on)")
    started = time.monotonic()
    n = config.case1_rebalances
    versions = n * config.chunks_per_rebalance
    daemons = workspace.daemons("case1")
    expert_dir = workspace.experts("case1")

    engine_a = workspace.launch("case1", "A", daemons, expert_dir)
    result.check(
        "A starts on the daemons at version",
        both("0", config.ep_size),
        per_rank(r["session"]["version"] for r in engine_a.started),
        all(r["session"]["version"] == 0 for r in engine_a.started),
    )
    a_reports = engine_a.rebalance(n)
    a_map = a_reports[0]["map"]
    result.check(
        f"A: rebalances done ({config.chunks_per_rebalance} chunks each)",
        both(n, config.ep_size),
        per_rank(r["state"]["rebalances_done"] for r in a_reports),
        all(r["state"]["rebalances_done"] == n for r in a_reports),
    )
    result.check(
        "A: its layout version (rebalance_state)",
        both(versions, config.ep_size),
        per_rank(r["state"]["version"] for r in a_reports),
        all(r["state"]["version"] == versions for r in a_reports),
    )
    result.check(
        "A: every slot holds the expert A routes to",
        slots(config.all_slots, config),
        slots(sum(r["matching"] for r in a_reports), config),
        sum(r["matching"] for r in a_reports) == config.all_slots,
    )
    result.info(
        "A: slots that moved away from the initial layout",
        slots(config.all_slots - matching(a_map, config.initial_map()), config),
    )
    engine_a.exit()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        "daemon version after A stopped (rebalances x chunks)",
        both(versions, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == versions for layout in layouts),
    )
    result.check(
        "daemons' map = A's last map; digest = sha256 of it",
        both("yes", config.ep_size),
        per_rank("yes" if layout.physical_to_logical_map == a_map else "no" for layout in layouts),
        all(
            layout.physical_to_logical_map == a_map and layout.digest == layout_digest(a_map)
            for layout in layouts
        ),
    )

    engine_b = workspace.launch("case1", "B", daemons, expert_dir)
    b_reports = engine_b.started
    b_map = b_reports[0]["map"]
    result.check(
        "B adopts the ledger's version at startup",
        both(versions, config.ep_size),
        per_rank(r["session"]["version"] for r in b_reports),
        all(r["session"]["version"] == versions for r in b_reports),
    )
    line = startup_line(b_reports[0])
    logged = [f"at version {versions} " in (startup_line(r) or "") for r in b_reports]
    result.check(
        "B logs: routes with the daemon's layout at it",
        both("yes", config.ep_size),
        per_rank(_yes(value) for value in logged),
        all(logged),
    )
    result.check(
        "B's metadata map = A's last map",
        "yes",
        "yes" if all(r["map"] == a_map for r in b_reports) else "no",
        all(r["map"] == a_map for r in b_reports),
    )
    b_correct = sum(r["matching"] for r in b_reports)
    result.check(
        "B: slots holding the expert B's map names (B's view)",
        slots(config.all_slots, config),
        slots(b_correct, config),
        b_correct == config.all_slots,
    )
    held = held_map(expert_dir)
    result.check(
        "B: the same, read from shared memory by this process",
        slots(config.all_slots, config),
        slots(matching(held, b_map), config),
        matching(held, b_map) == config.all_slots,
    )
    engine_b.exit()
    if line:
        result.notes.append(f"B's startup log (rank 0): {line}")
    result.facts.update(
        a_map=a_map,
        versions=versions,
        b_correct=b_correct,
        b_versions=[r["session"]["version"] for r in b_reports],
        a_rebalances=[r["state"]["rebalances_done"] for r in a_reports],
        daemon_versions=[layout.version for layout in layouts],
    )
    result.seconds = time.monotonic() - started
    return result


def run_case1_without_plugin(workspace: Workspace, plugin_a_map: Map | None) -> CaseResult:
    """The same run with the plugin disabled: sglang's own daemon and engines, no hook."""
    from sglang_integration import client

    config = workspace.config
    result = CaseResult("Case 1, plugin disabled: the bug (sglang 0.5.23's own behaviour)")
    started = time.monotonic()
    n = config.case1_rebalances
    daemons = workspace.daemons("case1-no-plugin", record="no-plugin")
    expert_dir = workspace.experts("case1-no-plugin")
    replies = query_daemons(daemons)
    result.check(
        "sglang's own daemon answers expert_layout_query",
        both("older_daemon", config.ep_size),
        per_rank(reply.outcome.value for reply in replies),
        all(reply.outcome is client.Outcome.OLDER_DAEMON for reply in replies),
    )
    engine_a = workspace.launch("case1-no-plugin", "A", daemons, expert_dir, plugin=False)
    a_reports = engine_a.rebalance(n)
    a_map = a_reports[0]["map"]
    result.check(
        "A (no plugin): rebalances run",
        both(n, config.ep_size),
        per_rank(r["rebalances_run"] for r in a_reports),
        all(r["rebalances_run"] == n for r in a_reports),
    )
    result.check(
        "A: slots holding the expert A routes to (A is right)",
        slots(config.all_slots, config),
        slots(sum(r["matching"] for r in a_reports), config),
        sum(r["matching"] for r in a_reports) == config.all_slots,
    )
    if plugin_a_map is not None:
        result.info(
            "A's moves = the plugin run's (same loads)", "yes" if a_map == plugin_a_map else "no"
        )
    engine_a.exit()
    engine_b = workspace.launch("case1-no-plugin", "B", daemons, expert_dir, plugin=False)
    b_map = engine_b.started[0]["map"]
    result.check(
        "B (no plugin) routes with",
        "the initial layout",
        "the initial layout" if b_map == config.initial_map() else "another layout",
        b_map == config.initial_map(),
    )
    held = held_map(expert_dir)
    wrong = config.all_slots - matching(held, b_map)
    result.check(
        "B: slots read wrongly (not the expert B's map names)",
        "> 0 (the bug)",
        slots(wrong, config),
        wrong > 0,
    )
    result.info("shared memory holds A's last layout", slots(matching(held, a_map), config))
    engine_b.exit()
    result.facts.update(
        wrong=wrong,
        b_correct=config.all_slots - wrong,
        a_rebalances=[r["rebalances_run"] for r in a_reports],
    )
    result.seconds = time.monotonic() - started
    return result


# ---------------------------------------------------------------- case 2 --------------------


def run_case2(workspace: Workspace) -> CaseResult:
    """A warm standby C pauses A's rebalancing; after C exits, A rebalances again."""
    config = workspace.config
    result = CaseResult("Case 2: a warm standby pauses rebalancing")
    started = time.monotonic()
    alone, with_standby, after = config.case2_rebalances
    chunks = config.chunks_per_rebalance
    daemons = workspace.daemons("case2")
    expert_dir = workspace.experts("case2")

    engine_a = workspace.launch("case2", "A", daemons, expert_dir)
    a_reports = engine_a.rebalance(alone)
    v1 = alone * chunks
    a_map = a_reports[0]["map"]
    result.check(
        f"A alone: {alone} rebalances, version",
        both(v1, config.ep_size),
        per_rank(r["state"]["version"] for r in a_reports),
        all(r["state"]["version"] == v1 for r in a_reports),
    )
    engine_c = workspace.launch("case2", "C", daemons, expert_dir)
    c_reports = engine_c.started
    result.check(
        "C attaches and adopts version",
        both(v1, config.ep_size),
        per_rank(r["session"]["version"] for r in c_reports),
        all(r["session"]["version"] == v1 for r in c_reports),
    )
    result.check(
        "C matches A: C's metadata map = A's map",
        "yes",
        "yes" if all(r["map"] == a_map for r in c_reports) else "no",
        all(r["map"] == a_map for r in c_reports),
    )
    c_correct = sum(r["matching"] for r in c_reports)
    result.check(
        "C: slots holding the expert C's metadata names",
        slots(config.all_slots, config),
        slots(c_correct, config),
        c_correct == config.all_slots,
    )
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "engines attached to each daemon",
        both("2", config.ep_size),
        per_rank(len(layout.attached) for layout in layouts),
        all(
            sorted(layout.attached) == sorted([str(engine_a.engine_id), str(engine_c.engine_id)])
            for layout in layouts
        ),
    )
    held_before = held_map(expert_dir)
    paused = engine_a.rebalance(with_standby)
    held_during = held_map(expert_dir)
    result.check(
        f"A's {with_standby} rebalances with C attached: busy, paused",
        both(with_standby, config.ep_size),
        per_rank(r["state"]["rebalances_paused"] for r in paused),
        all(r["state"]["rebalances_paused"] == with_standby for r in paused),
    )
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "daemon versions while C is attached (unchanged)",
        both(v1, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == v1 and layout.pending is None for layout in layouts),
    )
    moved = config.all_slots - matching(held_during, held_before)
    result.check(
        "slots moved while C is attached",
        "0",
        str(moved),
        moved == 0 and all(r["map"] == a_map for r in paused),
    )
    paused_line = next(
        (line for _, line in paused[0]["logs"] if line.startswith("EPLB rebalance paused")), None
    )
    if paused_line:
        result.notes.append(f"A's log (rank 0): {paused_line}")
    engine_c.exit()
    polls = engine_a.wait_alone()
    result.info(
        "A alone again after C exited (daemon polls per rank)", per_rank(p["polls"] for p in polls)
    )
    resumed = engine_a.rebalance(after)
    v2 = v1 + after * chunks
    result.check(
        f"after C: A's {after} rebalances move again, version",
        both(v2, config.ep_size),
        per_rank(r["state"]["version"] for r in resumed),
        all(r["state"]["version"] == v2 for r in resumed)
        and all(r["daemon"]["version"] == v2 for r in resumed),
    )
    a_correct = sum(r["matching"] for r in resumed)
    result.check(
        "A: slots holding the expert A routes to",
        slots(config.all_slots, config),
        slots(a_correct, config),
        a_correct == config.all_slots and resumed[0]["map"] != a_map,
    )
    engine_a.exit()
    result.facts.update(v1=v1, v2=v2, paused=[r["state"]["rebalances_paused"] for r in paused])
    result.seconds = time.monotonic() - started
    return result


# ---------------------------------------------------------------- case 3 --------------------


def run_case3(workspace: Workspace) -> tuple[CaseResult, list[Any]]:
    """SIGKILL between chunks, then (fresh daemons) SIGKILL mid-move after begin.

    Returns the result and the second pair of daemons, still running and dirty, for forensics.
    """
    config = workspace.config
    result = CaseResult("Case 3: SIGKILL during a rebalance")
    started = time.monotonic()
    k = config.case3_rebalances_before_kill
    chunks = config.chunks_per_rebalance
    first_chunk = list(range(min(config.layers_per_chunk, config.num_layers)))

    # (a) between chunks: the first chunk of rebalance k+1 committed, the second not begun.
    daemons = workspace.daemons("case3-between-chunks")
    expert_dir = workspace.experts("case3-between-chunks")
    engine_a = workspace.launch("case3-between-chunks", "A", daemons, expert_dir)
    stopped = engine_a.stop_between_chunks(k)
    committed = k * chunks + 1
    layouts = [reply.layout for reply in query_daemons(daemons)]
    result.check(
        "(a) stopped between chunks: version, none pending",
        both(committed, config.ep_size),
        per_rank(layout.version for layout in layouts),
        all(layout.version == committed and layout.pending is None for layout in layouts),
    )
    engine_a.kill()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        "(a) SIGKILL: A detached (socket EOF), daemons",
        both("clean", config.ep_size),
        per_rank("dirty" if layout.dirty else "clean" for layout in layouts),
        not any(layout.dirty for layout in layouts),
    )
    half, before = stopped[0]["map"], stopped[0]["map_before"]
    cut = len(first_chunk)
    result.check(
        f"(a) A's map: layers moved / as at version {committed - 1}",
        f"{_layers(0, cut)} / {_layers(cut, config.num_layers)}",
        f"{_layers_where(half, before, moved=True)} / {_layers_where(half, before, moved=False)}",
        all(half[layer] != before[layer] for layer in range(cut)) and half[cut:] == before[cut:],
    )
    engine_b = workspace.launch("case3-between-chunks", "B", daemons, expert_dir)
    b_reports = engine_b.started
    result.check(
        "(a) B adopts the committed version",
        both(committed, config.ep_size),
        per_rank(r["session"]["version"] for r in b_reports),
        all(r["session"]["version"] == committed for r in b_reports),
    )
    held = held_map(expert_dir)
    b_correct = matching(held, b_reports[0]["map"])
    result.check(
        "(a) B: slots holding the expert B's metadata names",
        slots(config.all_slots, config),
        slots(b_correct, config),
        b_correct == config.all_slots and b_reports[0]["map"] == half,
    )
    engine_b.exit()

    # (b) in the move, after begin: the first layer of the chunk moved, the others not.
    daemons = workspace.daemons("case3-in-move")
    expert_dir = workspace.experts("case3-in-move")
    engine_a = workspace.launch("case3-in-move", "A", daemons, expert_dir)
    base = k * chunks
    stopped = engine_a.stop_in_move(k)
    a_id = engine_a.engine_id
    layouts = [reply.layout for reply in query_daemons(daemons)]
    expected_pending = f"layers {_layers(0, len(first_chunk))}, base {base}"
    result.check(
        "(b) stopped in the move after begin: A's pending",
        both(expected_pending, config.ep_size),
        per_rank(
            "none"
            if layout.pending is None
            else (
                ("" if layout.pending.engine_id == a_id else f"{layout.pending.engine_id}: ")
                + f"layers {_layer_list(layout.pending.layers)}, base "
                f"{layout.pending.base_version}"
            )
            for layout in layouts
        ),
        all(
            layout.pending is not None
            and layout.pending.engine_id == a_id
            and list(layout.pending.layers) == first_chunk
            and layout.pending.base_version == base
            for layout in layouts
        ),
    )
    held = held_map(expert_dir)
    committed_map = layouts[0].physical_to_logical_map
    result.info(
        "(b) slots already moved (B would misread them)",
        slots(config.all_slots - matching(held, committed_map), config),
    )
    engine_a.kill()
    layouts = wait_for_daemons(daemons, lambda layout: not layout.attached, "A detached")
    result.check(
        "(b) after SIGKILL: daemons dirty",
        both("dirty", config.ep_size),
        per_rank("dirty" if layout.dirty else "clean" for layout in layouts),
        all(layout.dirty for layout in layouts),
    )
    engine_b = workspace.launch("case3-in-move", "B", daemons, expert_dir)
    refusals = engine_b.failed
    result.check(
        "(b) B refuses to start (ExpertLayoutStartupError)",
        both("refused", config.ep_size),
        per_rank(
            "refused" if r["error_type"] == "ExpertLayoutStartupError" else r["error_type"]
            for r in refusals
        )
        if refusals
        else "started",
        len(refusals) == config.ep_size
        and all(r["error_type"] == "ExpertLayoutStartupError" for r in refusals),
    )
    reason = refusals[0]["error"] if refusals else ""
    names = [
        "dirty",
        repr(a_id),
        f"layers {first_chunk}",
        f"version {base}",
    ]
    result.check(
        "(b) B's reason names dirty, A, layers, base version",
        "all 4",
        f"{sum(name in reason for name in names)} of 4",
        all(name in reason for name in names),
    )
    if reason:
        result.notes.append(f"B's startup error (rank 0): ExpertLayoutStartupError: {reason}")
    result.notes.append(f"engine A of (b) is {a_id}")
    result.facts.update(committed=committed, engine_a=a_id, base=base, layers=first_chunk)
    result.seconds = time.monotonic() - started
    return result, daemons


def _layers(first: int, end: int) -> str:
    return "none" if end <= first else f"{first}-{end - 1}" if end - first > 1 else str(first)


def _layers_where(after: Map, before: Map, *, moved: bool) -> str:
    return _layer_list(
        [layer for layer in range(len(after)) if (after[layer] != before[layer]) == moved]
    )


def _layer_list(layers: Sequence[int]) -> str:
    """``0-3`` for a run of layers, else the layers listed."""
    layers = list(layers)
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return _layers(layers[0], layers[-1] + 1)
    return ",".join(str(layer) for layer in layers)


# ---------------------------------------------------------------- forensics -----------------


@dataclass(frozen=True)
class CommandOutput:
    command: str
    exit_code: int
    output: str


def layout_ledger_command() -> str:
    """The console script beside this Python (the venv's ``bin/layout-ledger``)."""
    import shutil

    beside = Path(sys.executable).parent / "layout-ledger"
    if beside.exists():
        return str(beside)
    found = shutil.which("layout-ledger")
    if found is None:
        raise FileNotFoundError("the layout-ledger console script is not installed")
    return found


def readme_query(readme: Path, name: str) -> str:
    """The SQL of the README's forensic cookbook block that starts with ``-- forensic: NAME``."""
    text = readme.read_text()
    for block in re.findall(r"```sql\n(.*?)```", text, flags=re.DOTALL):
        first = block.splitlines()[0].strip()
        if first == f"-- forensic: {name}":
            return str(block).strip()
    raise LookupError(f"{readme} has no sql block '-- forensic: {name}'")


def run_sql_read_only(ledger: str, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The rows of ``sql`` on the ledger opened read-only, as the README says to open it."""
    connection = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        cursor = connection.execute(sql)
        columns = [description[0] for description in cursor.description]
        return columns, cursor.fetchall()
    finally:
        connection.close()


def run_forensics(
    ledger: str, readme: Path, case3: CaseResult, history_last: int = 12
) -> tuple[CaseResult, list[CommandOutput], tuple[str, list[str], list[tuple[Any, ...]]]]:
    """``layout-ledger status/history/verify`` and the README's dirty query on one ledger."""
    result = CaseResult("Forensics: the ledger of case 3 (b)'s rank-0 daemon")
    started = time.monotonic()
    program = layout_ledger_command()
    outputs = []
    for args in (["status"], ["history", "--last", str(history_last)], ["verify"]):
        completed = subprocess.run(
            [program, args[0], ledger, *args[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        outputs.append(
            CommandOutput(
                " ".join(["layout-ledger", args[0], ledger, *args[1:]]),
                completed.returncode,
                (completed.stdout + completed.stderr).rstrip(),
            )
        )
    status, history, verify = outputs
    result.check(
        "layout-ledger status: state, exit code",
        "dirty, 3",
        f"{_status_state(status.output)}, {status.exit_code}",
        status.exit_code == 3 and _status_state(status.output) == "dirty",
    )
    result.check(
        "layout-ledger history: the dirty event is there",
        "yes",
        _yes("  dirty " in history.output),
        history.exit_code == 0 and "  dirty " in history.output,
    )
    result.check(
        "layout-ledger verify: exit code", "0", str(verify.exit_code), verify.exit_code == 0
    )
    sql = readme_query(readme, "dirty")
    columns, rows = run_sql_read_only(ledger, sql)
    engine_a = case3.facts.get("engine_a")
    row = dict(zip(columns, rows[0], strict=True)) if rows else {}
    result.check(
        "README query 'dirty': engine, layers, base version",
        f"A, {case3.facts.get('layers')}, {case3.facts.get('base')}",
        (
            f"{'A' if row.get('engine_id') == engine_a else row.get('engine_id')}, "
            f"{row.get('layers')}, {row.get('base_version')}"
            if row
            else "no row"
        ),
        len(rows) == 1
        and row.get("engine_id") == engine_a
        and json.loads(str(row.get("layers"))) == case3.facts.get("layers")
        and row.get("base_version") == case3.facts.get("base"),
    )
    result.seconds = time.monotonic() - started
    return result, outputs, (sql, columns, rows)


def _status_state(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("state:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _yes(value: bool) -> str:
    return "yes" if value else "no"


# ---------------------------------------------------------------- everything ----------------


@dataclass
class DemoRun:
    config: DemoConfig
    forkserver_seconds: float = 0.0
    cases: list[CaseResult] = field(default_factory=list)
    commands: list[CommandOutput] = field(default_factory=list)
    query: tuple[str, list[str], list[tuple[Any, ...]]] | None = None

    @property
    def failed(self) -> list[tuple[str, Check]]:
        return [(case.title, check) for case in self.cases for check in case.failed]


def run_demo(
    workspace: Workspace,
    readme: Path,
    on_case: Callable[[CaseResult], None] | None = None,
) -> DemoRun:
    """Every case in order; ``on_case`` sees each result as soon as it is ready."""
    run = DemoRun(workspace.config)
    if workspace.context is None:
        workspace.start_processes()
    run.forkserver_seconds = workspace.startup_seconds

    def done(case: CaseResult) -> CaseResult:
        run.cases.append(case)
        if on_case is not None:
            on_case(case)
        return case

    case1 = done(run_case1(workspace))
    done(run_case1_without_plugin(workspace, case1.facts.get("a_map")))
    done(run_case2(workspace))
    case3, dirty_daemons = run_case3(workspace)
    done(case3)
    forensics, run.commands, run.query = run_forensics(dirty_daemons[0].ledger_path, readme, case3)
    forensics.facts.update(commands=run.commands, query=run.query)
    done(forensics)
    return run


@contextlib.contextmanager
def workspace_for(config: DemoConfig, keep: bool = False) -> Iterator[Workspace]:
    workspace = Workspace(config, keep=keep)
    try:
        yield workspace
    finally:
        workspace.close()
