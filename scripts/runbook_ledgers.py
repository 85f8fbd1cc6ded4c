#!/usr/bin/env python3
"""The ledgers of docs/operations.md's incidents, each in the state its section shows.

    .venv/bin/python scripts/runbook_ledgers.py [DIR]   (default /tmp/layout-ledger-runbook)
    .venv/bin/python scripts/runbook_ledgers.py --rewrite-docs   (after an output changed)

Builds under DIR one directory per incident, each with the two ranks' ledgers (``daemon0.sqlite``,
``daemon1.sqlite``) of an engine over the demo's geometry (8 layers x 12 physical slots, 8
logical experts), written through the daemon's own ``Ledger`` and rules by one process per
daemon. A daemon the incident needs running stays running (its process holds the ledger and
its writer lock) until this script is interrupted; a killed one is a process that exited
without ending its incarnation, as a SIGKILLed daemon leaves it. Then run the runbook's commands
on DIR's ledgers. tests/test_runbook_examples.py builds them the same way and checks every
command of the runbook against its output on the page; ``--rewrite-docs`` builds them in a
scratch directory, runs every command of docs/operations.md's console blocks and writes what
each printed back into the page (paths shown under /tmp/layout-ledger-runbook; a ``...`` the
page has keeps the same lines left out).

The incidents (the directory: the section of docs/operations.md):

- ``dirty``: "... because a daemon is dirty": engine-a detached during its move from version 4;
- ``disagree``: "... because the daemons disagree": rank 0 at version 20, rank 1 restarted;
- ``pending``: "... because a move is pending, or stuck": engine-stuck began a move at 20;
- ``paused``: "Rebalancing paused": engine-standby attached beside engine-stuck, two busy begins;
- ``died``: "A daemon died, or restarted": rank 1's daemon killed at version 20; ``restarted``:
  the same, then started again (a second incarnation);
- ``backup``: "Backups": rank 0 at version 20, running;
- ``healthy``: the README's first look: both ranks at version 20, clean, engine-a attached, at the
  default location's names (``healthy/sglang/expert_layouts/expert_layout_GPU-R.sqlite``: the
  README's /var/lib/sglang/expert_layouts/ once ``healthy`` is read as /var/lib).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from layout_ledger.core import errors
from layout_ledger.core.layout import Geometry, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin

BIN = Path(sys.executable).parent
GEOMETRY = Geometry(num_layers=8, num_physical_slots=12, num_logical_experts=8)
DEFAULT_DIR = Path("/tmp/layout-ledger-runbook")
INCIDENTS = ("dirty", "disagree", "pending", "paused", "died", "restarted", "backup", "healthy")


def _row(step: int, layer: int) -> list[int]:
    """A valid row (every expert placed), different for each step and layer."""
    experts = GEOMETRY.num_logical_experts
    first = [(slot + step + layer) % experts for slot in range(experts)]
    return first + first[: GEOMETRY.num_physical_slots - experts]


def _rebalance(record: LayoutRecord, engine: str, step: int) -> None:
    """One rebalance of an engine: two chunks of four layers, two versions."""
    for layers in ((0, 1, 2, 3), (4, 5, 6, 7)):
        record.begin(engine, record.version, list(layers))
        record.commit(engine, {layer: _row(step, layer) for layer in layers})


def _start(path: Path, rank: int) -> tuple[Ledger, LayoutRecord]:
    ledger = Ledger.open(path)
    origin = IncarnationOrigin.of_this_process(
        tp_rank=rank, ep_rank=rank, socket_path=str(path.with_suffix(".sock"))
    )
    initial = trivial_map(
        GEOMETRY.num_layers, GEOMETRY.num_physical_slots, GEOMETRY.num_logical_experts
    )
    label = f"model-less pid={origin.pid} socket={origin.socket_path}"
    record = ledger.start_incarnation(GEOMETRY, initial, daemon_label=label, origin=origin)
    return ledger, record


def _at_version_20(path: Path, rank: int) -> tuple[Ledger, LayoutRecord]:
    """The demo's case 1: an engine rebalanced ten times (version 20) and is still attached."""
    ledger, record = _start(path, rank)
    record.attach("engine-a")
    for step in range(10):
        _rebalance(record, "engine-a", step)
    return ledger, record


def _dirty(path: Path, rank: int) -> None:
    _ledger, record = _start(path, rank)
    record.attach("engine-a")
    for step in range(2):
        _rebalance(record, "engine-a", step)
    record.begin("engine-a", record.version, [0, 1, 2, 3])
    record.detach("engine-a")  # the engine died mid-move: dirty


def _disagree(path: Path, rank: int) -> None:
    if rank == 0:
        _at_version_20(path, rank)
    else:
        _disagree_rank1(path, rank)


def _pending(path: Path, rank: int) -> None:
    _ledger, record = _at_version_20(path, rank)
    record.detach("engine-a", "the engine stopped")
    record.attach("engine-stuck")
    record.begin("engine-stuck", record.version, [0, 1, 2, 3])


def _paused(path: Path, rank: int) -> None:
    _ledger, record = _at_version_20(path, rank)
    record.detach("engine-a", "the engine stopped")
    record.attach("engine-stuck")
    record.attach("engine-standby")
    for _ in range(2):
        # answered busy, as every begin while another engine is attached
        with suppress(errors.MoveBusy):
            record.begin("engine-stuck", record.version, [0, 1, 2, 3])


def _died(path: Path, rank: int) -> None:
    _at_version_20(path, rank)


def _restarted(path: Path, rank: int) -> None:
    if rank == 0:
        _at_version_20(path, rank)
        return
    _died_first(path, rank)
    _start(path, rank)  # records the first incarnation's end as found unended


def _died_first(path: Path, rank: int) -> None:
    """Rank ``rank``'s first daemon, at version 20, killed (in a process of its own)."""
    child = multiprocessing.get_context("fork").Process(target=_build_and_die, args=(path, rank))
    child.start()
    child.join(60)
    if child.exitcode != 0:
        raise RuntimeError(f"building {path} failed (exit {child.exitcode})")


def _disagree_rank1(path: Path, rank: int) -> None:
    _died_first(path, rank)
    _start(path, rank)


def _build_and_die(path: Path, rank: int) -> None:
    import os

    try:
        _at_version_20(path, rank)
    except BaseException:
        os._exit(1)
    os._exit(0)  # a killed daemon: no end event, the kernel drops the writer lock


def _backup(path: Path, rank: int) -> None:
    if rank == 0:
        _at_version_20(path, rank)


def _healthy(path: Path, rank: int) -> None:
    _at_version_20(path, rank)


BUILDERS: dict[str, Callable[[Path, int], None]] = {
    "dirty": _dirty,
    "disagree": _disagree,
    "pending": _pending,
    "paused": _paused,
    "died": _died,
    "restarted": _restarted,
    "backup": _backup,
    "healthy": _healthy,
}
# Which ranks' daemons run once an incident is built ("died": rank 1 was killed).
RUNNING: dict[str, tuple[int, ...]] = {
    "dirty": (0, 1),
    "disagree": (0, 1),
    "pending": (0, 1),
    "paused": (0, 1),
    "died": (0,),
    "restarted": (0, 1),
    "backup": (0,),
    "healthy": (0, 1),
}


def _daemon(incident: str, path: Path, rank: int, ready: Connection, stop: Any) -> None:
    """One daemon: build its ledger's state, say so, then hold the ledger until told to stop
    (or, for a killed daemon, exit at once without ending anything)."""
    import os

    try:
        BUILDERS[incident](path, rank)
    except BaseException as exc:
        ready.send(f"failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    ready.send("ok")
    if rank not in RUNNING[incident]:
        os._exit(0)
    stop.wait()
    os._exit(0)  # its incarnation stays running to the end, as a live daemon's does


# The healthy incident's ledgers, named as the default location names them (under /var/lib).
HEALTHY_STATE_HOME = "healthy"
HEALTHY_LEDGERS = Path(HEALTHY_STATE_HOME, "sglang", "expert_layouts")


@dataclass
class Runbook:
    root: Path
    processes: list[Any] = field(default_factory=list)

    def ledger(self, incident: str, rank: int) -> Path:
        if incident == "healthy":
            return self.root / HEALTHY_LEDGERS / f"expert_layout_GPU-{rank}.sqlite"
        return self.root / incident / f"daemon{rank}.sqlite"


@contextmanager
def runbook_ledgers(root: Path) -> Iterator[Runbook]:
    """Build every incident under ``root`` (which must not hold them yet); the running
    daemons run until the block ends."""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    built = Runbook(root)
    try:
        for incident in INCIDENTS:
            (root / incident).mkdir(parents=True)
            if incident == "healthy":
                (root / HEALTHY_LEDGERS).mkdir(parents=True)
            for rank in (0, 1):
                if incident == "backup" and rank == 1:
                    continue
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=_daemon, args=(incident, built.ledger(incident, rank), rank, send, stop)
                )
                process.start()
                built.processes.append(process)
                if not receive.poll(60):
                    raise RuntimeError(f"{incident} rank {rank} did not build in 60 s")
                said = receive.recv()
                if said != "ok":
                    raise RuntimeError(f"{incident} rank {rank}: {said}")
        (root / "backups").mkdir()  # an operator's backup directory
        (root / "cp-backups").mkdir()  # the page's /backups/
        yield built
    finally:
        stop.set()
        for process in built.processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def console_blocks(text: str) -> list[list[tuple[str, list[str]]]]:
    """Each ```console block of a page: its (command, shown output lines)."""
    blocks = []
    for body in re.findall(r"^```console\n(.*?)^```$", text, re.S | re.M):
        entries: list[tuple[str, list[str]]] = []
        for line in body.rstrip("\n").split("\n"):
            if line.startswith("$ "):
                entries.append((line[2:], []))
            else:
                entries[-1][1].append(line)
        blocks.append(entries)
    return blocks


def block_incident(block: list[tuple[str, list[str]]]) -> str:
    """The incident a block's commands read (its directory under DEFAULT_DIR)."""
    for command, _ in block:
        match = re.search(rf"{re.escape(str(DEFAULT_DIR))}/([a-z]+)/", command)
        if match:
            return match.group(1)
    return "backup"


def run_command(command: str, root: Path, incident: str) -> tuple[int, list[str]]:
    """``command`` as the page gives it, run by a shell in ``incident``'s directory under
    ``root`` (the page's DEFAULT_DIR and /backups/ mapped there, and back in what it prints)."""
    here = command.replace(str(DEFAULT_DIR), str(root)).replace(
        " /backups/", f" {root}/cp-backups/"
    )
    # stdout and stderr in the order a terminal shows them: one pipe, nothing buffered.
    environment = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        here,
        shell=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=root / incident,
        env=environment,
        timeout=120,
        check=False,
    )
    printed = done.stdout
    printed = printed.replace(f"{root}/cp-backups/", "/backups/").replace(
        str(root), str(DEFAULT_DIR)
    )
    return done.returncode, printed.rstrip("\n").split("\n") if printed else []


def rewrite_docs(page: Path) -> None:
    """Run every console block's commands against freshly built ledgers and write what they
    print into ``page``."""
    text = page.read_text()
    with tempfile.TemporaryDirectory(prefix="layout-ledger-runbook-") as scratch:
        root = Path(scratch)
        with runbook_ledgers(root):
            rendered = []
            for block in console_blocks(text):
                lines, code = [], 0
                for command, shown in block:
                    if command == "echo $?":
                        got = [str(code)]
                    else:
                        code, got = run_command(command, root, block_incident(block))
                    if "..." in shown:
                        cut = shown.index("...")
                        after = len(shown) - cut - 1
                        got = [*got[:cut], "...", *(got[len(got) - after :] if after else [])]
                    lines.extend([f"$ {command}", *got])
                rendered.append("\n".join(lines) + "\n")
    parts = iter(rendered)
    page.write_text(
        re.sub(
            r"^(```console\n)(.*?)^(```)$",
            lambda m: m[1] + next(parts) + m[3],
            text,
            flags=re.S | re.M,
        )
    )


def main(argv: list[str]) -> int:
    if argv[1:] == ["--rewrite-docs"]:
        rewrite_docs(Path(__file__).resolve().parents[1] / "docs" / "operations.md")
        return 0
    root = Path(argv[1]) if len(argv) > 1 else DEFAULT_DIR
    if root.exists() and any(root.iterdir()):
        root = Path(tempfile.mkdtemp(prefix="layout-ledger-runbook-"))
    # Ctrl-C, or a TERM (a background job's SIGINT may be ignored), stops the daemons.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with runbook_ledgers(root) as built:
        print(f"the runbook's ledgers are under {built.root}; Ctrl-C stops their daemons")
        with suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
