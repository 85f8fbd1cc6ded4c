"""The demo's workspace: temp dirs, the forkserver, daemons, shared-memory experts and engines
started in it, their cleanup, and reading what they serve and hold.

With a model (``DemoConfig.model``) the daemons are model-backed (``testing.daemons``: sglang's
own daemon loading a checkpoint written for the run), the experts are their real routed-expert
tensors, and what a slot holds is judged against the checkpoint (``testing.checkpoint_experts``);
without one, or where a case asks for it (``synthetic=True``), they are the synthetic stand-in
(model-less daemons, ``testing.shared_experts`` whose bytes carry their id).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from demo_cases.answers import Answers, record_answer
from demo_cases.config import DemoConfig
from demo_cases.results import CaseResult, slots
from layout_ledger.core.layout import Map, trivial_map
from sglang_integration.testing.cpu_engine import (
    CpuEngine,
    EngineSpec,
    engine_process_context,
    free_port,
    write_tiny_moe_config,
)

# How long the parent waits for a daemon to see an engine's EOF (a thread of its own does).
DETACH_TIMEOUT = 30.0


class Workspace:
    """A temp dir for everything, the processes started in it, and their cleanup.

    The synthetic stand-in's expert tensors live in a second temp dir under ``/dev/shm`` (shared
    memory) where there is one; a model-backed daemon's lie beside its socket. ``close`` kills
    every engine rank still running, stops every daemon and removes both dirs (unless ``keep``);
    it runs on success, failure and Ctrl-C alike.
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
        self.checkpoint: Path | None = None
        if config.model is not None:
            from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint

            spec = CheckpointSpec(
                model=config.model,
                dtype=config.dtype,
                seed=config.load_seed,
                num_layers=config.num_hidden_layers,
                num_experts=config.num_logical_experts,
            )
            self.checkpoint = write_checkpoint(self.root / "checkpoint", spec)
            self.model_dir = self.checkpoint
        else:
            self.model_dir = write_tiny_moe_config(
                self.root / "model", config.num_layers, config.num_logical_experts
            )
        self.context: Any = None
        self.startup_seconds = 0.0
        self.answers = Answers()  # what the engines answered (answers.py)
        self._engines: list[CpuEngine] = []
        self._daemons: list[Any] = []
        self._groups: list[Any] = []

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

    @property
    def model_backed(self) -> bool:
        return self.checkpoint is not None

    def daemons(
        self,
        case: str,
        record: str = "ledger",
        experts: Path | None = None,
        count: int | None = None,
        synthetic: bool = False,
        *,
        flags: Sequence[str] = (),
        num_redundant_experts: int | None = None,
    ) -> list[Any]:
        """One daemon per EP rank, serving when this returns. Model-backed (unless
        ``synthetic``): a group loading the checkpoint, in ``experts`` (``experts()``'s run
        directory); ``record`` is ledger, none (no ``--enable-eplb``) or no-plugin. Else
        model-less daemons (``count`` of them: ranks 0..count-1); with ``experts``, each serves
        (and fingerprints) its rank's expert files there (``--experts``). ``flags``: more daemon
        flags (``--expert-layout-restore initial``); ``num_redundant_experts``: another geometry
        than the config's.

        As ``daemon_control.start_daemon`` starts them, except that each releases its copy of
        the forkserver's keep-alive pipe first (``release_forkserver``), so that no daemon
        outlives this process even when it is SIGKILLed.
        """
        if self.model_backed and not synthetic:
            return self._model_daemons(
                case, record, experts, flags=flags, num_redundant_experts=num_redundant_experts
            )
        config = self.config
        redundant = (
            config.num_redundant_experts
            if num_redundant_experts is None
            else (num_redundant_experts)
        )
        return [
            self._synthetic_daemon(case, rank, record, experts, flags=flags, redundant=redundant)
            for rank in range(config.ep_size if count is None else count)
        ]

    def restart_alone(self, case: str, daemon: Any, rank: int, experts: Path, the_map: Map) -> Any:
        """Stop one model-less daemon of a case, write its rank's expert files in ``the_map``
        (what its restart's load from disk puts there: the layout it restores, its last
        committed one) and start it again alone on its ledger."""
        from sglang_integration.testing.shared_experts import create_shared_experts, read_shape

        daemon.stop()
        create_shared_experts(experts, rank, read_shape(experts, rank), the_map)
        redundant = self.config.num_redundant_experts
        return self._synthetic_daemon(case, rank, "ledger", experts, flags=(), redundant=redundant)

    def _synthetic_daemon(
        self,
        case: str,
        rank: int,
        record: str,
        experts: Path | None,
        *,
        flags: Sequence[str],
        redundant: int,
    ) -> Any:
        """One model-less daemon for ``rank``, serving when this returns (see ``daemons``)."""
        from sglang_integration.testing.daemon_control import (
            DaemonProcess,
            daemon_argv,
            wait_until_serving,
        )

        config = self.config
        directory = self.case_dir(case)
        name = f"daemon{rank}"
        socket_path = str(directory / f"{name}.sock")
        ledger = str(directory / f"{name}.sqlite") if record == "ledger" else None
        argv = daemon_argv(
            socket_path,
            ledger,
            num_layers=config.num_layers,
            num_logical_experts=config.num_logical_experts,
            num_physical_experts=config.num_logical_experts + redundant,
            record=record,
            # Which rank each daemon stands in for, recorded in its ledger (fleet's rows).
            extra=(["--tp-rank", str(rank), "--ep-rank", str(rank)] if ledger else [])
            + ([] if experts is None else ["--experts", str(experts), "--expert-rank", str(rank)])
            + list(flags),
        )
        daemon = DaemonProcess(socket_path, ledger, str(directory / f"{name}.log"), argv)
        daemon.process = self.context.Process(
            target=_run_daemon, args=(argv, daemon.log_path), daemon=True
        )
        daemon.process.start()
        self._daemons.append(daemon)
        wait_until_serving(socket_path, daemon.is_alive, describe=_exit_and_log(daemon))
        return daemon

    def _model_daemons(
        self,
        case: str,
        record: str,
        run_dir: Path | None,
        *,
        flags: Sequence[str] = (),
        num_redundant_experts: int | None = None,
    ) -> list[Any]:
        from sglang_integration.testing.daemons import start_model_daemons

        modes = {"ledger": [], "none": ["--no-record"], "no-plugin": ["--without-plugin"]}
        if self.checkpoint is None or record not in modes:
            raise ValueError(f"no model-backed daemons with record {record!r}")
        redundant = self.config.num_redundant_experts
        group = start_model_daemons(
            run_dir or self.experts(case),
            self.checkpoint,
            ep_size=self.config.ep_size,
            num_redundant_experts=redundant
            if num_redundant_experts is None
            else (num_redundant_experts),
            daemon_args=[
                *modes[record],
                "--dtype",
                self.config.model_dtype,
                *_heal_off_unless_given(flags),
                *flags,
            ],
        )
        self._groups.append(group)
        return [group.daemon(rank) for rank in range(group.ep_size)]

    def experts(self, case: str, ep_size: int | None = None, synthetic: bool = False) -> Path:
        """Where a case's experts are. Model-backed (unless ``synthetic``): the run directory of
        its daemons, whose fresh load puts the checkpoint's experts in their initial layout
        there. Else new synthetic shared-memory experts in the daemons' initial layout, of
        ``ep_size`` ranks (the config's by default)."""
        from sglang_integration.testing.shared_experts import (
            ExpertTensorShape,
            create_shared_experts,
        )

        if self.model_backed and not synthetic:
            return self.case_dir(case) / "run"
        config = self.config
        directory = self.shm_root / case
        ranks = config.ep_size if ep_size is None else ep_size
        shape = ExpertTensorShape(
            config.num_layers, config.num_logical_experts, config.num_physical_slots, ranks
        )
        initial = trivial_map(
            config.num_layers, config.num_physical_slots, config.num_logical_experts
        )  # the model-less daemon's initial layout: one row per MoE layer
        for rank in range(ranks):
            create_shared_experts(directory, rank, shape, initial)
        return directory

    def launch(
        self,
        case: str,
        name: str,
        daemons: Sequence[Any],
        expert_dir: Path,
        *,
        plugin: bool = True,
        env: tuple[tuple[str, str], ...] = (),
        stop_in_converge: bool = False,
        dtype: str | None = None,
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
            env=env,
            checkpoint=None if self.checkpoint is None else str(self.checkpoint),
            stop_in_converge=stop_in_converge,
            dtype=(dtype or self.config.model_dtype) if self.model_backed else None,
        )
        engine = CpuEngine.launch(spec, self.context)
        self._engines.append(engine)
        return engine

    def launch_from_disk(
        self,
        case: str,
        name: str,
        init_expert_location: Map | None = None,
        dtype: str | None = None,
    ) -> CpuEngine:
        """An engine of ``config.ep_size`` ranks that loads every weight from the checkpoint (the
        weight cache off), in sglang's initial layout or, given ``init_expert_location``, in that
        map (sglang's ``--init-expert-location``, a file written in the case's directory)."""
        import json

        if self.checkpoint is None:
            raise ValueError("an engine from disk needs a checkpoint (a model-backed demo)")
        init = None
        if init_expert_location is not None:
            path = self.case_dir(case) / f"init-expert-location-{name}.json"
            path.write_text(json.dumps({"physical_to_logical_map": init_expert_location}))
            init = str(path)
        spec = EngineSpec(
            name=name,
            model_dir=str(self.model_dir),
            expert_dir="",
            sockets=(),
            port=free_port(),
            num_redundant=self.config.num_redundant_experts,
            layers_per_chunk=self.config.layers_per_chunk,
            load_seed=self.config.load_seed,
            log_dir=str(self.case_dir(case)),
            checkpoint=str(self.checkpoint),
            from_disk=True,
            ranks=self.config.ep_size,
            dtype=dtype or self.config.model_dtype,
            init_expert_location=init,
        )
        engine = CpuEngine.launch(spec, self.context)
        self._engines.append(engine)
        return engine

    # ------------------------------------------------------------ what engines answer

    @property
    def answers_tokens(self) -> bool:
        """Whether this demo's engines compute tokens (a model-backed demo)."""
        return self.model_backed

    def reference(self, case: str) -> list[list[int]]:
        """R's greedy tokens: an engine from disk in sglang's initial layout, never rebalanced
        (answered once per workspace)."""
        from demo_cases.answers import tokens_of

        if self.answers.reference is None:
            engine_r = self.launch_from_disk(case, "R")
            try:
                self.answers.reference = tokens_of(engine_r.generate())
            finally:
                engine_r.exit()
        return self.answers.reference

    def answer(
        self,
        result: CaseResult,
        label: str,
        engine: CpuEngine,
        *,
        expect_equal: bool = True,
        check: bool = True,
        routes: str | None = None,
    ) -> list[dict[str, Any]]:
        """One greedy pass of ``engine`` (the default prompts), recorded as ``label``'s row of
        the answers table and checked against R in ``result`` (``answers.record_answer``; R
        answers first if it has not yet)."""
        self.reference("reference")
        replies = engine.generate()
        record_answer(
            self.answers,
            result,
            label,
            replies,
            expect_equal=expect_equal,
            check=check,
            routes=routes,
        )
        return replies

    def processes_alive(self) -> list[str]:
        """The engine ranks and daemons this workspace started that still run."""
        alive = [
            f"engine {engine.spec.name} rank {rank} (pid {process.pid})"
            for engine in self._engines
            for rank, process in enumerate(engine.processes)
            if process.is_alive()
        ]
        alive += [f"daemon {d.socket_path} (pid {d.pid})" for d in self._daemons if d.is_alive()]
        alive += [
            f"daemon {group.socket(rank)} (pid {group.pid(rank)})"
            for group in self._groups
            for rank in range(group.ep_size)
            if group.is_alive(rank)
        ]
        return alive

    # ------------------------------------------------------------ what the slots hold

    def check_slots_hold(
        self, result: CaseResult, expert_dir: Path, the_map: Map, whose: str
    ) -> None:
        """One check of ``result``: every slot holds the expert ``the_map`` (``whose`` map)
        names there, read from shared memory (``held_map``)."""
        right = matching(self.held_map(expert_dir), self.config.moe_rows(the_map))
        result.check(
            f"slots holding the expert {whose} map names"
            + (" (vs the checkpoint)" if self.model_backed else ""),
            slots(self.config.all_slots, self.config),
            slots(right, self.config),
            right == self.config.all_slots,
        )

    def held_map(self, expert_dir: Path) -> Map:
        """Which logical expert every slot of each MoE layer holds, read by this process from
        shared memory (-1: no whole expert): judged against the checkpoint when model-backed,
        else read from the synthetic bytes."""
        if not self.model_backed or not (expert_dir / "rank0.routed.json").exists():
            return held_map(expert_dir)
        from sglang_integration.testing.checkpoint_experts import ModelExperts

        rows: dict[int, list[int]] = {}
        for rank in range(self.config.ep_size):
            socket = str(expert_dir / f"rank{rank}.sock")
            experts = ModelExperts.of_daemon(socket, str(self.checkpoint))
            for layer, held in experts.held_rows().items():
                rows.setdefault(layer, []).extend(held)
        return [rows[layer] for layer in self.config.moe_layer_ids]

    def overwrite_half(self, expert_dir: Path, layer: int, slot: int) -> tuple[int, int]:
        """Overwrite the first half of rank 0's ``slot`` of ``layer`` (its first two fingerprint
        parts) with another expert's bytes, as a mover killed mid-copy leaves it: (the expert it
        held, the expert written over it)."""
        config = self.config
        if not self.model_backed:
            from sglang_integration.testing.shared_experts import (
                attach_shared_experts,
                expert_values,
            )

            held = held_map(expert_dir)[layer][slot]
            other = (held + 1) % config.num_logical_experts
            experts = attach_shared_experts(expert_dir, 0)
            half = sum(experts.shape.widths) // 2
            width = experts.shape.widths[0]
            experts.tensors[0][layer, slot, :half] = expert_values(layer, other, 0, width)[:half]
            return held, other
        from sglang_integration.testing.routed_weights import attach_routed_weights

        row = self.held_map(expert_dir)[layer - config.first_moe_layer]
        held = row[slot]
        source = next(s for s in range(len(row) // config.ep_size) if row[s] not in (held, -1))
        tensors = attach_routed_weights(expert_dir / "rank0.sock").routed_experts_weights_of_layer
        overwrite_first_words(tensors[layer], slot, source)
        return held, row[source]

    def close(self) -> None:
        from sglang_integration.testing.shared_experts import remove_shared_experts

        for engine in self._engines:
            with contextlib.suppress(Exception):
                engine.kill()
        for group in self._groups:
            with contextlib.suppress(Exception):
                group.stop(timeout=10.0)
        for daemon in self._daemons:
            with contextlib.suppress(Exception):
                daemon.stop(timeout=10.0)
        for directory in self.shm_root.glob("*"):
            remove_shared_experts(directory, self.config.ep_size)
        if not self.keep:
            _remove_tree(self.shm_root)
            _remove_tree(self.root)


@contextlib.contextmanager
def started_workspace(config: DemoConfig) -> Iterator[Workspace]:
    """A ``Workspace`` with its processes started; closed on the way out, however it is left
    (every process stopped, its temp dirs removed)."""
    workspace = Workspace(config)
    try:
        workspace.start_processes()
        yield workspace
    finally:
        workspace.close()


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
    for module in ("sglang.srt.weight_cache.protocol", "sglang_integration.testing.shared_experts"):
        importlib.import_module(module)


def _exit_and_log(daemon: Any) -> Any:
    """What to say of a daemon that did not start: how it exited, and its log."""
    return lambda: f"exit code {daemon.wait(1.0)}; log: {daemon.log() or '(empty)'}"


def _run_daemon(argv: list[str], log_path: str) -> None:
    """Forkserver child: the model-less daemon's ``main``, output to ``log_path``."""
    from sglang_integration.testing import daemon
    from sglang_integration.testing.cpu_engine import release_forkserver
    from sglang_integration.testing.daemon_control import redirect_output

    release_forkserver()
    redirect_output(log_path)
    raise SystemExit(daemon.main(argv))


def _nothing() -> None:
    """The forkserver's warm-up process."""


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- reading state -------------


def _heal_off_unless_given(flags: Sequence[str]) -> list[str]:
    """The cases before 7 show what a dirty daemon does without a heal (refusals, the content
    repair, which runs where no heal does: docs/design.md "Heal and content repair"), so their
    daemons run with ``--expert-layout-heal off``; case 7 passes ``auto``."""
    return [] if "--expert-layout-heal" in flags else ["--expert-layout-heal", "off"]


def query_daemons(daemons: Sequence[Any]) -> list[Any]:
    """Each daemon's ``expert_layout_query`` reply (``client.Reply``)."""
    from sglang_integration.engine import client

    return [client.query(daemon.socket_path) for daemon in daemons]


def wait_for_daemons(
    daemons: Sequence[Any],
    condition: Callable[[Any], bool],
    what: str,
    timeout: float = DETACH_TIMEOUT,
) -> list[Any]:
    """Poll every daemon until ``condition(layout)`` holds on each; the layouts."""
    deadline = time.monotonic() + timeout
    while True:
        replies = query_daemons(daemons)
        layouts = [reply.layout for reply in replies]
        if all(layout is not None and condition(layout) for layout in layouts):
            return layouts
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemons did not reach {what} within {timeout} s")
        time.sleep(0.05)


def content_checks(daemons: Sequence[Any]) -> list[str]:
    """Per daemon, ``matching/total``: slots whose fingerprint now is the one it recorded
    (``expert_layout_content_check``); ``no content`` for a daemon that records none."""
    from sglang_integration.engine import client

    texts = []
    for daemon in daemons:
        content = client.content_check(daemon.socket_path).content
        if content is None:
            texts.append("no content")
            continue
        pairs = [
            (a, b)
            for layer, recorded in content.recorded.items()
            for a, b in zip(recorded, content.current[layer], strict=True)
        ]
        texts.append(f"{sum(a == b for a, b in pairs)}/{len(pairs)}")
    return texts


def overwrite_first_words(tensors: Sequence[Any], slot: int, source: int) -> None:
    """Copy the first half of ``source``'s words (the tensors' bytes one after the other, as
    the fingerprint reads them: parts 0-1 of 4) over ``slot``'s."""
    import torch

    sizes = [tensor[slot].numel() * tensor.element_size() for tensor in tensors]
    if any(size % 4 for size in sizes):
        raise ValueError(f"a slot's tensor is not whole int32 words: {sizes} bytes")
    left = sum(size // 4 for size in sizes) * 2 // 4 * 4  # bytes of the first two parts
    for tensor, size in zip(tensors, sizes, strict=True):
        count = min(left, size)
        if count <= 0:
            break
        target = tensor[slot].view(-1).view(torch.uint8)
        target[:count] = tensor[source].view(-1).view(torch.uint8)[:count]
        left -= count


def held_map(expert_dir: Path) -> Map:
    """Which logical expert every slot's bytes hold, read by this process from the synthetic
    stand-in's shared memory."""
    from sglang_integration.testing.shared_experts import read_physical_to_logical_map

    return read_physical_to_logical_map(expert_dir)


def matching(held: Map, the_map: Map) -> int:
    from sglang_integration.testing.shared_experts import count_matching_slots

    return count_matching_slots(held, the_map)
