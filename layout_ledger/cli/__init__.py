"""The ``layout-ledger`` command line: ``parser`` (the arguments), ``app`` (dispatch and exit
codes), ``commands/`` (one module per verb), and the output helpers beside them.

Import-light on purpose: the console script imports this package before it knows which verb
runs, so nothing is imported here; ``main`` imports the application when it is called.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``layout-ledger`` (setup.cfg): run one command, return its exit code."""
    from layout_ledger.cli.app import main as run

    return run(argv)
