"""Record engine A's commits of the CPU demo's case 1 for the one-GPU check to replay.

    .venv/bin/python scripts/gpu_single/record_demo_moves.py [--out PATH]

Runs the demo's case 1 (sglang's real ``EPLBManager`` / ``init_by_eplb`` on the demo's
synthetic loads, through the plugin and model-less daemons, on the CPU) and writes every commit
rank 0's daemon recorded (version, layers, the rows it stored) to
``scripts/gpu_single/demo_case1_moves.json``. The one-GPU check's engine A replays exactly these
commits on CUDA memory, so its counts are the demo's (``moves.demo_case1_moves``). Needs the
repository's CPU ``.venv`` (sglang); rerun it when the demo's shape, loads or sglang change.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/: harness, demo_cases, gpu_single

from demo_cases.case1 import run_case1  # noqa: E402
from demo_cases.config import DemoConfig  # noqa: E402
from demo_cases.workspace import started_workspace  # noqa: E402
from gpu_single.moves import DEMO_MOVES_PATH  # noqa: E402


def read_commits(ledger_path: str) -> list[dict[str, Any]]:
    """Every commit of the ledger's last incarnation: version, layers and stored rows."""
    with sqlite3.connect(f"file:{ledger_path}?mode=ro", uri=True) as db:
        incarnation = db.execute("SELECT max(incarnation_id) FROM ledger_incarnations").fetchone()[
            0
        ]
        events = db.execute(
            "SELECT new_version, layers FROM ledger_events WHERE incarnation_id = ? "
            "AND kind = 'commit' ORDER BY event_id",
            (incarnation,),
        ).fetchall()
        commits = []
        for version, layers_json in events:
            layers = json.loads(layers_json)
            rows = {}
            for layer in layers:
                (slots,) = db.execute(
                    "SELECT slots FROM ledger_layout_history WHERE incarnation_id = ? "
                    "AND layer = ? AND version = ?",
                    (incarnation, layer, version),
                ).fetchone()
                rows[str(layer)] = json.loads(slots)
            commits.append({"version": version, "layers": layers, "rows": rows})
    return commits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_MOVES_PATH)
    args = parser.parse_args(argv)
    config = DemoConfig()
    with started_workspace(config) as workspace:
        result = run_case1(workspace)
        if result.failed:
            print(f"the demo's case 1 failed: {result.failed}", file=sys.stderr)
            return 1
        ledger = workspace.case_dir("case1") / "daemon0.sqlite"
        commits = read_commits(str(ledger))
    document = {
        "source": "scripts/gpu_single/record_demo_moves.py: the CPU demo's case 1, rank 0's ledger",
        "num_layers": config.num_layers,
        "num_physical_slots": config.num_physical_slots,
        "num_logical_experts": config.num_logical_experts,
        "rebalances": config.case1_rebalances,
        "layers_per_chunk": config.layers_per_chunk,
        "commits": commits,
    }
    args.out.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    print(f"wrote {len(commits)} commits to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
