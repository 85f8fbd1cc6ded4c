"""Fuzz a daemon at scale: generated requests, malformed and valid, from several engines.

    .venv/bin/python scripts/fuzz_daemon.py [--requests 10000] [--seed N] [--restart-every 1500]

Runs ``sglang_integration.testing.daemon_fuzz`` against model-less daemons (sglang 0.5.23's real
serve loop and request handling with the plugin, a real ledger), in a temporary directory, and
prints one table: requests sent, daemon crashes, replies that broke the protocol's rules, record
changes from refused requests, ``verify`` failures (each must be 0), then what else the run did.

Exit status: 0 when every fault count is 0, 1 otherwise (the first faults are printed).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence

from sglang_integration.testing.daemon_fuzz import FuzzTally, run_fuzz


def table(tally: FuzzTally, seconds: float) -> list[str]:
    rows = [
        ("requests", tally.requests),
        ("daemon crashes", tally.daemon_crashes),
        ("replies that broke the protocol's rules", tally.rule_breaks),
        ("record changes from refused requests", tally.refused_changes),
        ("verify failures", f"{tally.verify_failures} (of {tally.verifies} runs)"),
    ]
    lines = [f"  {name:<44}{value}" for name, value in rows]
    statuses = ", ".join(f"{status} {count}" for status, count in tally.statuses.most_common())
    lines += [
        "",
        f"  daemons run: {tally.daemon_runs}; engines killed (SIGKILL): {tally.engine_kills}; "
        f"exited: {tally.engine_exits}",
        f"  reply statuses: {statuses} ('None': closed without a reply)",
        f"  {seconds:.0f} s, {tally.requests / max(seconds, 1e-9):.0f} requests/s",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--restart-every", type=int, default=1500, metavar="REQUESTS")
    args = parser.parse_args(argv)
    # The shadow record in this process logs every refusal it judges; only faults matter here.
    logging.basicConfig(level=logging.ERROR)

    def progress(tally: FuzzTally) -> None:
        if tally.requests % 1000 < 25:
            print(f"  ... {tally.requests} requests, {tally.faults} faults", file=sys.stderr)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-daemon-") as directory:
        tally = run_fuzz(
            directory,
            args.requests,
            seed=args.seed,
            restart_every=args.restart_every,
            progress=progress,
        )
    print(f"Daemon fuzz, {tally.requests} generated requests, sglang's serve loop with the hooks")
    print("\n".join(table(tally, time.monotonic() - started)))
    for problem in tally.problems:
        print(f"  FAULT {problem}")
    return 0 if tally.faults == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
