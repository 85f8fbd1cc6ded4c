"""The CPU end-to-end demo (README quick start: ``scripts/demo.sh``).

Reproduces the proposal's three GPU cases (and cases 4 to 7) with real processes on a CPU, on a
tiny Qwen3-MoE and a tiny DeepSeek-V3 in turn (BF16 checkpoints loaded in float32), and prints
them in tables: per EP rank a model-backed weight cache daemon (sglang's own
``WeightCacheDaemon`` building the model class and loading a checkpoint written for the run with
sglang's loader, with this plugin's hooks and a SQLite ledger), whose routed-expert parameters
every engine maps from shared memory; engines of 2 ranks on torch.distributed gloo holding
sglang's model and running sglang's real ``ModelRunner.maybe_init_expert_location_metadata``,
``IpcModelLoader``, ``ModelRunner.forward`` (greedy decoding), ``EPLBManager`` (fed by sglang's
expert distribution recorder from those forward passes), ``init_by_eplb`` and
``ExpertLocationUpdater`` through the plugin's real hooks. Then ``layout-ledger`` and the
runbook's ``sqlite3`` query on the dirty daemon's ledger, and the proposal's table measured by
what the engines answer: greedy tokens against a reference loaded from disk.

    .venv/bin/python scripts/demo.py [--model qwen3_moe|deepseek_v3|both] [--rebalances N] [--keep]

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
        "--model",
        choices=("both", "qwen3_moe", "deepseek_v3"),
        default="both",
        help="the model(s) the daemons load (default: both, one after the other)",
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


def render_case1_side_by_side(runs: list[Any]) -> str:
    """Case 1 with and without the plugin, in the shape of the proposal's table, a row per
    model: engine B's slots that hold the expert B's map names."""
    rows = [("model", "A's rebalances", "B routes with", "plugin on", "plugin disabled")]
    for run in runs:
        with_plugin = next((c for c in run.cases if c.title.startswith("Case 1: ")), None)
        without = next(
            (c for c in run.cases if c.title.startswith("Case 1, plugin disabled")), None
        )
        if with_plugin is None or without is None or "b_correct" not in without.facts:
            continue
        on, off = with_plugin.facts, without.facts
        total = run.config.all_slots
        rows.append(
            (
                run.config.name,
                _ranks(on["a_rebalances"]),
                f"version {_ranks(on['b_versions'])} / the initial layout",
                f"{on['b_correct']}/{total}",
                f"{off['b_correct']}/{total}",
            )
        )
    if len(rows) == 1:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "Case 1 side by side (the proposal's GPU table, on the CPU): engine B, started after A "
        "rebalanced, slots holding the expert B's map names, plugin on / disabled"
    ]
    for index, row in enumerate(rows):
        lines.append(
            ("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))).rstrip()
        )
        if index == 0:
            lines.append("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))
    return "\n".join(lines) + "\n"


def render_answers(runs: list[Any]) -> str:
    """The proposal's table measured by outputs, one per model: a row per engine, the version
    it routed with, and of the 8 prompts those whose greedy tokens equal R's."""
    blocks = []
    for run in runs:
        answers = run.answers
        if answers.reference is None:
            continue
        prompts = len(answers.reference)
        new_tokens = len(answers.reference[0])
        rows = [("engine", "routes with", "= R's tokens", "result")]
        rows.append(
            ("R: from disk, never rebalanced (the reference)", "the initial layout", "-", "")
        )
        for row in answers.rows:
            rows.append(
                (row.label, row.routes_with(), row.measured(), "ok" if row.ok else "FAILED")
            )
        label_width = min(60, max(len(row[0]) for row in rows))
        wrapped = [(textwrap.wrap(row[0], label_width) or [""], *row[1:]) for row in rows]
        widths = [label_width] + [max(len(row[i]) for row in rows) for i in (1, 2)]
        lines = [
            f"The proposal's table, measured by outputs: {run.config.name}, {prompts} prompts x "
            f"{new_tokens} new tokens, greedy; prompts whose tokens equal R's"
        ]
        for index, (label, routes, equal, result) in enumerate(wrapped):
            first = f"  {label[0]:<{widths[0]}}  {routes:<{widths[1]}}  {equal:<{widths[2]}}  "
            lines.append((first + result).rstrip())
            lines.extend(f"  {more}" for more in label[1:])
            if index == 0:
                lines.append("  " + "-" * (sum(widths) + 6 + len("result")))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + ("\n" if blocks else "")


def _ranks(values: list[Any]) -> str:
    return ", ".join(str(value) for value in values)


def render_summary(runs: list[Any], wall: float) -> str:
    lines = ["Summary", "  " + "-" * (WIDTH - 2)]
    total = passed = 0
    for run in runs:
        if len(runs) > 1:
            lines.append(f"  {run.config.name}")
        for case in run.cases:
            checked = [check for check in case.checks if check.ok is not None]
            ok = sum(1 for check in checked if check.ok)
            total += len(checked)
            passed += ok
            state = "ok" if ok == len(checked) else "FAILED"
            lines.append(
                f"  {case.title:<70} {ok:>2}/{len(checked):<2} {state:<7}{case.seconds:6.1f} s"
            )
    forkserver = runs[0].forkserver_seconds if runs else 0.0
    lines.append(f"  {'startup (forkserver imports sglang once)':<70} {'':13}{forkserver:6.1f} s")
    lines.append("")
    verdict = "every expected outcome holds" if passed == total else "SOME EXPECTED OUTCOMES FAILED"
    lines.append(f"{passed}/{total} checks passed: {verdict}. Wall time {wall:.1f} s.")
    return "\n".join(lines)


def intro(configs: list[Any], keep: bool) -> str:
    text = [
        "Expert layout ledger: the proposal's three GPU cases, end to end on the CPU",
        "=" * WIDTH,
        *(f"model: {config.describe()}" for config in configs),
    ]
    paragraphs = [
        "Real processes: per EP rank a model-backed weight cache daemon (sglang 0.5.23's own "
        "WeightCacheDaemon: its process groups on gloo, the model class built from the "
        "checkpoint's config.json and loaded by sglang's loader from safetensors shards written "
        "for this run, its serve loop and request handler, with this plugin's hooks and one "
        "SQLite ledger each); engines of 2 rank processes on torch.distributed gloo, each "
        "holding sglang's model: sglang's real ModelRunner.maybe_init_expert_location_metadata "
        "(with the plugin's startup hook around it, registered by the plugin entry point), its "
        "IpcModelLoader (fetch_state with the plugin's layout field), greedy decoding through "
        "ModelRunner.forward (torch-native attention over sglang's KV pools), sglang's expert "
        "distribution recorder counting those passes' top-k choices, EPLBManager.rebalance "
        "(with the plugin's two-phase hook) from on_forward_pass_end, "
        "ExpertLocationMetadata.init_by_eplb and ExpertLocationUpdater (batch_isend_irecv over "
        "gloo) moving the real routed-expert tensors. 'Slot s holds expert e' means its bytes "
        "equal the checkpoint's expert e as sglang's loader places it; an engine is right when "
        "its greedy tokens equal R's, an engine that loaded everything from disk and never "
        "rebalanced.",
        "Stand-ins for what needs a GPU (docs/model-daemons.md): in the daemons, sglang's CPU "
        "platform, no pynccl, rope in torch, and shared-memory files in place of the CUDA IPC "
        "export (every engine maps them read-write: an in-place move by one is seen by all); in "
        "the engines, the same platform stand-ins, mapping those files in place of the IPC "
        "loader's zero-copy mapping, the torch-native MoE runner dropping the experts of other "
        "ranks as the GPU runners do, DeepSeek-V3's MLA path on the torch-native attention "
        "backend, and a namespace with the attributes the startup method reads in place of the "
        "ModelRunner. Before each rebalance an engine runs one forward pass over skewed prompts "
        "(a few repeated tokens, different each time), so that its real routing asks for a new "
        "layout. Case 4 (c) runs on the synthetic stand-in (model-less daemon, expert bytes "
        "that carry their id): with the plugin no real load leaves a replica unfilled.",
        "Per-rank values read 'both: X' when each of the 2 EP ranks (or daemons) measured X, "
        "else rank 0's and rank 1's values.",
        "Work dirs (named below as each model starts) are removed on exit"
        + (" unless --keep." if not keep else " (kept: --keep)."),
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

    models = list(demo_cases.MODELS) if args.model == "both" else [args.model]
    configs = [
        demo_cases.DemoConfig(model=model, case1_rebalances=args.rebalances) for model in models
    ]
    print(intro(configs, args.keep) + "\n", flush=True)
    runs = []
    workspace = None
    try:
        for config in configs:
            workspace = demo_cases.Workspace(config, keep=args.keep)
            print(f"== {config.name}: work dir {workspace.root}", flush=True)
            runs.append(_run_model(workspace))
            _close(workspace)
            workspace = None
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
    wall = time.monotonic() - started
    print(render_case1_side_by_side(runs), flush=True)
    print(render_answers(runs), flush=True)
    print(render_summary(runs, wall), flush=True)
    return 1 if any(run.failed for run in runs) else 0


def _run_model(workspace: Any) -> Any:
    """Every case on one model's daemons; each case's table printed as soon as it is ready."""
    import demo_cases

    def show(case: Any) -> None:
        print(render_case(case) + "\n", flush=True)
        if case.facts.get("commands"):
            print(render_forensics(case), flush=True)

    if workspace.context is None and not _forkserver_started():
        print("starting the forkserver (it imports sglang once for every process)...", flush=True)
    seconds = workspace.start_processes()
    print(f"forkserver ready in {seconds:.1f} s\n", flush=True)
    return demo_cases.run_demo(workspace, ROOT / "docs" / "operations.md", on_case=show)


def _forkserver_started() -> bool:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None) is not None


def _close(workspace: Any) -> None:
    """Stop every process and remove the temp dirs; a second Ctrl-C cannot cut this short."""
    if workspace is None:
        return
    handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        workspace.close()
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


if __name__ == "__main__":
    sys.exit(main())
