#!/usr/bin/env python3
"""CLI benchmark: what a call of ``layout-ledger`` costs, beside a bare interpreter and a plain
sqlite3 read of the same rows, in one run.

Ledgers at the map a DeepSeek-V3 daemon keeps (scripts/deepseek_geometry.py: 61 layers x 288
physical slots, 256 logical experts, layers 3..60 with routed experts), each commit one chunk of
4 MoE layers, no retention (every version's rows held: the most a ledger holds). Each command
runs as its own process (the console script, as an operator or a health check runs it), its
wall time the median of --repeat runs:

  - ``python -c pass`` (the bare interpreter) beside ``--version`` and ``--help`` (target: within
    0.1 s of it);
  - a plain ``sqlite3`` read of the rows ``status`` reads, beside ``status`` (target: < 0.5 s at
    10,000 versions);
  - a plain ``sqlite3`` read of every row ``verify`` checks, beside ``verify``, at two sizes
    (half and all of --versions): verify must be linear in the rows (the ratio of the times
    near the ratio of the rows).

With ``--beside DIR`` (an older tree's ``layout_ledger`` package under DIR, e.g. from ``git
archive COMMIT layout_ledger | tar -x -C DIR``), ``status`` also runs with DIR first on
``PYTHONPATH``: the older code beside today's, in the same run, on the same ledger.

  .venv/bin/python scripts/bench_cli.py [--versions 10000] [--repeat 5] [--dir DIR] [--quick]
      [--beside DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepseek_geometry import DEEPSEEK_V3, DEEPSEEK_V3_MOE_LAYERS, DEEPSEEK_V3_TEXT
from layout_ledger.core.layout import trivial_map
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.origin import IncarnationOrigin

CHUNK = 4
ENGINE = "engine-bench"
PYTHON = sys.executable
CLI = str(Path(sys.executable).with_name("layout-ledger"))
STARTUP_MARGIN_S = 0.1
STATUS_TARGET_S = 0.5

# What status reads, as one plain sqlite3 script (the same rows, no replay, no rendering).
_STATUS_SQL = (
    "import sqlite3, sys\n"
    "c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True)\n"
    "i = c.execute('SELECT max(incarnation_id) FROM incarnations').fetchone()[0]\n"
    "c.execute('SELECT * FROM incarnations WHERE incarnation_id = ?', (i,)).fetchall()\n"
    "c.execute('SELECT max(version), count(*) FROM versions WHERE incarnation_id = ?', "
    "(i,)).fetchall()\n"
    "c.execute('SELECT kind, count(*) FROM events WHERE incarnation_id = ? GROUP BY kind', "
    "(i,)).fetchall()\n"
    "c.execute('SELECT * FROM events ORDER BY event_id DESC LIMIT 1').fetchall()\n"
)
# What verify reads: every version, every layout row, every event.
_VERIFY_SQL = (
    "import sqlite3, sys\n"
    "c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True)\n"
    "for table in ('versions', 'layout_rows', 'events'):\n"
    "    for row in c.execute(f'SELECT * FROM {table}'):\n"
    "        pass\n"
)


def _chunk(step: int) -> list[int]:
    moe = DEEPSEEK_V3_MOE_LAYERS
    start = (step * CHUNK) % len(moe)
    return sorted(moe[(start + k) % len(moe)] for k in range(CHUNK))


def build(path: Path, versions: int) -> None:
    """A ledger of ``versions`` commits, its daemon stopped cleanly (status exits 6, verify 0)."""
    ledger = Ledger.open(path)
    geometry = DEEPSEEK_V3
    initial = trivial_map(
        geometry.num_layers, geometry.num_physical_slots, geometry.num_logical_experts
    )
    record = ledger.start_incarnation(
        geometry, initial, origin=IncarnationOrigin.of_this_process(device_uuid="GPU-bench")
    )
    record.attach(ENGINE)
    rng = random.Random(0)
    slots = geometry.num_physical_slots
    for step in range(versions):
        layers = _chunk(step)
        record.begin(ENGINE, record.version, layers)
        record.commit(
            ENGINE,
            {
                layer: [rng.randrange(geometry.num_logical_experts) for _ in range(slots)]
                for layer in layers
            },
        )
    record.detach(ENGINE)
    ledger.checkpoint(truncate=True)
    ledger.end_incarnation()
    ledger.close()


def _build_in_child(path: Path, versions: int) -> None:
    child = multiprocessing.get_context("fork").Process(target=build, args=(path, versions))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building {path} failed (exit {child.exitcode})")


def _timed(argv: list[str], repeat: int, ok: tuple[int, ...] = (0,)) -> float:
    """The median wall time of ``repeat`` runs of ``argv`` (after one warm-up run)."""
    return _timed_cpu(argv, repeat, ok)[0]


def _timed_cpu(
    argv: list[str],
    repeat: int,
    ok: tuple[int, ...] = (0,),
    env: dict[str, str] | None = None,
) -> tuple[float, float]:
    """The median wall time and the median CPU time (user + system) of ``repeat`` runs of
    ``argv`` (after one warm-up run). On cores shared with other jobs the wall time moves with
    their load; the CPU time much less, so it is the figure to compare code by."""
    times, cpus = [], []
    for attempt in range(repeat + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(
            argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        elapsed = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode not in ok:
            raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr.decode()[-500:]}")
        if attempt:
            times.append(elapsed)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(times), statistics.median(cpus)


def _rows(path: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sum(
            conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("versions", "layout_rows", "events")
        )
    finally:
        conn.close()


def _line(name: str, seconds: float, beside: float, note: str = "") -> None:
    print(f"  {name:44s} {seconds * 1000:9.0f} ms  {seconds / beside:6.1f}x   {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="1,000 versions, 3 repeats")
    parser.add_argument(
        "--beside", type=Path, default=None, help="an older tree's layout_ledger, timed beside"
    )
    args = parser.parse_args()
    if args.quick:
        args.versions, args.repeat = 1_000, 3
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-cli-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(
        f"CLI benchmark: {DEEPSEEK_V3_TEXT}; {CHUNK} MoE layers a commit, every version held; "
        f"median of {args.repeat} runs; {os.cpu_count()} CPUs"
    )
    half_versions = args.versions // 2
    paths = {}
    for versions in (half_versions, args.versions):
        path = scratch / f"ledger-{versions}.sqlite"
        if not path.exists():
            started = time.perf_counter()
            _build_in_child(path, versions)
            print(f"  (built {path.name} in {time.perf_counter() - started:.1f} s)")
        paths[versions] = path
    full = paths[args.versions]
    failures = []

    print("\nstart-up (beside a bare interpreter)")
    bare = _timed([PYTHON, "-c", "pass"], args.repeat)
    _line("python -c pass", bare, bare)
    for argv in (["--version"], ["--help"], ["status", "--help"]):
        took = _timed([CLI, *argv], args.repeat)
        within = took - bare <= STARTUP_MARGIN_S
        _line(
            "layout-ledger " + " ".join(argv),
            took,
            bare,
            f"+{(took - bare) * 1000:.0f} ms (target +{STARTUP_MARGIN_S * 1000:.0f} ms) "
            + ("ok" if within else "MISSED"),
        )
        if not within:
            failures.append(" ".join(argv))

    print(f"\nstatus of {args.versions:,} versions (beside a plain sqlite3 read of its rows)")
    plain = _timed([PYTHON, "-c", _STATUS_SQL, str(full)], args.repeat)
    _line("python + sqlite3: the rows status reads", plain, bare)
    took, cpu = _timed_cpu([CLI, "status", str(full)], args.repeat, ok=(0, 6))
    met = took < STATUS_TARGET_S
    _line(
        "layout-ledger status",
        took,
        bare,
        f"{took / plain:.1f}x the plain read, cpu {cpu * 1000:.0f} ms "
        f"(target < {STATUS_TARGET_S * 1000:.0f} ms) " + ("ok" if met else "MISSED"),
    )
    if not met:
        failures.append("status")
    if args.beside is not None:
        older = {**os.environ, "PYTHONPATH": str(args.beside.resolve())}
        before, before_cpu = _timed_cpu([CLI, "status", str(full)], args.repeat, (0, 6), older)
        _line(
            f"layout-ledger status, the tree in {args.beside.name}/",
            before,
            bare,
            f"{before / plain:.1f}x the plain read, cpu {before_cpu * 1000:.0f} ms; today's: "
            f"{took / before:.2f}x its time, {cpu / before_cpu:.2f}x its cpu",
        )

    print("\nverify (beside a plain sqlite3 read of every row it checks)")
    per_row = {}
    for versions, path in paths.items():
        rows = _rows(path)
        plain = _timed([PYTHON, "-c", _VERIFY_SQL, str(path)], args.repeat)
        took = _timed([CLI, "verify", str(path)], args.repeat)
        per_row[versions] = ((took - bare) / rows, rows, took)
        _line(f"python + sqlite3: {rows:,} rows ({versions:,} versions)", plain, bare)
        _line(
            f"layout-ledger verify ({versions:,} versions)",
            took,
            bare,
            f"{took / plain:.1f}x the plain read, {(took - bare) / rows * 1e6:.1f} us a row",
        )
    (_, small_rows, small_took), (_, large_rows, large_took) = (
        per_row[half_versions],
        per_row[args.versions],
    )
    growth = (large_took - bare) / (small_took - bare)
    linear = growth <= 1.25 * large_rows / small_rows
    print(
        f"  {large_rows / small_rows:.2f}x the rows took {growth:.2f}x the time (past start-up): "
        + ("linear" if linear else "MORE THAN LINEAR")
    )
    if not linear:
        failures.append("verify")
    print("\n" + ("every target met" if not failures else "missed: " + ", ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
