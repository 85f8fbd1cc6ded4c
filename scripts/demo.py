"""The CPU end-to-end demo (README quick start: ``scripts/demo.sh``).

Reproduces the proposal's three GPU cases with real processes on a CPU and prints them in a
table: per EP rank a model-less weight cache daemon (sglang's real ``WeightCacheDaemon`` serve
loop and request handler, with this plugin's hooks and a SQLite ledger) and shared-memory expert
tensors that every engine maps; engines of 2 ranks on torch.distributed gloo running sglang's
real ``ModelRunner.maybe_init_expert_location_metadata``, ``EPLBManager``, ``init_by_eplb`` and
``ExpertLocationUpdater`` through the plugin's real hooks. Then ``layout-ledger`` and the
runbook's ``sqlite3`` query on the dirty daemon's ledger.

    .venv/bin/python scripts/demo.py [--rebalances N] [--keep]

Exit 0 when every expected outcome holds, 1 when one does not, 2 when a process failed or hung,
130 on Ctrl-C (SIGTERM likewise). Everything lives in temp dirs that are removed on exit
(``--keep`` keeps them for reading the logs and ledgers); every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIN_CASE1_REBALANCES = 10
WIDTH = 100


class Terminated(Exception):
    """SIGTERM: stop like Ctrl-C, cleaning up first."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/demo.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--rebalances",
        type=int,
        default=MIN_CASE1_REBALANCES,
        help=f"engine A's rebalances in case 1 (default and minimum {MIN_CASE1_REBALANCES})",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the temp dirs (logs, ledgers) and name them"
    )
    args = parser.parse_args(argv)
    if args.rebalances < MIN_CASE1_REBALANCES:
        parser.error(f"--rebalances must be at least {MIN_CASE1_REBALANCES}")
    return args


# ---------------------------------------------------------------- rendering -----------------


# Column widths of a case's table; longer cells wrap onto more lines of the same row.
CELL_WIDTHS = (52, 24, 24)


def render_case(case: Any) -> str:
    head = f"{case.title}"
    lines = [f"{head}{f'{case.seconds:.1f} s':>{max(1, WIDTH - len(head))}}"]
    rows = [("check", "expected", "measured", "result")]
    for check in case.checks:
        result = "-" if check.ok is None else ("ok" if check.ok else "FAILED")
        rows.append((check.what, check.expected, check.measured, result))
    wrapped = [
        [
            textwrap.wrap(cell, width) or [""]
            for cell, width in zip(row[:3], CELL_WIDTHS, strict=True)
        ]
        for row in rows
    ]
    widths = [max(len(line) for cells in wrapped for line in cells[column]) for column in range(3)]
    for index, (row, cells) in enumerate(zip(rows, wrapped, strict=True)):
        height = max(len(cell) for cell in cells)
        for line_index in range(height):
            texts = [
                (cell[line_index] if line_index < len(cell) else "").ljust(widths[column])
                for column, cell in enumerate(cells)
            ]
            result = row[3] if line_index == 0 else ""
            lines.append(("  " + "  ".join(texts) + "  " + result).rstrip())
        if index == 0:
            lines.append("  " + "-" * (sum(widths) + 6 + len("result")))
    for note in case.notes:
        lines.extend(textwrap.wrap(note, WIDTH, initial_indent="  * ", subsequent_indent="    "))
    return "\n".join(lines)


def render_forensics(case: Any) -> str:
    lines = []
    for command in case.facts.get("commands", []):
        lines.append(f"$ {command.command}")
        lines.extend(f"  {line}" for line in command.output.splitlines())
        lines.append(f"  (exit {command.exit_code})")
        lines.append("")
    query = case.facts.get("query")
    if query is not None:
        sql, columns, rows = query
        lines.append(
            "$ sqlite3 'file:<same ledger>?mode=ro'   # docs/operations.md, Forensic cookbook"
        )
        lines.extend(f"  {line}" for line in sql.splitlines())
        table = [columns, *[[str(value) for value in row] for row in rows]]
        widths = [max(len(str(row[i])) for row in table) for i in range(len(columns))]
        for row in table:
            cells = [str(v).ljust(w) for v, w in zip(row, widths, strict=True)]
            lines.append(("  " + " | ".join(cells)).rstrip())
        lines.append(f"  ({len(rows)} row{'s' if len(rows) != 1 else ''})")
        lines.append("")
    return "\n".join(lines)


def render_case1_side_by_side(run: Any) -> str:
    """Case 1 with and without the plugin, in the shape of the proposal's table."""
    with_plugin = next((c for c in run.cases if c.title.startswith("Case 1: ")), None)
    without = next((c for c in run.cases if c.title.startswith("Case 1, plugin disabled")), None)
    if with_plugin is None or without is None or "b_correct" not in without.facts:
        return ""
    on, off = with_plugin.facts, without.facts
    total = run.config.all_slots
    rows = [
        ("", "plugin on", "plugin disabled"),
        (
            "engine A: rebalances (per rank)",
            _ranks(on["a_rebalances"]),
            _ranks(off["a_rebalances"]),
        ),
        ("daemon version after A (per rank)", _ranks(on["daemon_versions"]), "no record"),
        ("engine B routes with", f"version {_ranks(on['b_versions'])}", "the initial layout"),
        (
            "B: slots holding the expert B's map names",
            f"{on['b_correct']}/{total}",
            f"{off['b_correct']}/{total}",
        ),
        (
            "B: slots read wrongly",
            f"{total - on['b_correct']}/{total}",
            f"{off['wrong']}/{total}",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["Case 1 side by side (the proposal's GPU table, on the CPU)"]
    for index, row in enumerate(rows):
        lines.append(
            ("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))).rstrip()
        )
        if index == 0:
            lines.append("  " + "-" * (sum(widths) + 4))
    return "\n".join(lines) + "\n"


def _ranks(values: list[Any]) -> str:
    return ", ".join(str(value) for value in values)


def render_summary(run: Any, wall: float) -> str:
    lines = ["Summary", "  " + "-" * (WIDTH - 2)]
    total = passed = 0
    for case in run.cases:
        checked = [check for check in case.checks if check.ok is not None]
        ok = sum(1 for check in checked if check.ok)
        total += len(checked)
        passed += ok
        state = "ok" if ok == len(checked) else "FAILED"
        lines.append(
            f"  {case.title:<70} {ok:>2}/{len(checked):<2} {state:<7}{case.seconds:6.1f} s"
        )
    lines.append(
        f"  {'startup (forkserver imports sglang once)':<70} {'':13}{run.forkserver_seconds:6.1f} s"
    )
    lines.append("")
    verdict = "every expected outcome holds" if passed == total else "SOME EXPECTED OUTCOMES FAILED"
    lines.append(f"{passed}/{total} checks passed: {verdict}. Wall time {wall:.1f} s.")
    return "\n".join(lines)


def intro(config: Any, workspace: Any) -> str:
    text = [
        "Expert layout ledger: the proposal's three GPU cases, end to end on the CPU",
        "=" * WIDTH,
        f"model shape: {config.describe()}",
    ]
    paragraphs = [
        "Real processes: per EP rank a model-less weight cache daemon (sglang 0.5.23's "
        "WeightCacheDaemon serve loop and request handler with this plugin's hooks, one SQLite "
        "ledger each); engines of 2 rank processes on torch.distributed gloo running sglang's "
        "real ModelRunner.maybe_init_expert_location_metadata (with the plugin's startup hook "
        "around it, registered by the plugin entry point), EPLBManager.rebalance (with the "
        "plugin's two-phase hook), ExpertLocationMetadata.init_by_eplb and "
        "ExpertLocationUpdater (batch_isend_irecv over gloo).",
        "Stand-ins for what needs a GPU: the daemon's CUDA-IPC expert tensors are shared-memory "
        "files every engine maps read-write (an in-place move by one engine is seen by all, and "
        "each expert's bytes carry its logical id); the IPC loader's fetch_state, which maps "
        "CUDA IPC handles, is replaced by mapping those files and recording that the weights "
        "came from the daemon; the expert loads are skewed synthetic counts "
        "(SyntheticLoadRecorder); the ModelRunner is a namespace with the attributes the "
        "startup method reads.",
        "Per-rank values read 'both: X' when each of the 2 EP ranks (or daemons) measured X, "
        "else rank 0's and rank 1's values.",
        f"Work dir {workspace.root} and shared memory {workspace.shm_root}: removed on exit"
        + (" unless --keep." if not workspace.keep else " (kept: --keep)."),
    ]
    for paragraph in paragraphs:
        text.extend(textwrap.wrap(paragraph, WIDTH))
    return "\n".join(text)


# ---------------------------------------------------------------- main ----------------------


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)
    print("starting (imports take a few seconds)...", flush=True)
    from sglang_integration.testing.sglang_env import set_quiet_sglang_env

    set_quiet_sglang_env()  # before anything imports sglang, here or in a process started here
    import demo_cases

    config = demo_cases.DemoConfig(case1_rebalances=args.rebalances)
    workspace = demo_cases.Workspace(config, keep=args.keep)
    try:
        print(intro(config, workspace) + "\n", flush=True)

        def show(case: Any) -> None:
            print(render_case(case) + "\n", flush=True)
            if case.facts.get("commands"):
                print(render_forensics(case), flush=True)

        print("starting the forkserver (it imports sglang once for every process)...", flush=True)
        seconds = workspace.start_processes()
        print(f"forkserver ready in {seconds:.1f} s\n", flush=True)
        run = demo_cases.run_demo(workspace, ROOT / "docs" / "operations.md", on_case=show)
    except (KeyboardInterrupt, Terminated):
        print("\ninterrupted: stopping every process and removing the temp dirs", flush=True)
        _close(workspace)
        return 130
    except Exception:
        print("\nthe demo could not finish, a process failed or hung:", flush=True)
        traceback.print_exc()
        if not args.keep:
            print("(run with --keep to keep the logs and ledgers)", flush=True)
        _close(workspace)
        return 2
    _close(workspace)
    wall = time.monotonic() - started
    print(render_case1_side_by_side(run), flush=True)
    print(render_summary(run, wall), flush=True)
    return 1 if run.failed else 0


def _close(workspace: Any) -> None:
    """Stop every process and remove the temp dirs; a second Ctrl-C cannot cut this short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    workspace.close()


if __name__ == "__main__":
    sys.exit(main())
