"""Stage 3: ``scripts/bench_ledger.py --quick`` as is, its ledger files on this machine's disk.

Its output is shown after the table unchanged; the table holds its exit code and the lines that
name a target (``target ...``), each labelled with its section of the output (``(a)``...).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from gpu_single.results import Stage

BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "bench_ledger.py"
BENCH_TIMEOUT = 300.0


def run_bench_stage(
    python: str, directory: Path, script: Path = BENCH_SCRIPT, timeout: float = BENCH_TIMEOUT
) -> Stage:
    stage = Stage("3 bench", f"Stage 3: {script.name} --quick (the ledger on this machine's disk)")
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        result = subprocess.run(
            [python, str(script), "--quick", "--dir", str(directory)],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        stage.status = f"failed: no result within {timeout:.0f} s"
        stage.output = str(exc.stdout or "")
        stage.seconds = time.monotonic() - started
        return stage
    stage.seconds = time.monotonic() - started
    stage.output = result.stdout + (f"\n{result.stderr}" if result.returncode else "")
    stage.check("exit code", 0, result.returncode, result.returncode == 0)
    stage.info("ledger files in", str(directory))
    section = ""
    for line in result.stdout.splitlines():
        if line.startswith("("):
            section = line[: line.index(")") + 1] + " "
        elif "target" in line and ":" in line:
            label, value = line.split(":", 1)
            stage.info(f"bench {section}{label.strip()}", value.strip())
    return stage
