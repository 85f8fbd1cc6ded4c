#!/usr/bin/env python3
"""Crash campaign: SIGKILL the daemon at random moments of begin/commit streams, many times.

A model-less daemon (sglang's real serve loop with this plugin's hooks and a real ledger) serves
an engine that begins and commits moves as fast as it can, at DeepSeek-V3 scale by default
(the map a DeepSeek-V3 daemon keeps, scripts/deepseek_geometry.py: 61 layers x 288 physical
slots, 256 experts); the daemon keeps little history
(``--keep-versions 40 --prune-every 10``), so its own retention prunes all the time. Another
process opens read snapshots of the ledger and holds each for a while (an operator's
``sqlite3``). At a random moment the daemon is SIGKILLed; between some kills ``layout-ledger
prune`` runs on the stopped ledger. Then the daemon restarts on the same ledger, and:

- every commit the daemon acknowledged must be in the ledger, with its digest (lost: 0);
- the killed incarnation's state, derived from its rows by the replay every reader uses, must
  be what the engine saw: its version the last acknowledged one (or one more, when a commit was
  in flight and landed), the move it had begun still pending (or, with a begin in flight, that
  move or none), ended ``unknown``; and the restarted incarnation must restore the killed one's
  newest committed version, at its number and digest (the engine starts from the layout its
  attach reply names) (restarts with a wrong state: 0);
- ``verify``'s checks of that incarnation, and every 50 kills and at the end all of ``verify``,
  must pass (verify failures: 0);
- the daemon never failed to restart (daemon start failures: 0).

    .venv/bin/python scripts/crash_campaign.py [--kills 1000] [--small] [--seed N] [--dir DIR]

``--small`` uses a small geometry (the suite runs a few kills that way). Prints one table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from deepseek_geometry import DEEPSEEK_V3
from layout_ledger.cli.commands.prune import prune_ledger
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, layout_digest
from layout_ledger.core.state import RestoredFrom
from layout_ledger.history.checks import collect_verify, verify_incarnation
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.replay import replayed
from layout_ledger.store.rows import current_version, incarnation
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import DaemonProcess, start_daemon

SMALL = Geometry(num_layers=8, num_physical_slots=12, num_logical_experts=8)
RETENTION = ["--keep-versions", "40", "--prune-every", "10"]
FULL_VERIFY_EVERY = 50
CLI_PRUNE_EVERY = 25

# The operator's reader: holds a read snapshot for a while, lets go, again, until killed.
_SNAPSHOTS = """
import random, sqlite3, sys, time
rng = random.Random(int(sys.argv[2]))
while True:
    try:
        conn = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, isolation_level=None)
        conn.execute("BEGIN")
        conn.execute("SELECT count(*) FROM events").fetchone()
        time.sleep(rng.uniform(0.2, 2.0))
        conn.close()
    except sqlite3.Error:
        pass
    time.sleep(rng.uniform(0.1, 1.0))
"""


@dataclass
class Stream:
    """What the engine saw of one daemon incarnation."""

    version: int = 0  # from the attach reply's layout on: the incarnation may have restored one
    attached: bool = False
    digests: dict[int, str] = field(default_factory=dict)  # acknowledged commits
    pending: tuple[int, ...] | None = None  # the move whose begin was acknowledged
    in_flight: tuple[str, tuple[int, ...], str | None] | None = None  # (verb, layers, digest)
    requests: int = 0


@dataclass
class Tally:
    kills: int = 0
    acknowledged: int = 0
    lost: int = 0
    verify_failures: int = 0
    wrong_states: int = 0
    start_failures: int = 0
    cli_prunes: int = 0
    cli_prunes_refused: int = 0  # a move of the killed incarnation was pending
    requests: int = 0
    restart_seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def _engine(daemon: DaemonProcess, geometry: Geometry, stream: Stream, seed: int) -> None:
    """Begin and commit moves until the daemon goes away; record what was acknowledged."""
    rng = random.Random(seed)
    engine_id = f"engine-{seed}"
    attachment = client.attach(daemon.socket_path, engine_id)
    layout = attachment.reply.layout
    if not attachment.reply.ok or layout is None:
        return
    # The incarnation restored the killed one's last committed version (or started at 0).
    stream.version, current = layout.version, layout.physical_to_logical_map
    stream.attached = True
    try:
        while True:
            count = rng.choice([1, geometry.num_layers // 2, geometry.num_layers])
            layers = tuple(sorted(rng.sample(range(geometry.num_layers), count)))
            stream.in_flight = ("begin", layers, None)
            stream.requests += 1
            if not client.begin(daemon.socket_path, engine_id, stream.version, layers).ok:
                return
            stream.pending, stream.in_flight = layers, None
            rows = {layer: _row(rng, geometry) for layer in layers}
            after = [list(row) for row in current]
            for layer, row in rows.items():
                after[layer] = row
            stream.in_flight = ("commit", layers, layout_digest(after))
            stream.requests += 1
            reply = client.commit(daemon.socket_path, engine_id, rows)
            if not reply.ok:
                return
            stream.version = int(reply.body["version"])
            stream.digests[stream.version] = str(reply.body["digest"])
            stream.pending, stream.in_flight, current = None, None, after
    finally:
        attachment.close()


def _row(rng: random.Random, geometry: Geometry) -> list[int]:
    return [rng.randrange(geometry.num_logical_experts) for _ in range(geometry.num_physical_slots)]


def _check_incarnation(path: Path, incarnation_id: int, stream: Stream, tally: Tally) -> None:
    """The killed incarnation as the ledger holds it, against what the engine saw."""
    with LedgerReader(path) as ledger, ledger.connect() as conn:
        inc = incarnation(conn, incarnation_id)
        recorded = dict(
            conn.exec_driver_sql(
                "SELECT version, digest FROM versions WHERE incarnation_id = ?", (incarnation_id,)
            ).all()
        )
        record = replayed(conn, inc)
    lost = [v for v, digest in stream.digests.items() if recorded.get(v) != digest]
    tally.lost += len(lost)
    if lost:
        tally.problem(f"incarnation {incarnation_id}: acknowledged versions {lost} lost")
    expected = _expected_states(stream, recorded)
    if not stream.attached:  # killed before the engine attached: as it started
        expected = [(inc.first_version, None)]
    actual = (record.version, None if record.pending is None else record.pending.layers)
    if actual not in expected or inc.end_state != "unknown":
        tally.wrong_states += 1
        tally.problem(
            f"incarnation {incarnation_id}: derived (version, pending) {actual}, end "
            f"{inc.end_state}; expected one of {expected}, end unknown"
        )
    with LedgerReader(path) as ledger:
        failed = [r for r in verify_incarnation(ledger, incarnation_id) if not r.ok]
    if failed:
        tally.verify_failures += 1
        tally.problem(f"verify: {failed[0].label}: {failed[0].detail}")


def _check_restore(path: Path, incarnation_id: int, tally: Tally) -> None:
    """The restarted incarnation starts at the killed one's newest committed version, with its
    digest (at 0 when it committed none): a version number never names two maps."""
    with LedgerReader(path) as ledger, ledger.connect() as conn:
        inc = incarnation(conn, incarnation_id)
        newest, digest = current_version(conn, incarnation_id - 1)
    expected = None if newest == 0 else RestoredFrom(incarnation_id - 1, newest, digest)
    if inc.restored_from != expected:
        tally.wrong_states += 1
        tally.problem(
            f"incarnation {incarnation_id} restored {inc.restored_from}; expected {expected}"
        )


def _expected_states(
    stream: Stream, recorded: dict[int, str]
) -> list[tuple[int, tuple[int, ...] | None]]:
    """The (version, pending layers) the replay may derive, given what was in flight."""
    flight = stream.in_flight
    if flight is None:
        return [(stream.version, stream.pending)]
    verb, layers, digest = flight
    if verb == "begin":
        return [(stream.version, None), (stream.version, layers)]
    landed = recorded.get(stream.version + 1) == digest
    return [(stream.version + 1, None)] if landed else [(stream.version, stream.pending)]


def run_campaign(
    workdir: Path, kills: int, geometry: Geometry, seed: int, report_every: int = 0
) -> Tally:
    """SIGKILL the daemon ``kills`` times mid-stream, restarting it on the same ledger."""
    rng = random.Random(seed)
    path = workdir / "ledger.sqlite"
    tally = Tally()
    snapshots = subprocess.Popen([sys.executable, "-c", _SNAPSHOTS, str(path), str(seed)])
    killed: Stream | None = None
    try:
        for kill in range(1, kills + 2):
            daemon = _restart(workdir, path, geometry, tally)
            if daemon is None:
                break
            if killed is not None:  # the restart ended the killed incarnation: check it now
                _check_incarnation(path, kill - 1, killed, tally)
                _check_restore(path, kill, tally)
            if kill > kills:
                daemon.stop()
                break
            killed = _stream_then_kill(daemon, geometry, rng, tally)
            _between_kills(path, kill, kills, tally, report_every)
    finally:
        snapshots.kill()
        snapshots.wait()
    return tally


def _restart(workdir: Path, path: Path, geometry: Geometry, tally: Tally) -> DaemonProcess | None:
    started = time.monotonic()
    try:
        daemon = _start(workdir, path, geometry)
    except Exception as exc:
        tally.start_failures += 1
        tally.problem(f"the daemon did not start on the ledger: {exc}")
        return None
    tally.restart_seconds.append(time.monotonic() - started)
    return daemon


def _stream_then_kill(
    daemon: DaemonProcess, geometry: Geometry, rng: random.Random, tally: Tally
) -> Stream:
    stream = Stream()
    engine = threading.Thread(target=_engine, args=(daemon, geometry, stream, rng.randrange(2**31)))
    engine.start()
    time.sleep(rng.uniform(0.0, 0.6))
    daemon.kill()
    engine.join(60)
    tally.kills += 1
    tally.acknowledged += len(stream.digests)
    tally.requests += stream.requests
    return stream


def _between_kills(path: Path, kill: int, kills: int, tally: Tally, report_every: int) -> None:
    """Now and then: layout-ledger prune on the stopped ledger; all of verify."""
    if kill % CLI_PRUNE_EVERY == 0:
        try:
            prune_ledger(path, 10)
            tally.cli_prunes += 1
        except LedgerError as exc:  # the killed incarnation's move is still pending: refused
            if "has a move pending" not in str(exc):
                raise
            tally.cli_prunes_refused += 1
    if kill % FULL_VERIFY_EVERY == 0 or kill == kills:
        with LedgerReader(path) as ledger:
            report = collect_verify(ledger)
        if not report.ok:
            tally.verify_failures += 1
            tally.problem(f"full verify after kill {kill}: {report.first_inconsistency}")
    if report_every and kill % report_every == 0:
        print(f"  {kill} kills, {tally.acknowledged} commits acknowledged", flush=True)


def _start(workdir: Path, path: Path, geometry: Geometry) -> DaemonProcess:
    return start_daemon(
        workdir,
        num_layers=geometry.num_layers,
        num_logical_experts=geometry.num_logical_experts,
        num_physical_experts=geometry.num_physical_slots,
        ledger_path=path,
        extra=RETENTION,
    )


def render(tally: Tally, geometry: Geometry, seconds: float) -> str:
    rows = [
        ("kills (SIGKILL mid-stream)", f"{tally.kills}"),
        ("requests sent (begin, commit)", f"{tally.requests}"),
        ("acknowledged commits", f"{tally.acknowledged}"),
        ("acknowledged commits lost", f"{tally.lost}   (must be 0)"),
        ("restarts whose derived state was wrong", f"{tally.wrong_states}   (must be 0)"),
        ("verify failures", f"{tally.verify_failures}   (must be 0)"),
        ("daemon start failures", f"{tally.start_failures}   (must be 0)"),
        (
            "layout-ledger prune between kills",
            f"{tally.cli_prunes} ran, {tally.cli_prunes_refused} refused (a move was pending)",
        ),
    ]
    if tally.restart_seconds:
        rows.append(("restart, median", f"{statistics.median(tally.restart_seconds):.2f} s"))
    width = max(len(label) for label, _ in rows)
    lines = [
        f"Crash campaign: {geometry.num_layers} layers x {geometry.num_physical_slots} slots, "
        f"{geometry.num_logical_experts} experts; a reader holding snapshots; {seconds:.0f} s",
        *(f"  {label:<{width}}  {value}" for label, value in rows),
    ]
    lines += [f"  problem: {text}" for text in tally.problems]
    return "\n".join(lines)


def ok(tally: Tally) -> bool:
    return not (tally.lost or tally.wrong_states or tally.verify_failures or tally.start_failures)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--small", action="store_true", help="8 layers x 12 slots, 8 experts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, help="where to put the ledger (default: a temp dir)")
    args = parser.parse_args()
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()
    geometry = SMALL if args.small else DEEPSEEK_V3
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tally = run_campaign(Path(tmp), args.kills, geometry, args.seed, report_every=50)
    print(render(tally, geometry, time.monotonic() - started))
    return 0 if ok(tally) else 1


if __name__ == "__main__":
    sys.exit(main())
